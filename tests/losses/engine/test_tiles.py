"""Tests of the tile pieces (circle_jax/losses/engine/tiles.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from circle_jax.losses import engine
import chex
from circle_jax.losses.engine import tiles
from circle_jax.losses.circle import Circle
from tests.losses.engine.cases import RULES, block


def test_pair_masks_exclude_self_and_respect_ids_and_miner_masks():
  labels = jnp.array([0, 0, 1, 1])
  ids = jnp.arange(4)
  pos, neg = engine.pair_masks(labels[2:], ids[2:], labels, ids)
  np.testing.assert_array_equal(np.asarray(pos), [[0, 0, 0, 1], [0, 0, 1, 0]])
  np.testing.assert_array_equal(np.asarray(neg), [[1, 1, 0, 0], [1, 1, 0, 0]])
  keep = jnp.array([[True, False, True, True], [True, True, True, True]])
  _, neg = engine.pair_masks(labels[2:], ids[2:], labels, ids, neg_mask=keep)
  np.testing.assert_array_equal(np.asarray(neg), [[1, 0, 0, 0], [1, 1, 0, 0]])
  with pytest.raises(ValueError, match="pos_mask"):
    engine.pair_block(jnp.ones((4, 2)), labels,
                      pos_mask=jnp.ones((3, 4), bool))


def test_derived_gradient_honours_stop_gradient_constants():
  """Circle's alpha weights are constants: dL/dlogit * (-gamma alpha_p)."""
  rule = Circle(margin=0.25, gamma=4.0)
  s = jnp.array([[0.3, 0.8, -0.2]])
  pos = jnp.array([[False, True, False]])
  neg = jnp.array([[False, False, True]])
  stats = tiles.stats_update(rule, tiles.stats_init(s[:, 0]), s, pos, neg,
                               ())
  g = tiles.tile_cotangent(rule, s, pos, neg, (), stats, jnp.ones(1))
  # One positive, one negative: l = softplus(lp + ln), dl/ds = sigmoid * dlogit.
  m, gamma = 0.25, 4.0
  sp, sn = 0.8, -0.2
  ap, an = max(1 + m - sp, 0), max(sn + m, 0)
  lp, ln = -gamma * ap * (sp - (1 - m)), gamma * an * (sn - m)
  sig = 1 / (1 + np.exp(-(lp + ln)))
  np.testing.assert_allclose(np.asarray(g)[0],
                             [0.0, sig * -gamma * ap, sig * gamma * an],
                             rtol=1e-6)


def _column_chunk_engine(rule, s, pos, neg, chunk):
  """A minimal engine: the columns arrive in chunks (as from a device ring)."""
  n = s.shape[1]
  pre = None
  for j in range(0, n, chunk):
    sl = slice(j, j + chunk)
    pre = tiles.prepass_update(rule, pre, s[:, sl], pos[:, sl], neg[:, sl])
  pre = tuple(p[:, None] for p in (pre or ()))
  stats = tiles.stats_init(s[:, 0])
  for j in range(0, n, chunk):
    sl = slice(j, j + chunk)
    stats = tiles.stats_update(rule, stats, s[:, sl], pos[:, sl],
                                 neg[:, sl], pre)
  return rule.combine(*tiles.stats_finish(rule, stats))


@pytest.mark.parametrize("name", sorted(RULES))
def test_tile_pieces_make_another_engine_without_touching_a_loss(name):
  rule = RULES[name]
  s, pos, neg = block()
  want = engine.dense_per_anchor(rule, s, pos, neg)
  got = _column_chunk_engine(rule, s, pos, neg, chunk=3)
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[1], want[1])


# ----------------------------------------------------------------------------
# Multi-hot labels (Musgrave et al., pytorch-metric-learning, GitHub issue
# 658, "multi-label support").
# ----------------------------------------------------------------------------

# Five samples: {0}, {0, 1}, {1}, {} (no label) and {2}.
SETS = [{0}, {0, 1}, {1}, set(), {2}]
MULTI_HOT = np.array([[c in s for c in range(3)] for s in SETS])


def test_multi_hot_pairs_by_hand():
  """Positive iff the sets intersect; the empty set is a negative of all."""
  ids = jnp.arange(5)
  pos, neg = engine.pair_masks(jnp.asarray(MULTI_HOT), ids,
                               jnp.asarray(MULTI_HOT.astype(np.int32)), ids)
  want_pos = np.zeros((5, 5), bool)
  for i, j in ((0, 1), (1, 0), (1, 2), (2, 1)):
    want_pos[i, j] = True
  np.testing.assert_array_equal(np.asarray(pos), want_pos)
  np.testing.assert_array_equal(np.asarray(neg),
                                ~want_pos & ~np.eye(5, dtype=bool))
  # Class ids are the one-hot sets.
  y = jnp.array([0, 1, 1, 2])
  np.testing.assert_array_equal(
      np.asarray(tiles.same_labels(y, y)),
      np.asarray(tiles.same_labels(jax.nn.one_hot(y, 3) > 0,
                                   jax.nn.one_hot(y, 3) > 0)))


def _contrastive_ref(x, sets, pos_margin, neg_margin):
  """Float64 loop: PML's contrastive loss on the label-set pairs."""
  z = x / np.linalg.norm(x, axis=1, keepdims=True)
  pos_terms, neg_terms = [], []
  for i, j in np.ndindex(len(sets), len(sets)):
    if i == j:
      continue
    d = np.linalg.norm(z[i] - z[j])
    if sets[i] & sets[j]:
      pos_terms.append(max(d - pos_margin, 0.0))
    else:
      neg_terms.append(max(neg_margin - d, 0.0))
  mean = lambda t: np.mean([v for v in t if v > 0]) if any(t) else 0.0
  return mean(pos_terms) + mean(neg_terms)


def test_multi_hot_loss_by_a_float64_loop():
  x = np.random.default_rng(3).normal(size=(5, 4))
  got = losses.contrastive_loss(jnp.asarray(x, jnp.float32),
                                jnp.asarray(MULTI_HOT), pos_margin=0.1,
                                neg_margin=1.6)
  np.testing.assert_allclose(float(got),
                             _contrastive_ref(x, SETS, 0.1, 1.6), rtol=1e-5)
  # 0/1 integers are the same sets.
  assert float(got) == float(losses.contrastive_loss(
      jnp.asarray(x, jnp.float32), MULTI_HOT.astype(np.int32),
      pos_margin=0.1, neg_margin=1.6))


def _fast_jit(fn, *args):
  """``jit(fn)(*args)`` compiled without XLA's slow passes (one small
  program per test; the values are unchanged)."""
  return jax.jit(fn).lower(*args).compile(compiler_options={
      "xla_backend_optimization_level": 0,
      "xla_llvm_disable_expensive_passes": True})(*args)


def test_one_hot_rows_equal_class_ids_for_every_pair_loss():
  """Every registered pair loss gives the same value, bit for bit, with
  class ids and with their one-hot rows, in one
  program (compiled without XLA's slow passes: values are unchanged)."""
  y = np.array([0, 1, 2, 0, 1, 2, 3, 0])
  x = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
  names = [n for n, e in losses.LOSSES.items() if e.kind == "pair"]

  def run(x, y, one_hot):
    out = {}
    for n in names:
      e = losses.LOSSES[n]
      beta = jnp.float32(1.2) if e.param_name else None  # margin's scalar
      if e.param_name == "proxies":  # potential_field's [C, D] (issue 41)
        beta = jnp.ones((4, 4)).at[0, 0].set(2.0)
      kw = {"key": None} if e.needs_key else {}
      out[n] = [e.apply(x, labels, beta, **kw) for labels in (y, one_hot)]
    return out

  one_hot = np.eye(4, dtype=bool)[y]
  for n, (ids, sets) in _fast_jit(run, x, y, one_hot).items():
    assert float(ids) == float(sets), n
    assert np.isfinite(float(ids)), n


def test_multi_hot_equals_pml_on_the_intersecting_pairs():
  """PML 2.9 has no multi-label comparison (its PR #667 came later), so its
  losses get the intersecting pairs as ``indices_tuple``; value and
  gradient agree (a miner mask only removes pairs), and the matrix form
  equals the embedding form."""
  from pytorch_metric_learning import losses as pml
  from tests.losses import pml_checks
  rng = np.random.default_rng(5)
  sets = rng.random((12, 4)) < 0.3
  sets[3] = False  # a sample without labels
  x = rng.normal(size=(12, 6))
  keep = rng.random((12, 12)) < 0.5
  shared = sets.astype(int) @ sets.T.astype(int) > 0
  off = ~np.eye(12, dtype=bool)
  contrastive = dict(pos_margin=0.2, neg_margin=1.1)
  cases = (  # (ours, hyperparameters, PML's, PML's positive pairs)
      (losses.contrastive_loss, contrastive,
       pml.ContrastiveLoss(**contrastive), shared),
      (losses.supcon_loss, dict(tau=0.2), pml.SupConLoss(temperature=0.2),
       shared),
      (losses.circle_loss, dict(margin=0.4, gamma=80.0),
       pml.CircleLoss(m=0.4, gamma=80.0), shared),
      (losses.contrastive_loss, dict(pos_mask=keep, **contrastive),
       pml.ContrastiveLoss(**contrastive), shared & keep),
  )

  def ours(x, sets):
    z = x / jnp.linalg.norm(x, axis=1, keepdims=True)
    return ([jax.value_and_grad(lambda x: fn(x, sets, **hyper))(x)
             for fn, hyper, _, _ in cases],
            losses.circle_loss_from_similarity(z @ z.T, sets, margin=0.4,
                                               gamma=80.0))

  got, matrix_form = _fast_jit(ours, jnp.asarray(x, jnp.float32), sets)
  for vg, (_, _, peer, pos) in zip(got, cases):
    pairs = pml_checks.pairs_of(pos & off, ~shared & off)
    pml_checks.close(vg, pml_checks.pml_vg(peer, x, np.arange(12),
                                           indices_tuple=pairs))
  np.testing.assert_allclose(float(matrix_form), float(got[2][0]),
                             rtol=1e-5)


def test_bad_multi_hot_labels_are_one_line_errors():
  x = jnp.ones((3, 2))
  for labels, match in ((np.array([[0, 2], [1, 0], [0, 0]]), "only 0 and 1"),
                        (np.ones((3, 2), np.float32), "bool or 0/1"),
                        (np.ones((2, 2), bool), "2 rows but there are 3"),
                        (np.ones((3, 0), bool), "no classes"),
                        (np.array([[0], [1], [1]]), "reads as class ids")):
    with pytest.raises((ValueError, TypeError), match=match) as info:
      losses.circle_loss(x, labels)
    assert "\n" not in str(info.value)
  with pytest.raises(ValueError, match="both class ids or both multi-hot"):
    losses.circle_loss(x, np.ones((3, 2), bool),
                       ref=losses.Candidates(x, np.array([0, 1, 0])))
