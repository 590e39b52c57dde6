"""PKSampler / RandomSampler / HierarchicalSampler: determinism, resume,
structure, shards."""

import collections
import itertools

import numpy as np
import pytest

from circle_jax import data

# 7 classes: sizes 5, 1, 3, 8, 2, 4, 6 (two classes have fewer than K=3).
LABELS = np.random.default_rng(0).permutation(
    np.repeat(np.arange(7), [5, 1, 3, 8, 2, 4, 6]))

# 4 super-classes of 3, 4, 2, 3 classes (12 classes of 1 to 6 records), as
# [class, super-class] rows in random order.
_SUPER_OF = np.repeat(np.arange(4), [3, 4, 2, 3])
_CLASS = np.random.default_rng(1).permutation(
    np.repeat(np.arange(12), [2, 5, 1, 3, 6, 2, 4, 3, 2, 1, 4, 5]))
HLABELS = np.stack([_CLASS, 10 + _SUPER_OF[_CLASS]], 1)  # super-labels 10..13


def _hierarchical(seed=0, **kw):
  args = dict(batch_size=8, samples_per_class=2, batches_per_super_tuple=3,
              super_classes_per_batch=2, seed=seed)
  args.update(kw)
  return data.HierarchicalSampler(HLABELS, **args)


def test_pk_batches_are_p_classes_by_k_images():
  s = data.PKSampler(LABELS, classes_per_batch=4, images_per_class=3, seed=3)
  assert s.batch_size == 12 and s.num_classes_with_fewer_than_k == 2
  seen_classes = set()
  for step in range(200):
    idx = s.indices(step)
    assert idx.shape == (12,) and idx.dtype == np.int64
    groups = LABELS[idx].reshape(4, 3)
    assert (groups == groups[:, :1]).all()               # K of one class
    assert len(set(groups[:, 0])) == 4                   # P distinct classes
    for row, members in zip(groups[:, 0], idx.reshape(4, 3)):
      if np.sum(LABELS == row) >= 3:                      # no repeats if possible
        assert len(set(members)) == 3
    seen_classes.update(groups[:, 0])
  assert seen_classes == set(range(7))


def test_small_classes_are_sampled_with_replacement():
  s = data.PKSampler(LABELS, classes_per_batch=7, images_per_class=3, seed=0)
  single = np.flatnonzero(LABELS == 1)  # the class with one image
  for step in range(5):
    groups = s.indices(step).reshape(7, 3)
    row = groups[LABELS[groups[:, 0]] == 1][0]
    np.testing.assert_array_equal(row, np.repeat(single, 3))


@pytest.mark.parametrize("make", [
    lambda seed: data.PKSampler(LABELS, classes_per_batch=2,
                                images_per_class=4, seed=seed),
    lambda seed: data.RandomSampler(len(LABELS), batch_size=8, seed=seed),
    _hierarchical,
])
def test_deterministic_in_seed_and_step_and_resumable(make):
  a, b = make(5), make(5)
  stream = [a.indices(s) for s in range(30)]
  # A fresh sampler queried from step 17 on (a restart) continues the stream.
  for s in range(17, 30):
    np.testing.assert_array_equal(b.indices(s), stream[s])
  # Query order does not matter; another seed gives another stream.
  np.testing.assert_array_equal(b.indices(3), stream[3])
  assert not all(np.array_equal(x, y) for x, y in
                 zip(stream, [make(6).indices(s) for s in range(30)]))


def test_random_sampler_visits_every_example_once_per_epoch():
  n, bs = 29, 8
  s = data.RandomSampler(n, batch_size=bs, seed=1)
  stream = np.concatenate([s.indices(t) for t in range(12)])  # 96 = 3 epochs + 9
  for e in range(3):
    np.testing.assert_array_equal(np.sort(stream[e * n:(e + 1) * n]),
                                  np.arange(n))
  assert not np.array_equal(stream[:n], stream[n:2 * n])


@pytest.mark.parametrize("count", [1, 2, 4])
def test_process_shards_are_contiguous_slices(count):
  for s in (data.PKSampler(LABELS, classes_per_batch=4, images_per_class=2,
                           seed=0), _hierarchical()):
    full = s.indices(9)
    parts = [s.local_indices(9, p, count) for p in range(count)]
    np.testing.assert_array_equal(np.concatenate([i for i, _ in parts]), full)
    np.testing.assert_array_equal(np.concatenate([p for _, p in parts]),
                                  np.arange(8))


def _batch_structure(batch, k):
  """``(super-tuple, classes per super-class)`` of a batch, asserting each
  of its classes has ``k`` records of one super-class."""
  cls = collections.Counter(HLABELS[batch, 0].tolist())
  assert set(cls.values()) == {k}
  per_super = collections.Counter(_SUPER_OF[c] + 10 for c in cls)
  return tuple(sorted(per_super)), sorted(per_super.values())


def test_hierarchical_batches_have_the_structure_of_pmls():
  s = _hierarchical(seed=4)
  assert s.steps_per_epoch == 6 * 3  # C(4, 2) super-tuples, 3 times each
  ours = []
  for step in range(2 * s.steps_per_epoch):
    idx = s.indices(step)
    assert idx.shape == (8,) and idx.dtype == np.int64
    # Super-class-major, class-major: blocks [S, C, K].
    blocks = HLABELS[idx].reshape(2, 2, 2, 2)
    assert (blocks[..., 1] == blocks[:, :1, :1, 1]).all()
    assert (blocks[..., 0] == blocks[:, :, :1, 0]).all()
    assert (blocks[:, 0, 0, 1] == s.super_tuple(step)).all()
    tup, counts = _batch_structure(idx, 2)
    assert counts == [2, 2]
    ours.append(tup)
  # Each epoch holds every pair of super-classes 3 times.
  want = collections.Counter(
      t for t in itertools.combinations(range(10, 14), 2) for _ in range(3))
  assert collections.Counter(ours[:18]) == want
  assert collections.Counter(ours[18:]) == want
  assert ours[:18] != ours[18:]  # epochs in different orders
  # PML 2.9's batches (one epoch) have the same structure.
  samplers = pytest.importorskip("pytorch_metric_learning.samplers")
  np.random.seed(0)  # PML draws from numpy's global state
  theirs = [_batch_structure(np.asarray(b), 2) for b in
            samplers.HierarchicalSampler(HLABELS, 8, 2, 3, 2)]
  assert collections.Counter(t for t, _ in theirs) == want
  assert all(c == [2, 2] for _, c in theirs)


def test_hierarchical_bad_arguments_fail_in_one_line():
  cases = [
      (dict(samples_per_class="all"), "varying size"),
      (dict(batch_size=10), "multiple of super_classes_per_batch"),
      (dict(super_classes_per_batch=5, batch_size=10), "only 4 super"),
      (dict(batch_size=12), "super-class 12 has 2 classes"),
      (dict(outer_label=2), "not a column"),
      (dict(batches_per_super_tuple=0), "positive int"),
  ]
  for kw, match in cases:
    with pytest.raises(ValueError, match=match) as e:
      _hierarchical(**kw)
    assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="2-D integer"):
    data.HierarchicalSampler(LABELS, batch_size=4, samples_per_class=2)


def test_bad_arguments():
  with pytest.raises(ValueError, match="only 7 classes"):
    data.PKSampler(LABELS, classes_per_batch=8, images_per_class=2)
  with pytest.raises(ValueError, match="1-D integer"):
    data.PKSampler(LABELS.astype(float), classes_per_batch=2,
                   images_per_class=2)
  with pytest.raises(ValueError, match=">= 1"):
    data.PKSampler(LABELS, classes_per_batch=2, images_per_class=0)
  s = data.RandomSampler(10, batch_size=6)
  with pytest.raises(ValueError, match="not divisible"):
    s.local_indices(0, 0, 4)
  with pytest.raises(ValueError, match="process_index"):
    s.local_indices(0, 2, 2)
  with pytest.raises(ValueError, match="step"):
    s.indices(-1)


def test_fixed_set_of_triplets_equals_pmls_triplets_and_batches_them():
  """The triplets equal PML 2.9's after ``numpy.random.seed(seed)`` (a
  class of one record gives a triplet with anchor == positive, as PML's);
  the batches are whole triplets, each once per epoch, from (seed, step)."""
  pytest.importorskip("pytorch_metric_learning")
  from pytorch_metric_learning import samplers as pml_samplers
  np.random.seed(3)
  theirs = pml_samplers.FixedSetOfTriplets(LABELS, 20).fixed_set_of_triplets
  ours = data.FixedSetOfTriplets(LABELS, num_triplets=20, batch_size=6,
                                 seed=3)
  np.testing.assert_array_equal(ours.triplets, theirs)
  a, p, n = ours.triplets.T
  assert (LABELS[a] == LABELS[p]).all() and (LABELS[a] != LABELS[n]).all()
  epoch = np.concatenate([ours.indices(s) for s in range(10)]).reshape(-1, 3)
  assert sorted(map(tuple, epoch)) == sorted(map(tuple, ours.triplets))
  np.testing.assert_array_equal(ours.indices(4), data.FixedSetOfTriplets(
      LABELS, num_triplets=20, batch_size=6, seed=3).indices(4))
  with pytest.raises(ValueError, match="multiple of 3"):
    data.FixedSetOfTriplets(LABELS, num_triplets=20, batch_size=8)
  with pytest.raises(ValueError, match="needs two labels"):
    data.FixedSetOfTriplets(np.zeros(4, int), num_triplets=2, batch_size=3)


def test_tuples_to_weights_equal_pmls_and_draw_by_weight():
  """PML's ``convert_to_weights`` of a pair miner's tuples equals
  ``weights_from_pairs`` of the same pairs as masks; the sampler draws by
  them, deterministically per (seed, step)."""
  pytest.importorskip("pytorch_metric_learning")
  import torch
  from pytorch_metric_learning import miners
  from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
  x = torch.tensor(np.random.default_rng(2).normal(size=(12, 4)))
  y = torch.tensor(LABELS[:12])
  tuples = miners.PairMarginMiner(pos_margin=0.6, neg_margin=0.4)(x, y)
  want = lmu.convert_to_weights(tuples, y, dtype=torch.float64).numpy()
  a1, p, a2, n = (t.numpy() for t in tuples)
  pos, neg = np.zeros((12, 12), bool), np.zeros((12, 12), bool)
  pos[a1, p], neg[a2, n] = True, True
  got = data.samplers.weights_from_pairs(pos, neg)
  np.testing.assert_allclose(got, want)
  assert len(set(got)) > 1  # the test can see a wrong count
  np.testing.assert_array_equal(data.samplers.weights_from_pairs(
      np.zeros((3, 3), bool), np.zeros((3, 3), bool)), np.ones(3))
  sampler = data.TuplesToWeightsSampler(got, batch_size=64, seed=1)
  drawn = sampler.indices(5)
  assert set(drawn) <= set(np.flatnonzero(got)) and drawn.shape == (64,)
  np.testing.assert_array_equal(drawn, data.TuplesToWeightsSampler(
      got, batch_size=64, seed=1).indices(5))
  with pytest.raises(ValueError, match="not all 0"):
    data.TuplesToWeightsSampler(np.zeros(3), batch_size=2)
