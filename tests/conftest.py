"""Test setup: 8 simulated CPU devices, set before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
# JAX's persistent compilation cache stays off in the tests (and in the jobs
# they start) unless a test is about it (tests/test_hostenv.py).
os.environ["CIRCLE_JAX_COMPILATION_CACHE"] = "off"

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
OMNIGLOT_DIR = REPO_ROOT / "circle_jax" / "data" / "archives" / "omniglot_small"


@pytest.fixture(scope="session")
def omniglot_dir():
  """The official Omniglot 'background small' archives shipped in the repo."""
  assert (OMNIGLOT_DIR / "images_background_small1.zip").exists(), OMNIGLOT_DIR
  return OMNIGLOT_DIR
