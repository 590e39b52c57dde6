"""In-Shop: the official partition file, query/gallery shared labels."""

import numpy as np
import pytest

from circle_jax import data
from circle_jax.data import builders
from tests.data import fixtures


def test_full_partition_gives_official_split_sizes(tmp_path):
  train, query, gallery = fixtures.inshop_full_counts()
  rows = fixtures.inshop_rows(train, None, query, gallery)
  (tmp_path / "Eval").mkdir()
  (tmp_path / "Eval" / "list_eval_partition.txt").write_bytes(
      fixtures.inshop_partition(rows))
  (tmp_path / "img").mkdir()
  _, plans = builders.Inshop(data_dir=str(tmp_path / "d")).plan_splits(tmp_path)
  sizes = {s: (len(p[0]), len(set(im.class_key for im in p[0])))
           for s, p in plans.items()}
  assert sizes == {"train": (25882, 3997), "query": (14218, 3985),
                   "gallery": (12612, 3985)}
  assert set(plans["train"][2]).isdisjoint(plans["query"][2])
  assert plans["query"][2] == plans["gallery"][2]


@pytest.mark.parametrize("layout", ["img.zip", "Img/img.zip", "img/"])
def test_build_query_gallery_share_labels(tmp_path, layout):
  # The last test item has no query image: query labels skip it.
  rows = fixtures.inshop_rows([2, 1], None, [1, 2, 0], [2, 1, 1])
  images = {p: fixtures.encode("JPEG", i) for i, (p, _, _) in enumerate(rows)}
  m = tmp_path / "m"
  fixtures.write_tree(images, m, archive=None if layout == "img/" else layout)
  (m / "list_eval_partition.txt").write_bytes(fixtures.inshop_partition(rows))
  src = {s: data.load_split("inshop", s, data_dir=tmp_path / "d",
                            manual_dir=m)
         for s in ("train", "query", "gallery")}
  assert {s: len(v) for s, v in src.items()} == {
      "train": 3, "query": 3, "gallery": 4}
  item_of = {p: i for p, i, _ in rows}
  label_of_item = {}
  for s in ("query", "gallery"):
    for i in range(len(src[s])):
      r = src[s][i]
      item = item_of[r["path"].decode()]
      assert label_of_item.setdefault(item, r["label"]) == r["label"]
      assert r["image"] == images[r["path"].decode()]
  assert sorted(label_of_item.values()) == [0, 1, 2]
  np.testing.assert_array_equal(data.split_labels(src["query"]), [0, 1, 1])
  np.testing.assert_array_equal(data.split_labels(src["gallery"]),
                                [0, 0, 1, 2])


def test_truncated_partition_file(tmp_path):
  rows = fixtures.inshop_rows([2], None, [1], [1])
  text = fixtures.inshop_partition(rows).decode().splitlines()
  (tmp_path / "list_eval_partition.txt").write_text("\n".join(text[:-1]))
  (tmp_path / "img").mkdir()
  with pytest.raises(ValueError, match="truncated"):
    builders.Inshop(data_dir=str(tmp_path / "d")).plan_splits(tmp_path)


def test_missing_images_named(tmp_path):
  rows = fixtures.inshop_rows([1], None, [1], [1])
  (tmp_path / "list_eval_partition.txt").write_bytes(
      fixtures.inshop_partition(rows))
  with pytest.raises(data.MissingDatasetFilesError, match="img.zip"):
    data.load_split("inshop", "query", data_dir=tmp_path / "d",
                    manual_dir=tmp_path)


def _inshop(m, *, encrypted_as=None, tool=True):
  rows = fixtures.inshop_rows([2, 1], None, [1, 1], [1, 2])
  images = {p: fixtures.encode("JPEG", i) for i, (p, _, _) in enumerate(rows)}
  (m / "Eval").mkdir(parents=True)
  (m / "Eval" / "list_eval_partition.txt").write_bytes(
      fixtures.inshop_partition(rows))
  real = fixtures.encrypted_zip(images, m / encrypted_as, tool=tool)
  return images, real


@pytest.mark.parametrize("tool", [True, False])
def test_encrypted_zip_is_one_line_naming_it_and_the_folder(tmp_path, tool):
  m = tmp_path / "In-shop Clothes Retrieval Benchmark"
  _inshop(m, encrypted_as="Img/img.zip", tool=tool)
  zipfile = pytest.importorskip("zipfile")
  with zipfile.ZipFile(m / "Img" / "img.zip") as zf:  # what the builder met
    with pytest.raises(RuntimeError, match="is encrypted, password required"):
      zf.read(zf.namelist()[-1])
  with pytest.raises(data.EncryptedArchiveError) as e:
    data.load_split("inshop", "train", data_dir=tmp_path / "d", manual_dir=m)
  msg = str(e.value)
  assert "\n" not in msg
  assert msg.startswith(f"The archive '{m / 'Img' / 'img.zip'}' is "
                        "password-protected")
  assert (f"extract it with its password (`unzip -P PASSWORD "
          f"'{m / 'Img' / 'img.zip'}' -d '{m / 'Img'}'`") in msg
  assert f"so that its files are in '{m / 'Img' / 'img'}/'" in msg
  assert not (tmp_path / "d" / "inshop" / "1.0.0").exists()


@pytest.mark.parametrize("manual_dir", ["", "Img", "Img/img"])
def test_the_zip_extracted_with_its_password_is_read(tmp_path, manual_dir):
  m = tmp_path / "bench"
  images, real = _inshop(m, encrypted_as="Img/img.zip")
  if not real:
    pytest.skip("needs Info-ZIP's zip to make a real ZipCrypto archive")
  import zipfile  # pylint: disable=g-import-not-at-top
  with zipfile.ZipFile(m / "Img" / "img.zip") as zf:  # as the message says
    zf.extractall(m / "Img", pwd=b"secret")
  assert (m / "Img" / "img").is_dir()                # the zip stays beside
  src = data.load_split("inshop", "gallery", data_dir=tmp_path / "d",
                        manual_dir=m / manual_dir)
  assert len(src) == 3
  for i in range(len(src)):
    assert src[i]["image"] == images[src[i]["path"].decode()]
