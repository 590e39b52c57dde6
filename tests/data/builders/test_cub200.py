"""CUB-200-2011: split rule, both layouts, errors."""

import numpy as np
import pytest

from circle_jax import data
from circle_jax.data import builders
from tests.data import fixtures

TINY = {1: 3, 2: 1, 100: 2, 101: 2, 150: 1, 200: 3}


def test_full_metadata_gives_official_split_sizes(tmp_path):
  files = fixtures.cub_files(fixtures.cub_full_counts(), with_images=False)
  fixtures.write_tree(files, tmp_path)
  _, plans = builders.Cub200(data_dir=str(tmp_path / "d")).plan_splits(tmp_path)
  train, train_labels, train_classes = plans["train"]
  test, test_labels, test_classes = plans["test"]
  assert (len(train), len(test)) == (5864, 5924)
  assert train_classes == list(range(1, 101))
  assert test_classes == list(range(101, 201))
  np.testing.assert_array_equal(np.unique(train_labels), np.arange(100))
  np.testing.assert_array_equal(np.unique(test_labels), np.arange(100))
  # Labels are the class id minus the split's first class id.
  for im, label in zip(test[::97], test_labels[::97]):
    assert im.path.startswith(f"images/{label + 101:03d}.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  root = tmp_path_factory.mktemp("cub")
  files = fixtures.cub_files(TINY)
  fixtures.write_tree(files, root / "tgz", archive="CUB_200_2011.tgz")
  fixtures.write_tree(files, root / "extracted")
  # The extracted folder under another name, given as manual_dir itself.
  fixtures.write_tree({k[len("CUB_200_2011/"):]: v for k, v in files.items()
                       if k.startswith("CUB_200_2011/")}, root / "birds")
  return root, files


@pytest.mark.parametrize("layout", ["tgz", "extracted",
                                    "extracted/CUB_200_2011", "birds"])
def test_build_reads_every_image_with_contiguous_labels(tiny, tmp_path, layout):
  root, files = tiny
  for split, classes in (("train", [1, 2, 100]), ("test", [101, 150, 200])):
    src = data.load_split("cub200", split, data_dir=tmp_path,
                          manual_dir=root / layout)
    recs = [src[i] for i in range(len(src))]
    assert len(recs) == sum(TINY[c] for c in classes)
    for r in recs:
      path = r["path"].decode()
      class_id = int(path.split("/")[1][:3])
      assert classes.index(class_id) == r["label"]
      assert r["image"] == files[f"CUB_200_2011/{path}"]
    # Stored sorted by (label, path); labels known without reading images.
    keys = [(r["label"], r["path"]) for r in recs]
    assert keys == sorted(keys)
    np.testing.assert_array_equal(data.split_labels(src),
                                  [r["label"] for r in recs])


def test_missing_files_error_names_expected_files(tmp_path):
  (tmp_path / "manual").mkdir()
  (tmp_path / "manual" / "unrelated.txt").write_text("x")
  with pytest.raises(data.MissingDatasetFilesError) as e:
    data.load_split("cub200", "train", data_dir=tmp_path / "d",
                    manual_dir=tmp_path / "manual")
  msg = str(e.value)
  assert "CUB_200_2011.tgz" in msg and "vision.caltech.edu" in msg
  assert str(tmp_path / "manual") in msg


def test_corrupt_image_is_named(tmp_path):
  files = fixtures.cub_files({1: 2, 101: 2})
  bad = sorted(k for k in files if k.endswith(".jpg"))[0]
  files[bad] = b"\xff\xd8 not a jpeg"
  fixtures.write_tree(files, tmp_path / "m")
  with pytest.raises(data.CorruptImageError, match=bad.split("/", 1)[1]):
    data.load_split("cub200", "train", data_dir=tmp_path / "d",
                    manual_dir=tmp_path / "m")


def test_image_listed_but_absent_is_named(tmp_path):
  files = fixtures.cub_files({1: 2, 101: 2})
  gone = sorted(k for k in files if k.endswith(".jpg"))[-1]
  del files[gone]
  fixtures.write_tree(files, tmp_path / "m", archive="CUB_200_2011.tgz")
  with pytest.raises(data.CorruptImageError, match="missing"):
    data.load_split("cub200", "test", data_dir=tmp_path / "d",
                    manual_dir=tmp_path / "m")
