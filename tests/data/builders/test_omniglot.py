"""Omniglot and omniglot_small: fixtures, the download path, real archives."""

import io
import itertools
import zipfile

import numpy as np
import pytest
from PIL import Image

from circle_jax import data
from circle_jax.data import builders
from tests.data import fixtures

BACKGROUND = {"Greek": 3, "Latin": 2, "Korean": 1}
EVALUATION = {"Atlantean": 2, "Kannada": 1}


def _zips(root):
  fixtures.write_tree(fixtures.omniglot_files("images_background", BACKGROUND),
                      root, archive="images_background.zip")
  fixtures.write_tree(
      fixtures.omniglot_files("images_evaluation", EVALUATION, seed=7),
      root, archive="images_evaluation.zip")
  return root


def test_omniglot_from_manual_zips(tmp_path):
  m = _zips(tmp_path / "m")
  train = data.load_split("omniglot", "train", data_dir=tmp_path / "d",
                          manual_dir=m)
  test = data.load_split("omniglot", "test", data_dir=tmp_path / "d",
                         manual_dir=m)
  assert (len(train), len(test)) == (6 * 2, 3 * 2)  # characters x drawers
  # Classes are (alphabet, character) pairs in sorted order.
  want = [f"{a}/character{c:02d}" for a in sorted(BACKGROUND)
          for c in range(1, BACKGROUND[a] + 1)]
  meta = train.dataset_info.metadata["splits"]["train"]
  assert meta["class_names"] == want
  for i in range(len(train)):
    path = train[i]["path"].decode()
    assert want[train[i]["label"]] == "/".join(path.split("/")[1:3])


class _FakeDownloads:
  """Stands in for the tfds download manager: serves local zips by URL."""

  def __init__(self, files):
    self.files, self.urls = files, []

  def download(self, urls):
    self.urls.append(dict(urls))
    return {k: self.files[u.rsplit("/", 1)[1]] for k, u in urls.items()}


def test_omniglot_downloads_official_urls_when_allowed(tmp_path):
  m = _zips(tmp_path / "zips")
  fake = _FakeDownloads({"images_background.zip": m / "images_background.zip",
                         "images_evaluation.zip": m / "images_evaluation.zip"})
  builder = builders.Omniglot(data_dir=str(tmp_path / "d"), allow_download=True)
  _, plans = builder.plan_splits(None, fake)
  assert fake.urls == [{
      "background": "https://github.com/brendenlake/omniglot/raw/master/"
                    "python/images_background.zip",
      "evaluation": "https://github.com/brendenlake/omniglot/raw/master/"
                    "python/images_evaluation.zip"}]
  assert (len(plans["train"][0]), len(plans["test"][0])) == (12, 6)


def test_omniglot_without_download_names_files_and_urls(tmp_path):
  m = tmp_path / "m"
  fixtures.write_tree(fixtures.omniglot_files("images_background", BACKGROUND),
                      m)  # extracted background only; evaluation missing
  with pytest.raises(data.MissingDatasetFilesError) as e:
    data.load_split("omniglot", "test", data_dir=tmp_path / "d", manual_dir=m)
  msg = str(e.value)
  missing = msg.split("Missing:")[1].split("Expected layout")[0]
  assert "images_evaluation.zip" in missing
  assert "images_background.zip" not in missing
  assert "python/images_evaluation.zip" in msg and "download=True" in msg


def test_truncated_zip_is_named(tmp_path):
  m = _zips(tmp_path / "m")
  raw = (m / "images_evaluation.zip").read_bytes()
  (m / "images_evaluation.zip").write_bytes(raw[: len(raw) // 3])
  with pytest.raises(data.CorruptImageError, match="images_evaluation.zip"):
    data.load_split("omniglot", "train", data_dir=tmp_path / "d", manual_dir=m)


def test_omniglot_small_split_rule_on_fixtures(tmp_path):
  small1 = {"Balinese": 2, "Greek": 1, "Latin": 1}
  small2 = {"Greek": 1, "Latin": 1, "Sanskrit": 2, "Tagalog": 1}
  fixtures.write_tree(fixtures.omniglot_files("images_background_small1",
                                              small1), tmp_path)
  fixtures.write_tree(fixtures.omniglot_files("images_background_small2",
                                              small2), tmp_path,
                      archive="images_background_small2.zip")
  _, plans = builders.OmniglotSmall(
      data_dir=str(tmp_path / "d")).plan_splits(tmp_path)
  assert {k[0] for k in plans["train"][2]} == set(small1)
  assert {k[0] for k in plans["test"][2]} == {"Sanskrit", "Tagalog"}
  assert len(plans["test"][0]) == 3 * 2


# ------------------------------------------------- the real bundled archives --


def test_bundled_archives_are_checked_by_md5(tmp_path, omniglot_dir):
  from circle_jax.data.builders import omniglot
  omniglot.check_bundled_archives(omniglot_dir)
  for name in omniglot.BUNDLED_MD5:
    (tmp_path / name).write_bytes((omniglot_dir / name).read_bytes())
  omniglot.check_bundled_archives(tmp_path)
  raw = bytearray((tmp_path / "images_background_small2.zip").read_bytes())
  raw[1000] ^= 1
  (tmp_path / "images_background_small2.zip").write_bytes(bytes(raw))
  with pytest.raises(data.CorruptImageError,
                     match="small2.zip has md5 .*expected b75a71a5"):
    omniglot.check_bundled_archives(tmp_path)
  (tmp_path / "images_background_small1.zip").unlink()
  with pytest.raises(data.CorruptImageError, match="small1.zip is missing"):
    omniglot.check_bundled_archives(tmp_path)


def test_omniglot_small_real_archives(omniglot_small_dir, omniglot_dir):
  train = data.load_split("omniglot_small", "train", data_dir=omniglot_small_dir)
  test = data.load_split("omniglot_small", "test", data_dir=omniglot_small_dir)
  spec = data.get_dataset_info("omniglot_small")
  assert (len(train), len(test)) == (2720, 2120)
  assert (len(train), len(test)) == (spec.num_images["train"],
                                     spec.num_images["test"])
  train_labels, test_labels = data.split_labels(train), data.split_labels(test)
  assert train_labels.max() + 1 == spec.num_train_classes == 136
  assert test_labels.max() + 1 == spec.num_test_classes == 106
  np.testing.assert_array_equal(np.bincount(test_labels), np.full(106, 20))
  meta = test.dataset_info.metadata["splits"]["test"]
  assert {n.split("/")[0] for n in meta["class_names"]} == {
      "Japanese_(katakana)", "Sanskrit", "Tagalog"}
  # The spec's train superclasses (the alphabets' character counts in label
  # order) are those of the prepared split's class names, each contiguous.
  names = train.dataset_info.metadata["splits"]["train"]["class_names"]
  runs = [(a, len(list(g))) for a, g in
          itertools.groupby(n.split("/")[0] for n in names)]
  assert [a for a, _ in runs] == ["Balinese", "Early_Aramaic", "Greek",
                                  "Korean", "Latin"]
  assert tuple(n for _, n in runs) == spec.train_superclasses
  assert spec.superclass_name == "alphabet"
  # Records hold the archive's PNG bytes unchanged, under the official path.
  with zipfile.ZipFile(omniglot_dir / "images_background_small2.zip") as zf:
    for i in (0, 777, 2119):
      r = test[i]
      assert r["image"] == zf.read(r["path"].decode())
      assert r["label"] == test_labels[i]
      assert Image.open(io.BytesIO(r["image"])).size == (105, 105)
