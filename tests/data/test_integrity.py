"""Damaged prepared files are named when the split is opened."""

import os
import shutil

import pytest

from circle_jax.data import integrity
from circle_jax.data import registry


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """A real prepared digits dataset (sklearn's bundled digits, no download)."""
  data_dir = tmp_path_factory.mktemp("tfds")
  registry.load_split("digits", "train", data_dir=str(data_dir))
  return data_dir


def _copy(prepared, tmp_path):
  data_dir = tmp_path / "tfds"
  shutil.copytree(prepared, data_dir)
  builder = registry.get_builder("digits", data_dir=str(data_dir))
  path = str(builder.info.splits["train"].filepaths[0])
  return builder, path


def test_good_files_pass(prepared, tmp_path):
  builder, _ = _copy(prepared, tmp_path)
  integrity.check_split(builder, "train")
  integrity.check_split(builder, "test")


@pytest.mark.parametrize("damage", ["truncate", "header", "delete", "empty"])
def test_damaged_shard_is_one_line_naming_file_and_fix(prepared, tmp_path,
                                                       damage):
  builder, path = _copy(prepared, tmp_path)
  if damage == "truncate":
    with open(path, "r+b") as f:
      f.truncate(200)
  elif damage == "header":  # 100 bytes overwritten in the first chunk
    with open(path, "r+b") as f:
      f.seek(100)
      f.write(b"\xff" * 100)
  elif damage == "delete":
    os.remove(path)
  else:
    open(path, "wb").close()
  with pytest.raises(integrity.CorruptPreparedDataError) as e:
    integrity.check_split(builder, "train")
  msg = str(e.value)
  assert "\n" not in msg
  assert path in msg
  assert f"rm -r {builder.data_dir}" in msg
  # The other split is untouched and still passes.
  integrity.check_split(builder, "test")


def test_record_count_mismatch_is_reported(prepared, tmp_path):
  builder, path = _copy(prepared, tmp_path)
  n = builder.info.splits["train"].num_examples
  with pytest.raises(integrity.CorruptPreparedDataError,
                     match=f"holds {n} records where the dataset info "
                     f"recorded {n + 1}"):
    integrity.check_shards([path], [n + 1], dataset="digits",
                           prepared_dir=str(builder.data_dir))
