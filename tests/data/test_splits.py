"""The class-disjoint validation split carved from the train classes."""

import pickle

import numpy as np
import pytest

from circle_jax import data


class _Source:
  """A list of records with a batched read, like an ArrayRecord source."""

  def __init__(self, labels):
    self.records = [{"image": f"img{i}".encode(), "label": int(l),
                     "path": f"p{i}".encode()} for i, l in enumerate(labels)]
    self.reads = 0

  def __len__(self):
    return len(self.records)

  def __getitem__(self, i):
    self.reads += 1
    return self.records[i]

  def __getitems__(self, keys):
    self.reads += 1
    return [self.records[k] for k in keys]


def test_holdout_count_and_limits():
  assert data.num_holdout_classes(100, 0.0) == 0
  assert data.num_holdout_classes(100, 0.2) == 20
  assert data.num_holdout_classes(136, 0.2) == 27   # round(27.2)
  assert data.num_holdout_classes(10, 0.01) == 2    # at least 2 to rank
  with pytest.raises(ValueError, match="leaves 1 to train on"):
    data.num_holdout_classes(5, 0.8)
  with pytest.raises(ValueError, match=r"\[0, 1\)"):
    data.num_holdout_classes(5, 1.0)


def test_holdout_classes_depend_only_on_count_fraction_and_seed():
  a = data.holdout_classes(136, 0.2, seed=0)
  assert len(a) == 27 and len(set(a.tolist())) == 27
  assert np.all(np.diff(a) > 0) and a.min() >= 0 and a.max() < 136
  np.testing.assert_array_equal(a, data.holdout_classes(136, 0.2, seed=0))
  assert not np.array_equal(a, data.holdout_classes(136, 0.2, seed=1))


def test_split_is_class_disjoint_renumbered_and_complete():
  labels = np.repeat(np.arange(10), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
  src = _Source(labels)
  train, val = data.split_classes(src, fraction=0.3, seed=4)
  held = data.holdout_classes(10, 0.3, seed=4)
  np.testing.assert_array_equal(val.classes, held)
  kept = np.setdiff1d(np.arange(10), held)
  np.testing.assert_array_equal(train.classes, kept)
  # Every record is in exactly one side, in source order.
  got = sorted(train.indices.tolist() + val.indices.tolist())
  assert got == list(range(len(labels)))
  for view in (train, val):
    assert len(view) == len(view.indices)
    # Labels renumbered 0..C'-1 by the position of the original class.
    want = [int(np.searchsorted(view.classes, labels[i]))
            for i in view.indices]
    np.testing.assert_array_equal(view.labels, want)
    assert data.split_labels(view) is view.labels
    for k in range(len(view)):
      rec = view[k]
      assert rec["image"] == f"img{view.indices[k]}".encode()
      assert rec["label"] == view.labels[k]
    batch = view.__getitems__([len(view) - 1, 0])
    assert [r["path"] for r in batch] == [
        f"p{view.indices[-1]}".encode(), f"p{view.indices[0]}".encode()]
  # The source's own records are not modified.
  assert [r["label"] for r in src.records] == labels.tolist()


def test_subset_pickles_and_reads_in_one_batched_call():
  src = _Source(np.repeat(np.arange(6), 2))
  train, _ = data.split_classes(src, fraction=0.34, seed=0)
  before = src.reads
  train.__getitems__(list(range(len(train))))
  assert src.reads == before + 1
  again = pickle.loads(pickle.dumps(train))
  np.testing.assert_array_equal(again.labels, train.labels)
  assert again[0]["image"] == train[0]["image"]


def test_superclass_holdout_takes_whole_superclasses():
  sizes = (24, 22, 24, 40, 26)   # omniglot_small's alphabets, label order
  starts = np.concatenate([[0], np.cumsum(sizes)])
  seen = set()
  for seed in range(12):
    groups = data.holdout_superclasses(5, 0.2, seed)
    assert len(groups) == 1       # round(0.2 * 5)
    held = data.holdout_classes(136, 0.2, seed, superclasses=sizes)
    g = int(groups[0])
    np.testing.assert_array_equal(held, np.arange(starts[g], starts[g + 1]))
    assert data.num_holdout_classes(136, 0.2, seed,
                                    superclasses=sizes) == sizes[g]
    seen.add(g)
  assert len(seen) > 1            # the seed picks the superclass
  # Two of five; at least one whatever the fraction; never all of them.
  assert len(data.holdout_superclasses(5, 0.4, 0)) == 2
  assert len(data.holdout_superclasses(5, 0.01, 0)) == 1
  with pytest.raises(ValueError, match="leaves none to train on"):
    data.holdout_superclasses(5, 0.95, 0)
  assert data.num_holdout_classes(136, 0.0, superclasses=sizes) == 0
  with pytest.raises(ValueError, match="summing to the 136 train classes"):
    data.holdout_classes(136, 0.2, superclasses=(24, 22))
  with pytest.raises(ValueError, match="at least 2 superclasses"):
    data.holdout_classes(136, 0.2, superclasses=(136,))
  for seed in (0, 1):  # either side would be a single class
    with pytest.raises(ValueError, match="both sides need at least 2"):
      data.holdout_classes(4, 0.5, seed, superclasses=(3, 1))


def test_split_by_superclass_views():
  labels = np.repeat(np.arange(6), 2)          # superclasses {0, 1}, {2..5}
  train, val = data.split_classes(_Source(labels), fraction=0.5, seed=3,
                                  superclasses=(2, 4))
  held = data.holdout_classes(6, 0.5, 3, superclasses=(2, 4))
  np.testing.assert_array_equal(val.classes, held)
  assert held.tolist() in ([0, 1], [2, 3, 4, 5])
  assert sorted(train.classes.tolist() + val.classes.tolist()) == list(range(6))
