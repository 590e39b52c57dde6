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


# The same images in every layout: class ids and the classification
# benchmark's train/test halves (which the zero-shot split ignores).
CLASS_IDS = [1, 98, 99, 196, 5, 120, 98, 1, 5, 150, 99]
TESTS = [0, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1]


def _write_layout(root, layout, variant):
  """Writes one layout of the fixture; returns the manual_dir to give."""
  files = fixtures.cars_layouts(CLASS_IDS, TESTS)[layout]
  pick = lambda prefix: {k: v for k, v in files.items()
                         if k.startswith(prefix)}
  if variant == "folders":
    fixtures.write_tree(files, root)
  elif layout == "official":        # car_ims.tgz + cars_annos.mat
    fixtures.write_tree(pick("car_ims/"), root, archive="car_ims.tgz")
    (root / "cars_annos.mat").write_bytes(files["cars_annos.mat"])
  elif layout == "tfds":            # the four downloads of tfds's builder
    for split in ("train", "test"):
      fixtures.write_tree(pick(f"cars_{split}/"), root,
                          archive=f"cars_{split}.tgz")
    fixtures.write_tree(pick("devkit/"), root, archive="car_devkit.tgz")
    (root / "cars_test_annos_withlabels.mat").write_bytes(
        files["cars_test_annos_withlabels.mat"])
  else:                             # the Kaggle zip, not extracted
    fixtures.write_tree(files, root,
                        archive="stanford-car-dataset-by-classes-folder.zip")
  return root


def _labels_by_image(tmp_path, manual_dir):
  """``{image bytes: (split, label)}`` of a build."""
  out = {}
  for split in ("train", "test"):
    src = data.load_split("cars196", split, data_dir=tmp_path / "d",
                          manual_dir=manual_dir)
    for i in range(len(src)):
      r = src[i]
      assert r["image"] not in out
      out[r["image"]] = (split, int(r["label"]))
  return out


def test_every_layout_gives_the_same_images_the_same_labels(tmp_path):
  images = fixtures.cars_layouts(CLASS_IDS, TESTS)["images"]
  train = sorted({c for c in CLASS_IDS if c <= 98})
  test = sorted({c for c in CLASS_IDS if c > 98})
  want = {im: ("train", train.index(c)) if c <= 98 else ("test",
                                                         test.index(c))
          for im, c in zip(images, CLASS_IDS)}
  cases = [(layout, variant) for layout in ("official", "tfds", "pml")
           for variant in ("folders", "archives")]
  for n, (layout, variant) in enumerate(cases):
    m = _write_layout(tmp_path / f"m{n}", layout, variant)
    got = _labels_by_image(tmp_path / f"b{n}", m)
    assert got == want, (layout, variant)


@pytest.mark.parametrize("layout,inner", [
    ("official", "car_ims"), ("tfds", "cars_train"), ("pml", "car_data")])
def test_manual_dir_may_be_the_extracted_image_folder(tmp_path, layout,
                                                      inner):
  m = _write_layout(tmp_path / "m", layout, "folders")
  got = _labels_by_image(tmp_path, m / inner)
  assert len(got) == len(CLASS_IDS)


def test_torchvisions_root_holds_stanford_cars(tmp_path):
  _write_layout(tmp_path / "root" / "stanford_cars", "tfds", "folders")
  assert len(_labels_by_image(tmp_path, tmp_path / "root")) == len(CLASS_IDS)


def test_a_missing_file_lists_every_accepted_layout(tmp_path):
  m = _write_layout(tmp_path / "m", "tfds", "archives")
  (m / "cars_test_annos_withlabels.mat").unlink()
  with pytest.raises(data.MissingDatasetFilesError) as e:
    data.load_split("cars196", "train", data_dir=tmp_path / "d",
                    manual_dir=m)
  lines = str(e.value).splitlines()
  assert lines[0].startswith(
      "Dataset 'cars196': 'cars_test_annos_withlabels.mat' (or another of "
      "the 3 accepted layouts below) not found in manual_dir")
  text = str(e.value)
  for name in ("official (all of)", "tfds/torchvision (all of)",
               "pytorch-metric-learning (all of)", "car_ims.tgz",
               "cars_annos.mat", "cars_train.tgz", "car_devkit.tgz",
               "names.csv", "stanford-car-dataset-by-classes-folder.zip"):
    assert name in text, name


def test_a_mirror_class_outside_names_csv_is_named(tmp_path):
  m = _write_layout(tmp_path / "m", "pml", "folders")
  with open(m / "anno_test.csv", "a") as f:
    f.write("09999.jpg,1,2,3,4,197\n")
  with pytest.raises(ValueError, match="class 197 of '09999.jpg'"):
    data.load_split("cars196", "train", data_dir=tmp_path / "d",
                    manual_dir=m)
