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
