"""The two-stage rules (N-pair, lifted structure) on every engine: dense ==
blockwise (block sizes that do and do not divide the batch) == the device
ring == the all-gathered batch on 8 simulated devices == naive float64
references, values and gradients; check_grads; miner masks; reference
embeddings; empty positive / negative sets.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.grad_check import check_grads

from circle_jax import losses
from circle_jax.losses.circle import Circle
from circle_jax.losses.engine import tiles
from tests.losses import reference as ref
from tests.losses.engine_checks import (
    close,
    grad_ref,
    sharded_vg,
    vg,
    with_references,
)
from tests.losses.engine import cases
import inspect
from circle_jax.losses.circle import Unified
from circle_jax.losses.multi_similarity import MultiSimilarity
from circle_jax.losses.contrastive import Contrastive
from circle_jax.losses.ranked_list import RankedList

# Slow (every engine compiled per rule): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

# 16 samples, 2 per device; label 9 has no positive, label 0 has 4 samples.
LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 4, 9, 0], np.int32)
B, D = len(LABELS), 8


def _x(seed=0):
  return np.random.default_rng(seed).normal(size=(B, D)).astype(np.float32)


# ----------------------------------------------------------------------------
# The cases: each loss with its float64 reference (tests/losses/reference.py).
# ----------------------------------------------------------------------------


CASES = {
    "n_pair": (losses.n_pair_loss, dict(l2_reg=0.1),
               functools.partial(ref.n_pair_ref, l2_reg=0.1)),
    "lifted_structure": (losses.lifted_structure_loss, dict(margin=0.7),
                         functools.partial(ref.lifted_ref_ordered, margin=0.7)),
}


# ----------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_dense_and_blockwise_equal_the_float64_reference(name):
  fn, hyper, reference = CASES[name]
  x, labels = _x(), jnp.asarray(LABELS)
  dense = vg(fn, x, labels, **hyper)
  want = reference(x, LABELS)
  assert want > 0.1  # the test can fail
  np.testing.assert_allclose(float(dense[0]), want, rtol=2e-5)
  want_grad = grad_ref(lambda v: reference(v, LABELS), x)
  np.testing.assert_allclose(np.asarray(dense[1]), want_grad, rtol=2e-3,
                             atol=2e-4 * np.abs(want_grad).max())
  for block_size in (1, 5, 16, 64):  # 5 does not divide 16; 64 > B
    close(vg(fn, x, labels, block_size=block_size, **hyper), dense)


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_grads_blockwise(name):
  fn, hyper, _ = CASES[name]
  x, labels = jnp.asarray(_x(seed=3)), jnp.asarray(LABELS)
  f = jax.jit(lambda x: fn(x, labels, block_size=5, **hyper))
  check_grads(f, (x,), order=1, modes=("rev",), eps=1e-3, atol=2e-3,
              rtol=2e-3)


@pytest.mark.parametrize("name", sorted(CASES))
def test_eight_devices_gather_blockwise_and_ring_equal_the_global_batch(
    name):
  assert jax.device_count() == 8
  fn, hyper, _ = CASES[name]
  x, labels = _x(seed=1), jnp.asarray(LABELS)
  want = vg(fn, x, labels, **hyper)
  close(sharded_vg(fn, x, labels, **hyper), want)
  close(sharded_vg(fn, x, labels, block_size=3, **hyper), want)
  for block_size in (None, 1):  # one tile per ring step; 1-row tiles
    close(sharded_vg(fn, x, labels, collective="ring",
                     block_size=block_size, **hyper), want)


@pytest.mark.parametrize("name", sorted(CASES))
def test_miner_masks_on_every_engine(name):
  fn, hyper, reference = CASES[name]
  rng = np.random.default_rng(5)
  pm, nm = (rng.random((B, B)) < 0.6 for _ in range(2))
  x, labels = _x(seed=2), jnp.asarray(LABELS)
  masks = dict(pos_mask=jnp.asarray(pm), neg_mask=jnp.asarray(nm))
  dense = vg(fn, x, labels, **masks, **hyper)
  want = reference(x, LABELS, pos_mask=pm, neg_mask=nm)
  np.testing.assert_allclose(float(dense[0]), want, rtol=2e-5)
  assert abs(want - reference(x, LABELS)) > 1e-3  # the masks matter
  close(vg(fn, x, labels, block_size=5, **masks, **hyper), dense)
  close(sharded_vg(fn, x, labels, masks["pos_mask"], masks["neg_mask"],
                   **hyper), dense)
  close(sharded_vg(fn, x, labels, masks["pos_mask"], masks["neg_mask"],
                   collective="ring", block_size=1, **hyper), dense)


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_embeddings_on_every_engine(name):
  fn, hyper, reference = CASES[name]
  rng = np.random.default_rng(7)
  mem = rng.normal(size=(16, D)).astype(np.float32)
  mem_labels = rng.integers(0, 6, 16).astype(np.int32)
  x, labels = _x(seed=4), jnp.asarray(LABELS)

  want, *others = with_references(fn, x, labels, mem, mem_labels, **hyper)
  np.testing.assert_allclose(
      float(want[0]), reference(x, LABELS, cols=mem, col_y=mem_labels),
      rtol=2e-5)
  want_grad = grad_ref(
      lambda m: reference(x, LABELS, cols=m, col_y=mem_labels), mem)
  np.testing.assert_allclose(np.asarray(want[1][1]), want_grad, rtol=2e-3,
                             atol=2e-4 * np.abs(want_grad).max())
  for got in others:
    for k in (0, 1):
      close((got[0], got[1][k]), (want[0], want[1][k]))


@pytest.mark.parametrize("labels", [np.arange(B), np.zeros(B)],
                         ids=["no_positive", "no_negative"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_empty_sets_give_zero_loss_and_zero_gradient(name, labels):
  fn, hyper, _ = CASES[name]
  hyper = dict(hyper, l2_reg=0.0) if name == "n_pair" else hyper
  labels = jnp.asarray(labels, jnp.int32)
  x = _x()
  for got in (vg(fn, x, labels, **hyper),
              vg(fn, x, labels, block_size=3, **hyper),
              sharded_vg(fn, x, labels, **hyper),
              sharded_vg(fn, x, labels, collective="ring", block_size=3,
                         **hyper)):
    assert float(got[0]) == 0.0
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)


def test_an_anchor_without_negatives_adds_nothing_but_its_pairs_count():
  """Lifted: a pair whose two anchors lack negatives counts in ``|P|`` with
  a zero term; N-pair: its pairs are left out of the mean."""
  x = _x(seed=6)
  labels = np.array([0, 0] + [1] * (B - 2), np.int32)
  nm = np.ones((B, B), bool)
  nm[:2] = False  # anchors 0 and 1 (a positive pair) have no negative
  for name, (fn, hyper, reference) in CASES.items():
    got = vg(fn, x, jnp.asarray(labels), neg_mask=jnp.asarray(nm),
              block_size=5, **hyper)
    want = reference(x, labels, neg_mask=nm)
    np.testing.assert_allclose(float(got[0]), want, rtol=2e-5)
    assert np.all(np.isfinite(np.asarray(got[1])))


def test_one_stage_rules_carry_no_aux():
  """A one-stage rule's tiles carry ``aux=None`` and its tile cotangent is
  the plain ``dL/ds`` array: nothing of the two-stage path is traced."""
  rows = tiles.PairSide(jnp.eye(4, 3), jnp.arange(4) % 2, jnp.arange(4))
  plan = tiles.Plan.of(4, 4, 2)
  rows_t, cols_t = tiles.prepare_tiles(plan, rows, rows)
  assert rows_t["aux"] is None and cols_t["aux"] is None
  rows_b = jax.tree.map(lambda a: a[0], rows_t)
  rule = Circle()
  s, pos, neg, _, aux = tiles.tile(rule.geometry, rows_b, cols_t, 0)
  assert aux is None
  stats = tiles.stats_update(rule, tiles.stats_init(s[:, 0]), s, pos, neg, ())
  g = tiles.tile_cotangent(rule, s, pos, neg, (), stats, jnp.ones(2))
  assert isinstance(g, jax.Array) and g.shape == (2, 2)


@pytest.mark.parametrize("rule, fns", [
    (Circle, [losses.circle_loss, losses.circle_loss_from_similarity]),
    (Unified, [losses.unified_loss, losses.unified_loss_from_similarity]),
    (MultiSimilarity, [losses.multi_similarity_loss,
                       losses.multi_similarity_loss_from_similarity,
                       losses.multi_similarity_weights]),
    (RankedList, [losses.ranked_list_loss,
                  losses.ranked_list_loss_from_similarity,
                  losses.ranked_list_loss_from_distance]),
    (Contrastive, [losses.contrastive_loss,
                   losses.contrastive_loss_from_distance]),
])
def test_every_form_takes_its_defaults_from_the_rule(rule, fns):
  fields = {f.name: f.default for f in
            __import__("dataclasses").fields(rule)}
  for fn in fns:
    params = inspect.signature(fn).parameters
    for name, default in fields.items():
      if name in params:
        assert params[name].default == default, (fn.__name__, name)
  entry = {r: e for e in losses.LOSSES.values() for r in [e.fn]}
  for fn in fns:
    if fn in entry:
      for name, default in entry[fn].defaults.items():
        assert fields[name] == default


def test_rule_checks_its_hyperparameters_once_for_every_form():
  x = jnp.asarray(cases.embeddings())
  labels = jnp.asarray(cases.LABELS)
  s = jnp.eye(cases.B)
  for call in (functools.partial(losses.circle_loss, x, labels),
               functools.partial(losses.circle_loss, x, labels, block_size=4),
               functools.partial(losses.circle_loss_from_similarity, s,
                                 labels)):
    with pytest.raises(ValueError, match="gamma"):
      call(gamma=0.0)
  with pytest.raises(ValueError, match="epsilon"):
    losses.multi_similarity_miner(x, labels, epsilon=-1.0)
  with pytest.raises(ValueError, match="imbalance"):
    losses.ranked_list_loss(x, labels, imbalance=2.0, block_size=4)


def test_as_distance_reads_the_on_distance_flag():
  """``on_distance``: the block as it is; otherwise the geometry's distance
  (cosine: ``sqrt(2 - 2 s)``; hand values)."""
  from circle_jax.losses.contrastive import Contrastive
  s = jnp.array([[1.0, 0.5], [0.0, -1.0]])
  np.testing.assert_array_equal(
      losses.engine.as_distance(Contrastive(on_distance=True), s), s)
  np.testing.assert_allclose(losses.engine.as_distance(Contrastive(), s),
                             [[0.0, 1.0], [np.sqrt(2.0), 2.0]], rtol=1e-6)
def test_far_apart_classes_large_margins_are_finite():
  # Antipodal classes, huge raw norms: exp(margin - d) and exp(s) stay in
  # range thanks to the max-shifted log-sum-exps.
  x = jnp.array([[1.0, 0.0], [1.0, 1e-3], [-1.0, 0.0], [-1.0, 1e-3]]) * 1e3
  y = jnp.array([0, 0, 1, 1])
  f = lambda x: (losses.lifted_structure_loss(x, y, margin=50.0)
                 + losses.n_pair_loss(x, y))
  v, g = jax.jit(jax.value_and_grad(f))(x)
  assert np.isfinite(float(v)) and float(v) > 0
  assert np.all(np.isfinite(np.asarray(g)))
