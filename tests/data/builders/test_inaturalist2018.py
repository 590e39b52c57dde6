"""iNaturalist 2018: the official JSONs and Smooth-AP's split lists, read
from a fake folder in PML's layout (nothing is downloaded)."""

import json

import numpy as np
import pytest

from circle_jax import data
from tests.data import fixtures


def _folder(root, train_classes, test_classes):
  """The JSONs (images split over train and val, as the official ones),
  the split lists and the images; class c has c % 3 + 1 images."""
  images, annos, lists, files = [], [], {"train": [], "test": []}, {}
  for split, classes in (("train", train_classes), ("test", test_classes)):
    for c in classes:
      for k in range(c % 3 + 1):
        path = f"train_val2018/Plantae/{c}/{k}.jpg"
        images.append({"id": len(images), "file_name": path})
        annos.append({"image_id": len(annos), "category_id": c})
        lists[split].append(path)
        files[path] = fixtures.encode("JPEG", len(images))
  half = len(images) // 2
  for name, rows in (("train2018.json", slice(0, half)),
                     ("val2018.json", slice(half, None))):
    files[name] = json.dumps({"images": images[rows],
                              "annotations": annos[rows]}).encode()
  for split, paths in lists.items():
    files[f"Inat_dataset_splits/Inaturalist_{split}_set1.txt"] = (
        "\n".join(paths) + "\n").encode()
  fixtures.write_tree(files, root)
  return lists


def test_build_reads_the_jsons_and_the_split_lists(tmp_path):
  lists = _folder(tmp_path / "m", [7, 3, 12], [5, 40])
  splits = {s: data.load_split("inaturalist2018", s, data_dir=tmp_path / "d",
                               manual_dir=tmp_path / "m")
            for s in ("train", "test")}
  # Classes in category order (3, 7, 12 | 5, 40), c % 3 + 1 images each.
  np.testing.assert_array_equal(data.split_labels(splits["train"]),
                                [0, 1, 1, 2])
  np.testing.assert_array_equal(data.split_labels(splits["test"]),
                                [0, 0, 0, 1, 1])
  for split, src in splits.items():
    paths = sorted(src[i]["path"].decode() for i in range(len(src)))
    assert paths == sorted(lists[split])


def test_missing_files_and_foreign_lists_fail_in_one_line(tmp_path):
  with pytest.raises(data.MissingDatasetFilesError, match="train2018.json"):
    data.load_split("inaturalist2018", "train", data_dir=tmp_path / "d",
                    manual_dir=tmp_path)
  _folder(tmp_path / "m", [1], [2])
  (tmp_path / "m" / "Inat_dataset_splits" / "Inaturalist_test_set1.txt"
   ).write_text("train_val2018/x/none.jpg\n")
  with pytest.raises(ValueError, match="different releases"):
    data.load_split("inaturalist2018", "test", data_dir=tmp_path / "d2",
                    manual_dir=tmp_path / "m")
