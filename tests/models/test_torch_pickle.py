"""Tests of circle_jax/models/torch_pickle.py, the torch-free .pth reader.

The fixtures in tests/models/data were written by PyTorch 2.13.0
(tests/models/data/make_torch_fixtures.py) in both the zip and the legacy
format; the expected values below follow from that script, so these tests
run without PyTorch.
"""

import collections
import os
import pathlib
import pickle
import zipfile

import chex
import ml_dtypes
import numpy as np
import pytest

from circle_jax.errors import WeightsFileError
from circle_jax.models import convert
from circle_jax.models import torch_pickle

DATA = pathlib.Path(__file__).parent / "data"


def expected_fixture():
  base = np.arange(24, dtype=np.float32).reshape(4, 6)
  return collections.OrderedDict(
      [("conv.weight", np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2) / 8),
       ("transposed", base.T),
       ("offset_view", base[1:, 2:]),
       ("base", base),
       ("long", np.array([1, 2, -3], np.int64)),
       ("half", np.array([0.5, -1.5], np.float16)),
       ("bf16", np.array([0.5, -2.0], ml_dtypes.bfloat16)),
       ("double_scalar", np.array(3.25, np.float64)),
       ("empty", np.zeros((0, 3), np.float32)),
       ("param", np.full((2, 2), 7.0, np.float32)),
       ("bn.num_batches_tracked", np.array(5, np.int64))])


def _assert_same(got, want):
  assert list(got) == list(want)                     # the file's order
  # Same dtypes, shapes and values.
  chex.assert_trees_all_equal(dict(got), dict(want), strict=True)


@pytest.mark.parametrize("name", ["tiny_zip.pth", "tiny_legacy.pth"])
def test_reads_torch_written_files_without_torch(name):
  got = torch_pickle.load_torch_file(DATA / name)
  assert isinstance(got, collections.OrderedDict)
  _assert_same(got, expected_fixture())
  assert got["transposed"].flags.c_contiguous  # copies, not strided views


def test_load_state_dict_unwraps_state_dict_and_dataparallel_prefix():
  got = convert.load_state_dict(DATA / "tiny_wrapped.pth")
  _assert_same(got, expected_fixture())


def test_round_trip_against_torch_load_when_available(tmp_path):
  torch = pytest.importorskip("torch")
  gen = torch.Generator().manual_seed(0)
  sd = {"w": torch.randn(5, 3, 3, 3, generator=gen),
        "v": torch.randn(7, 4, generator=gen)[::2, 1:],
        "i": torch.randint(0, 9, (6,), generator=gen, dtype=torch.int32)}
  for legacy in (False, True):
    path = tmp_path / f"x{legacy}.pth"
    torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
    got = torch_pickle.load_torch_file(path)
    chex.assert_trees_all_equal(
        dict(got), {k: v.numpy() for k, v in torch.load(path).items()})


class _Evil:
  def __reduce__(self):
    return (os.system, ("echo pwned > /dev/null",))


def test_refuses_arbitrary_objects_in_zip_and_legacy_files(tmp_path):
  payload = pickle.dumps({"x": _Evil()}, protocol=2)
  zpath = tmp_path / "evil.pth"
  with zipfile.ZipFile(zpath, "w") as zf:
    zf.writestr("archive/data.pkl", payload)
  with pytest.raises(pickle.UnpicklingError, match="Refusing.*system"):
    torch_pickle.load_torch_file(zpath)
  lpath = tmp_path / "evil_legacy.pth"
  with open(lpath, "wb") as f:
    for obj in (torch_pickle._LEGACY_MAGIC_NUMBER,
                torch_pickle._LEGACY_PROTOCOL_VERSION, {"little_endian": True}):
      pickle.dump(obj, f, protocol=2)
    f.write(payload)
  with pytest.raises(pickle.UnpicklingError, match="Refusing"):
    torch_pickle.load_torch_file(lpath)


def test_truncated_and_foreign_files_are_clear_errors(tmp_path):
  raw = (DATA / "tiny_legacy.pth").read_bytes()
  cut = tmp_path / "cut.pth"
  cut.write_bytes(raw[:-40])
  with pytest.raises(pickle.UnpicklingError, match="truncated"):
    torch_pickle.load_torch_file(cut)
  other = tmp_path / "other.pth"
  other.write_bytes(pickle.dumps([1, 2, 3]))
  with pytest.raises(ValueError, match="magic"):
    torch_pickle.load_torch_file(other)
  with pytest.raises(WeightsFileError, match="missing.pth' not found"):
    convert.load_state_dict(tmp_path / "missing.pth")
