"""Tests of the fixed-shape miners against naive numpy references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from circle_jax import losses
from circle_jax.losses import miners
from tests.losses import reference as ref
from tests.losses.engine import cases

_LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 3, 4, 5, 2, 6, 3])
_RNG = np.random.default_rng(0)
# Loosely clustered classes, so that miners keep some pairs and drop others.
_X = (3.0 * _RNG.normal(size=(7, 5))[_LABELS]
      + _RNG.normal(size=(16, 5))).astype(np.float32)
_KEY = jax.random.PRNGKey(7)


def _dist64(x):
  u = ref.l2n(x)
  return np.sqrt(np.maximum(((u[:, None] - u[None]) ** 2).sum(-1), 0.0))


def _label_sets(y, i):
  pos = [j for j in range(len(y)) if y[j] == y[i] and j != i]
  neg = [j for j in range(len(y)) if y[j] != y[i]]
  return pos, neg


# ----------------------------------------------------------------------------
# Naive references.
# ----------------------------------------------------------------------------


def ms_ref(x, y, epsilon):
  s = ref.cos(x)
  b = len(y)
  pm, nm = np.zeros((b, b), bool), np.zeros((b, b), bool)
  for i in range(b):
    pos, neg = _label_sets(y, i)
    if not pos or not neg:
      continue
    min_pos = min(s[i, j] for j in pos)
    max_neg = max(s[i, j] for j in neg)
    for j in neg:
      nm[i, j] = s[i, j] + epsilon > min_pos
    for j in pos:
      pm[i, j] = s[i, j] - epsilon < max_neg
  return pm, nm


def batch_hard_ref(x, y):
  d = _dist64(x)
  b = len(y)
  pm, nm = np.zeros((b, b), bool), np.zeros((b, b), bool)
  for i in range(b):
    pos, neg = _label_sets(y, i)
    if pos:
      pm[i, max(pos, key=lambda j: d[i, j])] = True
    if neg:
      nm[i, min(neg, key=lambda j: d[i, j])] = True
  return pm, nm


def semi_hard_ref(x, y, margin):
  d = _dist64(x)
  b = len(y)
  pm, nm = np.zeros((b, b), bool), np.zeros((b, b), bool)
  for a in range(b):
    pos, neg = _label_sets(y, a)
    for p in pos:
      for n in neg:
        if d[a, p] < d[a, n] < d[a, p] + margin:
          pm[a, p] = nm[a, n] = True
  return pm, nm


def pair_margin_ref(x, y, pos_margin, neg_margin):
  d = _dist64(x)
  b = len(y)
  pm, nm = np.zeros((b, b), bool), np.zeros((b, b), bool)
  for i in range(b):
    pos, neg = _label_sets(y, i)
    for j in pos:
      pm[i, j] = d[i, j] > pos_margin
    for j in neg:
      nm[i, j] = d[i, j] < neg_margin
  return pm, nm


def distance_weighted_probs_ref(x, y, cutoff, nonzero_loss_cutoff):
  """Row-normalised sampling probabilities of Wu et al.'s official code
  (float64), with the fallback to uniform over the anchor's negatives."""
  d = _dist64(x)
  n_dim = x.shape[1]
  b = len(y)
  probs = np.zeros((b, b))
  for a in range(b):
    _, neg = _label_sets(y, a)
    allowed = [j for j in neg if d[a, j] < nonzero_loss_cutoff]
    if allowed:
      for j in allowed:
        dc = max(d[a, j], cutoff)
        probs[a, j] = dc ** (2.0 - n_dim) * (1 - 0.25 * dc**2) ** (
            -(n_dim - 3) / 2.0)
    else:
      for j in neg:
        probs[a, j] = 1.0
    if probs[a].sum() > 0:
      probs[a] /= probs[a].sum()
  return probs


# ----------------------------------------------------------------------------
# Every miner and every miner/loss equivalence in one compiled program.
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mined():
  @jax.jit
  def run(x, y):
    out = {
        "ms": miners.multi_similarity_miner(x, y, epsilon=0.1),
        "batch_hard": miners.batch_hard_miner(x, y),
        "semi_hard": miners.semi_hard_miner(x, y, margin=0.3),
        "pair_margin": miners.pair_margin_miner(x, y, pos_margin=0.9,
                                                neg_margin=1.3),
        "dw": miners.distance_weighted_miner(x, y, _KEY),
    }
    pm, nm = out["pair_margin"]
    out["contrastive"] = losses.contrastive_loss(x, y, pos_margin=0.9,
                                                 neg_margin=1.3)
    out["contrastive_mined"] = losses.contrastive_loss(
        x, y, pos_margin=0.9, neg_margin=1.3, pos_mask=pm, neg_mask=nm)
    pm, nm = out["batch_hard"]
    out["triplet_batch_hard"] = losses.triplet_margin_loss(
        x, y, margin=0.3, mining="batch_hard")
    out["triplet_all_on_batch_hard"] = losses.triplet_margin_loss(
        x, y, margin=0.3, mining="all", pos_mask=pm, neg_mask=nm)
    pm, nm = out["ms"]
    out["ms_builtin"] = losses.multi_similarity_loss(x, y, epsilon=0.1)
    out["ms_mined"] = losses.multi_similarity_loss(
        x, y, epsilon=0.1, mining=False, pos_mask=pm, neg_mask=nm)
    return out
  return jax.tree.map(np.asarray, run(_X, _LABELS))


@pytest.mark.parametrize("name,reference", [
    ("ms", lambda x, y: ms_ref(x, y, 0.1)),
    ("batch_hard", batch_hard_ref),
    ("semi_hard", lambda x, y: semi_hard_ref(x, y, 0.3)),
    ("pair_margin", lambda x, y: pair_margin_ref(x, y, 0.9, 1.3)),
])
def test_masks_match_naive_reference(mined, name, reference):
  pm, nm = mined[name]
  assert pm.dtype == bool and nm.dtype == bool
  assert pm.shape == nm.shape == (16, 16)
  want_p, want_n = reference(_X, _LABELS)
  # Non-trivial: each miner keeps some pairs and drops others.
  same = _LABELS[:, None] == _LABELS[None, :]
  assert 0 < want_n.sum() < (~same).sum()
  np.testing.assert_array_equal(pm, want_p)
  np.testing.assert_array_equal(nm, want_n)


def test_contrastive_on_pair_margin_masks_equals_unmasked(mined):
  # The miner drops exactly the zero-loss pairs; the reduction is the mean
  # over non-zero pairs, so the value is unchanged.
  assert mined["contrastive"] > 0
  np.testing.assert_allclose(mined["contrastive_mined"], mined["contrastive"],
                             rtol=1e-6)


def test_triplet_all_on_batch_hard_masks_is_batch_hard(mined):
  # One triplet per anchor remains; "all" averages over non-zero triplets,
  # "batch_hard" over anchors: equal sums.
  d = _dist64(_X)
  hinges = []
  for a in range(16):
    pos, neg = _label_sets(_LABELS, a)
    if pos:  # labels 5 and 6 occur once: those anchors have no triplet
      hinges.append(max(d[a, p] for p in pos) - min(d[a, n] for n in neg)
                    + 0.3)
  hinges = np.maximum(hinges, 0)
  assert len(hinges) == 14 and 0 < (hinges > 0).sum() < 14
  np.testing.assert_allclose(mined["triplet_batch_hard"] * 14,
                             hinges.sum(), rtol=1e-5)
  np.testing.assert_allclose(
      mined["triplet_all_on_batch_hard"] * (hinges > 0).sum(),
      mined["triplet_batch_hard"] * 14, rtol=1e-5)


def test_ms_loss_on_ms_miner_masks_equals_builtin_mining(mined):
  assert mined["ms_builtin"] > 0
  np.testing.assert_allclose(mined["ms_mined"], mined["ms_builtin"],
                             rtol=1e-6)


# ----------------------------------------------------------------------------
# Distance-weighted sampling.
# ----------------------------------------------------------------------------


def test_inverse_cdf_counts_match_numpy_searchsorted():
  rng = np.random.default_rng(1)
  probs = rng.random((6, 9)) * (rng.random((6, 9)) < 0.6)
  probs[2] = 0.0  # a row without mass draws nothing
  probs[3] = 0.0
  probs[3, 8] = 1.0  # a single column, the last one, gets every draw
  uniforms = rng.random((6, 9)).astype(np.float32)
  uniforms[3, 0] = np.nextafter(np.float32(1), np.float32(0))  # u ~ 1
  valid = rng.random((6, 9)) < 0.7
  valid[3, 0] = True
  got = np.asarray(jax.jit(miners.inverse_cdf_counts)(
      probs.astype(np.float32), uniforms, valid))
  want = np.zeros((6, 9))
  for i in range(6):
    cdf = np.cumsum(probs[i])
    if cdf[-1] == 0:
      continue
    for s in range(9):
      if valid[i, s]:
        j = min(np.searchsorted(cdf, uniforms[i, s] * cdf[-1], side="right"),
                8)
        want[i, j] += 1
  np.testing.assert_array_equal(got, want)
  assert np.all(got[probs == 0] == 0)


def test_distance_weighted_weights_structure(mined):
  w = mined["dw"]
  assert w.dtype == np.float32 and w.shape == (16, 16)
  same = _LABELS[:, None] == _LABELS[None, :]
  pos = same & ~np.eye(16, dtype=bool)
  np.testing.assert_array_equal(w[pos], 1.0)
  np.testing.assert_array_equal(np.diag(w), 0.0)
  # One negative per positive pair.
  np.testing.assert_array_equal(np.where(~same, w, 0).sum(1), pos.sum(1))
  # Never a negative at or beyond nonzero_loss_cutoff (all rows have some
  # negative closer than 1.4 here).
  assert np.all(w[(~same) & (_dist64(_X) >= 1.4)] == 0)


def test_distance_weighted_fallback_is_uniform_over_negatives():
  # Two antipodal classes: every negative is beyond the cutoff.
  x = np.array([[1, 0, 0], [1, 0.01, 0], [-1, 0, 0], [-1, 0, 0.01]],
               np.float32)
  y = np.array([0, 0, 1, 1])
  keys = jax.random.split(jax.random.PRNGKey(0), 400)
  w = np.asarray(jax.jit(jax.vmap(
      lambda k: miners.distance_weighted_miner(x, y, k)))(keys))
  np.testing.assert_array_equal(w[:, 0, 1], 1.0)
  neg_counts = w[:, 0, 2:]
  np.testing.assert_array_equal(neg_counts.sum(1), 1.0)
  assert 150 < neg_counts[:, 0].sum() < 250  # uniform over the 2 negatives


def test_distance_weighted_frequencies_follow_the_paper_distribution():
  n_keys = 3000
  keys = jax.random.split(jax.random.PRNGKey(1), n_keys)
  sample = jax.jit(jax.vmap(
      lambda k: miners.distance_weighted_miner(_X, _LABELS, k, cutoff=0.5,
                                               nonzero_loss_cutoff=1.4)))
  counts = np.asarray(sample(keys)).sum(0)
  same = _LABELS[:, None] == _LABELS[None, :]
  counts = np.where(same, 0.0, counts)
  draws = counts.sum(1, keepdims=True)
  has_pos = same.sum(1) > 1  # anchors without positives draw nothing
  np.testing.assert_array_equal(draws[:, 0], n_keys * (same.sum(1) - 1))
  p = distance_weighted_probs_ref(_X, _LABELS, 0.5, 1.4)[has_pos]
  freq = (counts / np.maximum(draws, 1))[has_pos]
  assert p.max() < 0.9 and (p[~same[has_pos]] == 0).any()  # non-trivial
  sigma = np.sqrt(p * (1 - p) / draws[has_pos])
  assert np.all(np.abs(freq - p) <= 5 * sigma + 1e-3)
  np.testing.assert_array_equal(freq[p == 0], 0)


# ----------------------------------------------------------------------------
# Across devices, bad inputs.
# ----------------------------------------------------------------------------


def _all_miners(x, y, axis_name=None):
  return (miners.multi_similarity_miner(x, y, axis_name=axis_name)
          + miners.batch_hard_miner(x, y, axis_name=axis_name)
          + miners.semi_hard_miner(x, y, axis_name=axis_name)
          + miners.pair_margin_miner(x, y, axis_name=axis_name)
          + (miners.distance_weighted_miner(x, y, _KEY,
                                            axis_name=axis_name),))


def test_miners_on_devices_return_the_local_rows_of_the_global_masks():
  mesh = Mesh(np.array(jax.devices()), ("d",))
  local = jax.jit(jax.shard_map(
      functools.partial(_all_miners, axis_name="d"), mesh=mesh,
      in_specs=(P("d"), P("d")), out_specs=P("d")))(_X, _LABELS)
  whole = jax.jit(_all_miners)(_X, _LABELS)
  for k, (got, want) in enumerate(zip(local, whole)):
    assert got.shape == (16, 16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                  err_msg=str(k))


def test_bad_inputs_raise_clear_errors():
  with pytest.raises(ValueError, match="epsilon"):
    miners.multi_similarity_miner(_X, _LABELS, epsilon=-0.1)
  with pytest.raises(ValueError, match="margin"):
    miners.semi_hard_miner(_X, _LABELS, margin=-1.0)
  with pytest.raises(ValueError, match="labels"):
    miners.batch_hard_miner(_X, _LABELS[:3])
  with pytest.raises(ValueError, match="embeddings"):
    miners.pair_margin_miner(_X[0], _LABELS)
  with pytest.raises(ValueError, match="cutoff"):
    miners.distance_weighted_miner(_X, _LABELS, _KEY, cutoff=-1.0)


@pytest.mark.slow
def test_miner_masks_on_devices_match_single_device_blocks():
  x, y = (jnp.asarray(a) for a in cases.pair_batch(21))
  mesh = Mesh(np.array(jax.devices()), ("d",))

  def mined_loss(x, y, axis_name=None):
    pm, nm = miners.semi_hard_miner(x, y, margin=0.5, axis_name=axis_name)
    return losses.contrastive_loss(x, y, pos_mask=pm, neg_mask=nm,
                                   axis_name=axis_name)

  got = jax.jit(jax.shard_map(lambda x, y: mined_loss(x, y, "d"), mesh=mesh,
                              in_specs=(P("d"), P("d")), out_specs=P()))(x, y)
  want = jax.jit(mined_loss)(x, y)
  assert float(want) > 0
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
