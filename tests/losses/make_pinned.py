"""Regenerates ``tests/losses/data/pinned.npz`` (see ``pinned_cases``).

Run only on purpose, on code whose results are to be pinned::

  PYTHONPATH=$PWD python -m tests.losses.make_pinned
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402

import numpy as np  # noqa: E402

from tests.losses import pinned_cases  # noqa: E402

PATH = pathlib.Path(__file__).parent / "data" / "pinned.npz"


def main():
  arrays = {}
  for name, thunk in pinned_cases.cases().items():
    arrays.update(pinned_cases.flatten(name, thunk()))
  np.savez_compressed(PATH, **arrays)
  print(f"wrote {len(arrays)} arrays to {PATH}")


if __name__ == "__main__":
  main()
