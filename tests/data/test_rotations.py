"""Rotation classes: labels, images, counts, and their place after the split."""

import io
import pickle

import numpy as np
import pytest
from PIL import Image

from circle_jax import config as config_lib
from circle_jax import data
from circle_jax.data import rotations
from circle_jax import config_facts
from circle_jax.train import config_checks
from circle_jax.train import run as run_lib

# A 2x3 "character": rotations of it are easy to write down by hand.
GLYPH = np.array([[1, 2, 3],
                  [4, 5, 6]], np.uint8)


def png(array):
  buf = io.BytesIO()
  Image.fromarray(np.asarray(array, np.uint8)).save(buf, format="PNG")
  return buf.getvalue()


def pixels(data_bytes):
  with Image.open(io.BytesIO(data_bytes)) as im:
    return np.asarray(im)


class _Source:
  """Records of 2 classes (3, 2 images), with a batched read."""

  def __init__(self):
    self.records = [{"image": png(GLYPH + 10 * i), "label": l,
                     "path": f"p{i}".encode()}
                    for i, l in enumerate([0, 0, 0, 1, 1])]

  def __len__(self):
    return len(self.records)

  def __getitem__(self, i):
    return self.records[i]

  def __getitems__(self, keys):
    return [self.records[k] for k in keys]


def test_rotate_encoded_by_hand():
  assert rotations.rotate_encoded(png(GLYPH), 0) == png(GLYPH)  # same bytes
  # Counter-clockwise quarter turns.
  np.testing.assert_array_equal(pixels(rotations.rotate_encoded(png(GLYPH), 1)),
                                [[3, 6], [2, 5], [1, 4]])
  np.testing.assert_array_equal(pixels(rotations.rotate_encoded(png(GLYPH), 2)),
                                [[6, 5, 4], [3, 2, 1]])
  np.testing.assert_array_equal(pixels(rotations.rotate_encoded(png(GLYPH), 3)),
                                [[4, 1], [5, 2], [6, 3]])


def test_four_rotations_labels_images_and_counts():
  src = _Source()
  rot = data.RotatedClasses(src, 4)
  assert len(rot) == 20
  # Copy k of class c is class k * C + c, with C = 2.
  np.testing.assert_array_equal(
      rot.labels, [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 5, 5, 6, 6, 6, 7, 7])
  assert data.split_labels(rot) is rot.labels
  # Record 5 * k + i is record i turned by k quarter turns.
  r = rot[5 * 1 + 3]
  assert r["label"] == 3 and r["path"] == b"p3"
  np.testing.assert_array_equal(pixels(r["image"]), np.rot90(GLYPH + 30, 1))
  np.testing.assert_array_equal(pixels(rot[5 * 3 + 0]["image"]),
                                [[4, 1], [5, 2], [6, 3]])
  batch = rot.__getitems__([0, 12, 19])
  assert [b["label"] for b in batch] == [0, 4, 7]
  for b, (k, i) in zip(batch, [(0, 0), (2, 2), (3, 4)]):
    np.testing.assert_array_equal(pixels(b["image"]),
                                  np.rot90(GLYPH + 10 * i, k))
  assert batch[0]["image"] == src[0]["image"]  # upright copy: same bytes
  # Half turns with R = 2.
  half = data.RotatedClasses(src, 2)
  np.testing.assert_array_equal(half.labels, [0, 0, 0, 1, 1, 2, 2, 2, 3, 3])
  np.testing.assert_array_equal(pixels(half[7]["image"]), np.rot90(GLYPH + 20, 2))
  assert pickle.loads(pickle.dumps(rot)).labels.tolist() == rot.labels.tolist()


def test_one_rotation_is_the_source_and_bad_counts_fail():
  src = _Source()
  one = data.RotatedClasses(src, 1)
  assert len(one) == len(src)
  assert [one[i] == src[i] for i in range(len(src))] == [True] * len(src)
  for bad in (0, 3, 8):
    with pytest.raises(ValueError, match="one of"):
      data.RotatedClasses(src, bad)
  with pytest.raises(IndexError):
    data.RotatedClasses(src, 4)[20]


def _config(**dataset):
  c = config_lib.base_config()
  c.dataset.name = "omniglot_small"
  for k, v in dataset.items():
    c.dataset[k] = v
  return c


def test_split_characters_first_then_rotate(omniglot_small_dir):
  c = _config(data_dir=str(omniglot_small_dir), validation_fraction=0.2,
              rotations=4)
  info = data.get_dataset_info("omniglot_small")
  train, val = run_lib.load_sources(c, info)
  base = run_lib.load_sources(_config(data_dir=str(omniglot_small_dir),
                                      validation_fraction=0.2), info)[0]
  # 136 characters: 27 held out upright, the other 109 in 4 rotations each.
  assert len(val.classes) == 27 and len(np.unique(val.labels)) == 27
  assert len(np.unique(train.labels)) == 4 * 109 == config_facts.num_classes(
      c, info)
  assert len(train) == 4 * len(base)
  # No base character in both splits: the paths of each rotation copy are
  # the kept characters' paths, disjoint from the validation ones.
  paths = lambda s, idx: {tuple(bytes(r["path"]).split(b"/")[-3:-1])
                          for r in s.__getitems__(idx)}  # (alphabet, char.)
  kept = paths(base, range(len(base)))
  held = paths(val, range(len(val)))
  assert kept and held and not kept & held
  for k in range(4):
    copy = range(k * len(base), (k + 1) * len(base), 97)
    assert paths(train, copy) <= kept
  # The validation images are upright (the source's bytes).
  src = data.load_split("omniglot_small", "train", data_dir=omniglot_small_dir)
  assert val[0]["image"] == src[int(val.indices[0])]["image"]


def test_default_off_is_unchanged(omniglot_small_dir):
  info = data.get_dataset_info("omniglot_small")
  c = _config(data_dir=str(omniglot_small_dir))
  assert c.dataset.rotations == 1
  train, val = run_lib.load_sources(c, info)
  assert val is None and type(train).__name__ == "ArrayRecordDataSource"
  train, _ = run_lib.load_sources(_config(data_dir=str(omniglot_small_dir),
                                          validation_fraction=0.2), info)
  assert isinstance(train, data.ClassSubset)
  assert config_facts.num_classes(c, info) == 136


@pytest.mark.parametrize("bad", [3, 0, -4, True])
def test_config_rejects_other_rotation_counts(bad):
  c = _config(rotations=bad)
  with pytest.raises(config_checks.ConfigError,
                     match=r"^config\.dataset\.rotations: must be one of "
                           r"\(1, 2, 4\)") as e:
    config_checks.check_config(c, device_count=1)
  assert "\n" not in str(e.value)


def test_mirror_classes_by_hand():
  np.testing.assert_array_equal(
      pixels(rotations.rotate_encoded(png(GLYPH), 0, mirror=True)),
      [[3, 2, 1], [6, 5, 4]])
  # Flipped first, then turned a quarter counter-clockwise.
  np.testing.assert_array_equal(
      pixels(rotations.rotate_encoded(png(GLYPH), 1, mirror=True)),
      [[1, 4], [2, 5], [3, 6]])
  src = _Source()
  d4 = data.RotatedClasses(src, 4, mirror=True)
  assert len(d4) == 40 and d4.copies == 8 == data.class_copies(4, True)
  np.testing.assert_array_equal(d4.labels, np.repeat(np.arange(8), 5) * 2
                                + np.tile([0, 0, 0, 1, 1], 8))
  # Copy k >= 4: the mirror image turned by k - 4 quarter turns; the 8
  # copies of one image are the 8 distinct symmetries of the square.
  for k in range(8):
    r = d4[5 * k + 3]
    want = np.rot90(np.fliplr(GLYPH + 30) if k >= 4 else GLYPH + 30, k % 4)
    np.testing.assert_array_equal(pixels(r["image"]), want)
    assert r["label"] == 2 * k + 1
  square = np.arange(9, dtype=np.uint8).reshape(3, 3)
  assert len({pixels(rotations.rotate_encoded(png(square), k % 4,
                                              mirror=k >= 4)).tobytes()
              for k in range(8)}) == 8
  # Mirror without rotations: 2 copies.
  flip = data.RotatedClasses(src, 1, mirror=True)
  np.testing.assert_array_equal(flip.labels, [0, 0, 0, 1, 1, 2, 2, 2, 3, 3])
  np.testing.assert_array_equal(pixels(flip[6]["image"]),
                                np.fliplr(GLYPH + 10))
  assert flip[1]["image"] == src[1]["image"]


def test_mirror_classes_from_the_config(omniglot_small_dir):
  info = data.get_dataset_info("omniglot_small")
  c = _config(data_dir=str(omniglot_small_dir), validation_fraction=0.2,
              rotations=4, mirror_classes=True)
  train, val = run_lib.load_sources(c, info)
  assert len(np.unique(train.labels)) == 8 * 109 == config_facts.num_classes(
      c, info)
  assert len(np.unique(val.labels)) == 27  # held out upright, unmirrored
  src = data.load_split("omniglot_small", "train", data_dir=omniglot_small_dir)
  assert val[0]["image"] == src[int(val.indices[0])]["image"]


def test_validation_by_alphabet(omniglot_small_dir):
  info = data.get_dataset_info("omniglot_small")
  c = _config(data_dir=str(omniglot_small_dir), validation_fraction=0.2,
              validation_by="superclass", rotations=4)
  train, val = run_lib.load_sources(c, info)
  alphabet = lambda s, idx: {bytes(r["path"]).split(b"/")[1]
                             for r in s.__getitems__(idx)}
  held = alphabet(val, range(len(val)))
  kept = alphabet(train, range(0, len(train), 7))
  # One whole alphabet (round(0.2 x 5)) held out, all its characters.
  assert len(held) == 1 and not held & kept and len(kept) == 4
  n = info.train_superclasses[int(data.holdout_superclasses(5, 0.2, 0)[0])]
  assert len(np.unique(val.labels)) == n
  assert config_facts.num_classes(c, info) == 4 * (136 - n) == len(
      np.unique(train.labels))


@pytest.mark.parametrize("name,by,match", [
    ("omniglot_small", "alphabet", r"must be one of \('class', 'superclass'\)"),
    ("digits", "superclass", "dataset 'digits' declares no superclasses"),
])
def test_config_rejects_bad_validation_by(name, by, match):
  c = _config(validation_fraction=0.2, validation_by=by)
  c.dataset.name = name
  with pytest.raises(config_checks.ConfigError,
                     match=r"^config\.dataset\.validation_by: " + match) as e:
    config_checks.check_config(c, device_count=1)
  assert "\n" not in str(e.value)
