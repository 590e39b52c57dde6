"""Stanford Cars-196: split rule on the official annotation file, layouts, errors."""

import numpy as np
import pytest

from circle_jax import data
from circle_jax.data import builders
from tests.data import fixtures


def test_full_annotations_give_official_split_sizes(tmp_path):
  ids = fixtures.cars_full_class_ids()
  (tmp_path / "car_ims").mkdir()
  (tmp_path / "cars_annos.mat").write_bytes(
      fixtures.cars_annos(ids, tests=np.arange(len(ids)) % 2))
  _, plans = builders.Cars196(data_dir=str(tmp_path / "d")).plan_splits(tmp_path)
  assert len(ids) == 16185
  assert (len(plans["train"][0]), len(plans["test"][0])) == (8054, 8131)
  assert plans["train"][2] == list(range(1, 99))
  assert plans["test"][2] == list(range(99, 197))
  for im, label in zip(plans["test"][0][::50], plans["test"][1][::50]):
    index = int(im.path.split("/")[1][:6]) - 1
    assert ids[index] == label + 99


@pytest.mark.parametrize("layout", ["tgz", "extracted"])
def test_build(tmp_path, layout):
  class_ids = [1, 98, 99, 196, 1, 120, 98]
  images = {f"car_ims/{i + 1:06d}.jpg": fixtures.encode("JPEG", i)
            for i in range(len(class_ids))}
  m = tmp_path / "m"
  fixtures.write_tree(images, m, archive="car_ims.tgz" if layout == "tgz"
                      else None)
  (m / "cars_annos.mat").write_bytes(fixtures.cars_annos(class_ids))
  for split, classes in (("train", [1, 98]), ("test", [99, 120, 196])):
    src = data.load_split("cars196", split, data_dir=tmp_path / "d",
                          manual_dir=m)
    want = sorted(f"car_ims/{i + 1:06d}.jpg" for i, c in enumerate(class_ids)
                  if c in classes)
    got = [src[i] for i in range(len(src))]
    assert sorted(r["path"].decode() for r in got) == want
    for r in got:
      path = r["path"].decode()
      assert r["image"] == images[path]
      assert classes[r["label"]] == class_ids[int(path[8:14]) - 1]


def test_missing_annotations_named_alone(tmp_path):
  fixtures.write_tree({"car_ims/000001.jpg": fixtures.encode("JPEG", 0)},
                      tmp_path / "m", archive="car_ims.tgz")
  with pytest.raises(data.MissingDatasetFilesError) as e:
    data.load_split("cars196", "train", data_dir=tmp_path / "d",
                    manual_dir=tmp_path / "m")
  missing = str(e.value).split("Missing:")[1].split("Expected layout")[0]
  named = [l for l in missing.splitlines() if l.startswith("  - ")]
  assert named == ["  - 'cars_annos.mat'"]


def test_unreadable_annotation_file(tmp_path):
  (tmp_path / "m" / "car_ims").mkdir(parents=True)
  (tmp_path / "m" / "cars_annos.mat").write_bytes(b"MATLAB 5.0 garbage")
  with pytest.raises(ValueError, match="cars_annos.mat"):
    data.load_split("cars196", "train", data_dir=tmp_path / "d",
                    manual_dir=tmp_path / "m")
