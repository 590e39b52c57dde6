"""The loss rules and the engines that run them (circle_jax.losses.engine).

* The blockwise engine's dL/dS, derived from each rule, equals autodiff of the
  dense engine on the same block (empty sets, miner masks, selections).
* Dense == blockwise for every rule through the public losses, with padding,
  miner masks, anchors with empty sets, and ``axis_name`` on the 8 simulated
  devices under ``jax.shard_map`` and ``jax.pmap``.
* The tile-level pieces compose into another engine without touching a loss.
* Each hyperparameter default is written once: in the rule.
"""

import functools
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import circle_jax.losses as losses
from circle_jax import ops
from circle_jax.losses import engine
from circle_jax.losses.engine import tiles
from circle_jax.losses.circle import Circle, Unified
from circle_jax.losses.multi_similarity import MultiSimilarity
from circle_jax.losses.contrastive import Contrastive
from circle_jax.losses.ranked_list import RankedList
from circle_jax.losses.triplet import BatchHard

# Slow (every engine compiled per rule): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

# Label 9 is a singleton (no positives); 16 samples, 8 devices x 2.
LABELS = np.array([0, 1, 2, 0, 1, 2, 3, 3, 0, 1, 2, 3, 9, 0, 1, 2], np.int32)
B = len(LABELS)

RULES = {
    "circle": Circle(),
    "circle_m": Circle(margin=0.25, gamma=32.0),
    "unified": Unified(gamma=16.0),
    "ms": MultiSimilarity(),
    "ms_no_mining": MultiSimilarity(mining=False, beta=20.0),
    "rll": RankedList(),
    "rll_t_pos": RankedList(t_pos=3.0, t_neg=4.0, imbalance=0.3),
    "contrastive": Contrastive(pos_margin=0.3, neg_margin=1.2),
    "triplet_batch_hard": BatchHard(margin=0.3),
}

# The public embedding form of each rule (all take block_size).
PUBLIC = {
    "circle": (losses.circle_loss, {}),
    "circle_m": (losses.circle_loss, dict(margin=0.25, gamma=32.0)),
    "unified": (losses.unified_loss, dict(gamma=16.0)),
    "ms": (losses.multi_similarity_loss, {}),
    "ms_no_mining": (losses.multi_similarity_loss,
                     dict(mining=False, beta=20.0)),
    "rll": (losses.ranked_list_loss, {}),
    "rll_t_pos": (losses.ranked_list_loss,
                  dict(t_pos=3.0, t_neg=4.0, imbalance=0.3)),
    "contrastive": (losses.contrastive_loss,
                    dict(pos_margin=0.3, neg_margin=1.2)),
    "triplet_batch_hard": (losses.triplet_margin_loss,
                           dict(margin=0.3, mining="batch_hard")),
}


def _embeddings(seed=0, dim=6):
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(10, dim))
  return (centres[LABELS] + 0.9 * rng.normal(size=(B, dim))).astype(np.float32)


def _block():
  x = _embeddings()
  _, _, s, pos, neg = engine.pair_block(jnp.asarray(x), jnp.asarray(LABELS))
  return s, pos, neg


def _miner_masks():
  rng = np.random.default_rng(3)
  return (jnp.asarray(rng.random((B, B)) < 0.7),
          jnp.asarray(rng.random((B, B)) < 0.7))


# ----------------------------------------------------------------------------
# Derived dL/dS == autodiff of the dense engine.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", sorted(RULES))
def test_derived_tile_cotangent_is_the_dense_gradient(name, masked):
  rule = RULES[name]
  s, pos, neg = _block()
  if masked:
    pm, nm = _miner_masks()
    pos, neg = pos & pm, neg & nm
  ct = jnp.asarray(np.random.default_rng(1).uniform(0.5, 2.0, B), jnp.float32)

  # One cotangent per anchor for each term of the rule's per-anchor output.
  ct = jax.tree.map(lambda _: ct,
                    engine.dense_per_anchor(rule, s, pos, neg)[0])

  def dense(s):
    per_anchor, _ = engine.dense_per_anchor(rule, s, pos, neg)
    return sum(jax.tree.leaves(jax.tree.map(lambda t, c: jnp.sum(t * c),
                                            per_anchor, ct)))

  want = jax.grad(dense)(s)
  pre = tiles.prepass_update(rule, None, s, pos, neg)
  stats = tiles.stats_update(rule, tiles.stats_init(s[:, 0]), s, pos, neg,
                               tuple(p[:, None] for p in pre))
  got = tiles.tile_cotangent(rule, s, pos, neg,
                               tuple(p[:, None] for p in pre), stats, ct)
  assert float(jnp.max(jnp.abs(want))) > 1e-3  # the test can fail
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  if rule.statistic == "lse":
    # The singleton anchor (no positives) is not valid: a zero gradient row.
    np.testing.assert_array_equal(np.asarray(got)[LABELS == 9], 0.0)


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


# ----------------------------------------------------------------------------
# Dense == blockwise through the public losses.
# ----------------------------------------------------------------------------


def _assert_vg_close(got, want):
  """Value to float32 rounding; gradient to rounding of its largest entry."""
  scale = float(jnp.max(jnp.abs(want[1])))
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(got[1], want[1], rtol=1e-5, atol=2e-5 * scale)


def _vg(fn, x, **kw):
  return jax.jit(jax.value_and_grad(
      lambda x: fn(x, jnp.asarray(LABELS), **kw)))(jnp.asarray(x))


@pytest.mark.parametrize("block_size", [3, 5, 16])
@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_blockwise_equals_dense(name, block_size):
  fn, hyper = PUBLIC[name]
  x = _embeddings()
  want = _vg(fn, x, **hyper)
  got = _vg(fn, x, block_size=block_size, **hyper)
  assert float(jnp.max(jnp.abs(want[1]))) > 1e-4
  _assert_vg_close(got, want)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_blockwise_equals_dense_with_miner_masks(name):
  fn, hyper = PUBLIC[name]
  pm, nm = _miner_masks()
  x = _embeddings(seed=4)
  want = _vg(fn, x, pos_mask=pm, neg_mask=nm, **hyper)
  got = _vg(fn, x, pos_mask=pm, neg_mask=nm, block_size=5, **hyper)
  _assert_vg_close(got, want)


@pytest.mark.parametrize("name", ["circle", "ms", "rll"])
def test_blockwise_all_sets_empty_gives_zero_and_zero_gradient(name):
  fn, hyper = PUBLIC[name]
  labels = jnp.arange(B, dtype=jnp.int32)  # no positives at all
  x = jnp.asarray(_embeddings())
  for block_size in (None, 5):
    v, g = jax.value_and_grad(lambda x: fn(x, labels, block_size=block_size,
                                           **hyper))(x)
    if name != "rll":  # RLL still has its negative term
      assert float(v) == 0.0
      np.testing.assert_array_equal(np.asarray(g), 0.0)
    assert np.all(np.isfinite(np.asarray(g)))


def _mesh():
  return Mesh(np.array(jax.devices()), ("d",))


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
@pytest.mark.parametrize("block_size", [None, 3])
@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_axis_name_equals_single_device(name, block_size, mode):
  fn, hyper = PUBLIC[name]
  x = _embeddings()
  want = _vg(fn, x, **hyper)
  n = jax.device_count()

  def local(x, labels):
    return jax.value_and_grad(lambda x: fn(
        x, labels, axis_name="d", block_size=block_size, **hyper))(x)

  if mode == "shard_map":
    v, g = jax.jit(jax.shard_map(local, mesh=_mesh(), in_specs=(P("d"), P("d")),
                                 out_specs=(P(), P("d"))))(
                                     jnp.asarray(x), jnp.asarray(LABELS))
  else:
    v, g = jax.pmap(local, axis_name="d")(
        jnp.asarray(x).reshape(n, B // n, -1),
        jnp.asarray(LABELS).reshape(n, B // n))
    np.testing.assert_allclose(np.asarray(v), float(v[0]), rtol=1e-6)
    v, g = v[0], g.reshape(B, -1)
  _assert_vg_close((v, g), want)


def test_traced_hyperparameters_run_blockwise_without_gradient():
  x = jnp.asarray(_embeddings())
  labels = jnp.asarray(LABELS)

  @jax.jit
  def f(gamma):
    return losses.circle_loss(x, labels, gamma=gamma, block_size=5)

  np.testing.assert_allclose(float(f(32.0)), float(
      losses.circle_loss(x, labels, gamma=32.0)), rtol=1e-6)
  assert float(jax.grad(f)(32.0)) == 0.0  # hyperparameters are constants


# ----------------------------------------------------------------------------
# global_sum.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["shard_map", "shard_map_unchecked", "pmap"])
def test_global_sum_backward_is_the_identity(mode):
  n = jax.device_count()
  x = jnp.arange(2.0 * n).reshape(n, 2) / 3.0

  def local(x):
    return jax.value_and_grad(
        lambda x: ops.global_sum(jnp.sum(x ** 2), "d"))(x)

  if mode == "pmap":
    v, g = jax.pmap(local, axis_name="d")(x)
    v = v[0]
  else:
    v, g = jax.jit(jax.shard_map(
        local, mesh=_mesh(), in_specs=P("d"), out_specs=(P(), P("d")),
        check_vma=mode == "shard_map"))(x.reshape(-1))
    g = g.reshape(n, 2)
  np.testing.assert_allclose(float(v), float(jnp.sum(x ** 2)), rtol=1e-6)
  # Exact: d/dx of the global sum is 2x, not 2x times the device count.
  np.testing.assert_allclose(np.asarray(g), 2 * np.asarray(x), rtol=1e-6)


# ----------------------------------------------------------------------------
# A third engine from the tile-level pieces.
# ----------------------------------------------------------------------------


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
  s, pos, neg = _block()
  want = engine.dense_per_anchor(rule, s, pos, neg)
  got = _column_chunk_engine(rule, s, pos, neg, chunk=3)
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[1], want[1])


# ----------------------------------------------------------------------------
# Each default once.
# ----------------------------------------------------------------------------


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
  x = jnp.asarray(_embeddings())
  labels = jnp.asarray(LABELS)
  s = jnp.eye(B)
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
