"""Stanford Online Products: official lists, zip and folder layouts."""

import numpy as np
import pytest

from circle_jax import data
from circle_jax.data import builders
from tests.data import fixtures


def test_full_lists_give_official_split_sizes(tmp_path):
  train_counts, test_counts = fixtures.sop_full_counts()
  lists, _ = fixtures.sop_lists(train_counts, test_counts)
  fixtures.write_tree(lists, tmp_path)
  _, plans = builders.Sop(data_dir=str(tmp_path / "d")).plan_splits(tmp_path)
  (train, train_labels, train_keys) = plans["train"]
  (test, test_labels, test_keys) = plans["test"]
  assert (len(train), len(train_keys)) == (59551, 11318)
  assert (len(test), len(test_keys)) == (60502, 11316)
  assert set(train_keys).isdisjoint(test_keys)
  np.testing.assert_array_equal(np.bincount(train_labels), train_counts)
  np.testing.assert_array_equal(np.bincount(test_labels), test_counts)


@pytest.mark.parametrize("layout", ["zip", "extracted", "the folder",
                                    "renamed"])
def test_build(tmp_path, layout):
  lists, rels = fixtures.sop_lists([2, 3, 1], [2, 2])
  images = {f"Stanford_Online_Products/{r}": fixtures.encode("JPEG", i)
            for i, r in enumerate(rels)}
  files, m = {**lists, **images}, tmp_path / "m"
  if layout == "renamed":  # manual_dir: the extracted folder, renamed
    files = {k.split("/", 1)[1]: v for k, v in files.items()}
  fixtures.write_tree(files, m, archive="Stanford_Online_Products.zip"
                      if layout == "zip" else None)
  if layout == "the folder":
    m = m / "Stanford_Online_Products"
  train = data.load_split("sop", "train", data_dir=tmp_path / "d",
                          manual_dir=m)
  test = data.load_split("sop", "test", data_dir=tmp_path / "d",
                         manual_dir=m)
  assert (len(train), len(test)) == (6, 4)
  np.testing.assert_array_equal(data.split_labels(train), [0, 0, 1, 1, 1, 2])
  np.testing.assert_array_equal(data.split_labels(test), [0, 0, 1, 1])
  for src in (train, test):
    for i in range(len(src)):
      r = src[i]
      assert r["image"] == images["Stanford_Online_Products/" +
                                  r["path"].decode()]
      assert r["label"] == data.split_labels(src)[i]


def test_bad_header(tmp_path):
  lists, _ = fixtures.sop_lists([1], [1])
  lists["Stanford_Online_Products/Ebay_train.txt"] = b"1 1 1 a/b.JPG\n"
  fixtures.write_tree(lists, tmp_path)
  with pytest.raises(ValueError, match="Ebay_train.txt.*header"):
    builders.Sop(data_dir=str(tmp_path / "d")).plan_splits(tmp_path)


def test_super_classes_are_kept_for_the_hierarchical_sampler(tmp_path):
  """Each record keeps its ``super_class_id`` (issue 40 item 9), the split
  metadata that of each class, so HierarchicalSampler runs on SOP."""
  lists, rels = fixtures.sop_lists([2] * 14, [1])
  images = {f"Stanford_Online_Products/{r}": fixtures.encode("JPEG", i)
            for i, r in enumerate(rels)}
  fixtures.write_tree({**lists, **images}, tmp_path / "m")
  train = data.load_split("sop", "train", data_dir=tmp_path / "d",
                          manual_dir=tmp_path / "m")
  labels = data.split_labels(train)
  supers = data.split_super_labels(train)
  # The fixture's class id c (label c - 1) is in super-class (c - 1) % 12 + 1.
  np.testing.assert_array_equal(supers, labels % 12 + 1)
  assert [int(train[i]["super_label"]) for i in range(len(train))] == list(
      supers)
  sampler = data.HierarchicalSampler(
      np.stack([labels, supers], 1), batch_size=4, samples_per_class=2,
      super_classes_per_batch=2)
  batch = sampler.indices(0)
  assert len(set(supers[batch])) == 2
  assert set(supers[batch]) == set(sampler.super_tuple(0))
  with pytest.raises(ValueError, match="no 'super_label'"):
    data.split_super_labels([{"label": 0}])
