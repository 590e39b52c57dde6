"""Every pair loss on every engine: dense == blockwise == ring (8 simulated
devices under ``jax.shard_map``) == its float64 reference, or a one-line
error naming why a loss that is not a rule has only the dense engine; the
unified loss chosen by name through the registry.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax import config as config_lib
from circle_jax import losses
from circle_jax import ops
from tests.losses.engine import cases
from tests.losses import reference as ref
from tests.losses.engine_checks import close
from tests.losses.engine_checks import sharded_vg as _sharded_vg
from tests.losses.engine_checks import vg as _vg
from tests.losses.reference import contrastive_ref, margin_ref, triplet_ref
from tests.losses.reference import loss_ref

# Slow (every engine compiled per rule): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

# 16 samples, 2 per device; label 9 has no positive.
LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 4, 9, 0], np.int32)
B = len(LABELS)


def _x(seed=0):
  return np.random.default_rng(seed).normal(size=(B, 5)).astype(np.float32)


def _unified_ref(x, y, gamma, margin):
  """Eq. 1 anchor by anchor, float64 (``reference.ref_unified_anchor``)."""
  return ref.ref_pair_loss(ref.ref_unified_anchor, ref.cos(x), y,
                           gamma=gamma, margin=margin)


# The rule-based embedding forms: (function, hyperparameters, float64 ref).
RULES = {
    "unified": (losses.unified_loss, dict(gamma=8.0, margin=0.25),
                functools.partial(_unified_ref, gamma=8.0, margin=0.25)),
    "contrastive": (losses.contrastive_loss,
                    dict(pos_margin=0.2, neg_margin=1.3),
                    functools.partial(contrastive_ref, pos_margin=0.2,
                                      neg_margin=1.3)),
    "triplet_batch_hard": (
        losses.triplet_margin_loss, dict(margin=0.3, mining="batch_hard"),
        functools.partial(triplet_ref, margin=0.3, mining="batch_hard")),
}

# Losses that are not rules: only the dense engine.
DENSE_ONLY = {
    "triplet_all": (losses.triplet_margin_loss, dict(mining="all"), ()),
    "triplet_semi_hard": (losses.triplet_margin_loss,
                          dict(mining="semi_hard"), ()),
    "margin": (losses.margin_loss, {}, (jnp.float32(1.2),)),
}


_close = functools.partial(close, rtol=1e-5, grad_atol=2e-5)


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_dense_blockwise_ring_equal_the_float64_reference(name):
  assert jax.device_count() == 8
  fn, hyper, reference = RULES[name]
  x = _x()
  labels = jnp.asarray(LABELS)
  dense = _vg(fn, x, labels, **hyper)
  assert float(dense[0]) > 0
  np.testing.assert_allclose(float(dense[0]), reference(x, LABELS),
                             rtol=2e-5)
  _close(_vg(fn, x, labels, block_size=3, **hyper), dense)
  for block_size in (None, 1):  # one tile per ring step; 1-row tiles
    _close(_sharded_vg(fn, x, labels, collective="ring",
                       block_size=block_size, **hyper), dense)
  _close(_sharded_vg(fn, x, labels, block_size=3, **hyper), dense)


def test_batch_hard_triplet_check_grads_dense_and_blockwise():
  x = jnp.asarray(_x(seed=3))
  labels = jnp.asarray(LABELS)
  for block_size in (None, 4):
    f = jax.jit(lambda x, bs=block_size: losses.triplet_margin_loss(
        x, labels, margin=0.3, mining="batch_hard", block_size=bs))
    check_grads(f, (x,), order=1, modes=("rev",), eps=1e-3, atol=2e-3,
                rtol=2e-3)


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_empty_sets_give_zero_and_zero_gradient_on_every_engine(name):
  fn, hyper, _ = RULES[name]
  if name == "contrastive":  # its sets are per pair: no pair at all
    labels = jnp.zeros(B, jnp.int32)
    hyper = dict(hyper, pos_margin=2.0)  # every positive within the margin
  else:  # all labels distinct: no anchor has a positive
    labels = jnp.arange(B, dtype=jnp.int32)
  x = _x()
  for got in (_vg(fn, x, labels, **hyper),
              _vg(fn, x, labels, block_size=3, **hyper),
              _sharded_vg(fn, x, labels, collective="ring", block_size=3,
                          **hyper)):
    assert float(got[0]) == 0.0
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)


@pytest.mark.parametrize("name", sorted(DENSE_ONLY))
def test_losses_that_are_not_rules_refuse_the_tiled_engines(name):
  fn, hyper, extra = DENSE_ONLY[name]
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  assert np.isfinite(float(fn(x, labels, *extra, **hyper)))
  with pytest.raises(ValueError, match="only the dense engine") as info:
    fn(x, labels, *extra, block_size=4, **hyper)
  assert "\n" not in str(info.value)
  entry = losses.get_loss(name.split("_")[0] if "triplet" in name else name)
  assert entry.execution_options == ()


def test_unified_loss_by_name_through_the_registry_and_the_config():
  entry = losses.get_loss("unified")
  assert entry.fn is losses.unified_loss and entry.kind == "pair"
  assert dict(entry.defaults) == {"gamma": 80.0, "margin": 0.4}
  assert set(entry.hyper_ranges) == {"gamma", "margin"}
  assert entry.execution_options == ("block_size", "collective")
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  np.testing.assert_array_equal(
      entry.apply(x, labels, gamma=8.0, margin=0.25),
      losses.unified_loss(x, labels, gamma=8.0, margin=0.25))
  np.testing.assert_allclose(
      float(entry.apply(x, labels, gamma=8.0, margin=0.25)),
      _unified_ref(_x(), LABELS, 8.0, 0.25), rtol=2e-5)
  with pytest.raises(ValueError, match="gamma"):
    losses.validate_hyper("unified", gamma=0.0)
  c = config_lib.loss_config("unified", margin=0.3)
  assert (c.name, c.gamma, c.margin) == ("unified", 80.0, 0.3)


def test_distance_matrix_loss_reads_distances_and_names_them():
  """A rule with ``on_distance`` on a given distance matrix (hand-computed
  contrastive: positives ``[0.3 - 0]_+`` twice, negatives ``[1 - d]_+`` =
  0.1, 0.1, 0.2, 0.2: 0.3 + 0.15); bad input is named ``distance``; a rule
  without the field is refused."""
  from circle_jax.losses.circle import Circle
  from circle_jax.losses.contrastive import Contrastive
  d = jnp.array([[0.0, 0.3, 0.9], [0.3, 0.0, 0.8], [0.9, 0.8, 0.0]])
  labels = jnp.array([0, 0, 1])
  rule = Contrastive(neg_margin=1.0)
  np.testing.assert_allclose(
      losses.engine.distance_matrix_loss(rule, d, labels), 0.45, rtol=1e-6)
  with pytest.raises(ValueError, match="distance"):
    losses.engine.distance_matrix_loss(rule, d[:2], labels)
  with pytest.raises(ValueError, match="on_distance"):
    losses.engine.distance_matrix_loss(Circle(), d, labels)
# ----------------------------------------------------------------------------
# The pair baselines (contrastive, triplet, lifted structure, N-pair, margin):
# matrix forms equal the embedding wrappers; empty sets, bf16 and gradients
# of every variant in one program; a global batch on 8 devices equals one.
# ----------------------------------------------------------------------------


def test_matrix_forms_equal_wrappers():
  @jax.jit
  def run(x, y):
    dist = ops.euclidean_from_cosine(ops.cosine_similarity(x, x))
    beta = jnp.full((7,), 1.2)
    reg = 0.02 * jnp.mean(jnp.sum(x * x, 1))
    return {
        "contrastive": (losses.contrastive_loss_from_distance(dist, y),
                        losses.contrastive_loss(x, y)),
        "triplet": (losses.triplet_margin_loss_from_distance(
            dist, y, mining="semi_hard"),
                    losses.triplet_margin_loss(x, y, mining="semi_hard")),
        "lifted": (losses.lifted_structure_loss_from_distance(dist, y),
                   losses.lifted_structure_loss(x, y)),
        "n_pair": (losses.n_pair_loss_from_similarity(
            jnp.matmul(x, x.T, precision="highest"), y) + reg,
                   losses.n_pair_loss(x, y)),
        "margin": (losses.margin_loss_from_distance(dist, y, beta),
                   losses.margin_loss(x, y, beta)),
    }
  for name, (matrix_form, wrapper) in run(*cases.pair_batch(12)).items():
    np.testing.assert_allclose(float(matrix_form), float(wrapper), rtol=1e-5,
                               err_msg=name)


def _wrappers(beta_classes=7):
  """Every pair-loss variant as ``f(x, y, pos_mask, neg_mask)``."""
  beta = jnp.full((beta_classes,), 1.0)
  return {
      "contrastive": functools.partial(losses.contrastive_loss,
                                       pos_margin=0.3, neg_margin=1.2),
      "triplet_all": functools.partial(losses.triplet_margin_loss,
                                       margin=0.5),
      "triplet_batch_hard": functools.partial(
          losses.triplet_margin_loss, margin=0.5, mining="batch_hard"),
      "triplet_semi_hard": functools.partial(
          losses.triplet_margin_loss, margin=0.5, mining="semi_hard"),
      "lifted": losses.lifted_structure_loss,
      "n_pair": functools.partial(losses.n_pair_loss, l2_reg=0.0),
      "margin": lambda x, y, **kw: losses.margin_loss(x, y, beta, **kw),
      "margin_dw": lambda x, y, **kw: losses.margin_loss(
          x, y, beta, key=jax.random.PRNGKey(0), **kw),
  }


_WRAPPER_NAMES = sorted(_wrappers())
_NEEDS_BOTH = ("triplet_all", "triplet_batch_hard", "triplet_semi_hard",
               "lifted", "n_pair")


@jax.jit
def _all_values_and_jacobians(x, y, pos_mask, neg_mask):
  fns = _wrappers()
  f = lambda x: jnp.stack([fns[k](x, y, pos_mask=pos_mask, neg_mask=neg_mask)
                           for k in _WRAPPER_NAMES])
  return f(x), jax.jacrev(f)(x)


# One compiled program (bf16 [6, 5] inputs) serves every case below.
_X6 = jnp.asarray(cases.pair_batch(16, b=6)[0]).astype(jnp.bfloat16)
_ALL_PAIRS = jnp.ones((6, 6), bool)


def test_no_pairs_every_loss_zero_with_zero_grad():
  v, g = _all_values_and_jacobians(_X6, jnp.array([0, 0, 0, 1, 1, 2]),
                                   ~_ALL_PAIRS, ~_ALL_PAIRS)
  assert v.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(v), 0.0)
  np.testing.assert_array_equal(np.asarray(g, np.float32), 0.0)


@pytest.mark.parametrize("case", ["one_class", "all_distinct"])
def test_empty_positive_or_negative_sets(case):
  y = (jnp.zeros(6, jnp.int32) if case == "one_class"
       else jnp.arange(6, dtype=jnp.int32))
  v, g = _all_values_and_jacobians(_X6, y, _ALL_PAIRS, _ALL_PAIRS)
  g = np.asarray(g, np.float32)
  assert np.all(np.isfinite(g))
  for k, name in enumerate(_WRAPPER_NAMES):
    if name in _NEEDS_BOTH:  # every term needs a positive and a negative
      assert float(v[k]) == 0.0, name
      np.testing.assert_array_equal(g[k], 0.0, err_msg=name)
  # Losses with separate positive and negative terms keep the present side.
  xn, yn = np.asarray(_X6, np.float32), np.asarray(y)
  np.testing.assert_allclose(float(v[_WRAPPER_NAMES.index("contrastive")]),
                             contrastive_ref(xn, yn, 0.3, 1.2), rtol=1e-5)
  np.testing.assert_allclose(float(v[_WRAPPER_NAMES.index("margin")]),
                             margin_ref(xn, yn, 1.0, 0.2, 0.0), rtol=1e-5)


def test_bf16_zero_vector_and_duplicates_are_finite():
  # A zero embedding and duplicated rows (d = 0 between distinct samples).
  x = _X6.at[0].set(0.0).at[2].set(_X6[1])
  v, g = _all_values_and_jacobians(x, jnp.array([0, 0, 0, 1, 1, 2]),
                                   _ALL_PAIRS, _ALL_PAIRS)
  assert np.all(np.isfinite(np.asarray(v)))
  assert np.all(np.asarray(v)[[_WRAPPER_NAMES.index(k) for k in _NEEDS_BOTH]]
                > 0)
  assert np.all(np.isfinite(np.asarray(g, np.float32)))


def test_check_grads():
  # One numerical-gradient check of a weighted sum of the smooth-enough
  # losses (distinct weights, so an error in any one of them shows).
  x, y = cases.pair_batch(15, b=8, d=3)
  fns = _wrappers()
  names = ["contrastive", "triplet_all", "lifted", "margin"]

  @jax.jit
  def f(x):
    total = sum((k + 1.0) * fns[n](x, jnp.asarray(y))
                for k, n in enumerate(names))
    return total + losses.n_pair_loss(x, jnp.asarray(y), l2_reg=0.1)
  check_grads(f, (jnp.asarray(x),), order=1, modes=["rev"], eps=1e-3,
              atol=2e-2, rtol=2e-2)


_DISTRIBUTED = {
    "contrastive": functools.partial(losses.contrastive_loss, pos_margin=0.3,
                                     neg_margin=1.2),
    "triplet_all": functools.partial(losses.triplet_margin_loss, margin=0.5),
    "triplet_batch_hard": functools.partial(
        losses.triplet_margin_loss, margin=0.5, mining="batch_hard"),
    "triplet_semi_hard": functools.partial(
        losses.triplet_margin_loss, margin=0.5, mining="semi_hard"),
    "lifted": losses.lifted_structure_loss,
    "n_pair": losses.n_pair_loss,
    "margin_dw": lambda x, y, axis_name=None: losses.margin_loss(
        x, y, jnp.linspace(0.8, 1.4, 7), nu=0.1, key=jax.random.PRNGKey(5),
        axis_name=axis_name),
}
_NAMES = sorted(_DISTRIBUTED)


def _all_losses(x, y, axis_name=None):
  """Every loss variant at once (one compilation per mode): ``[n_losses]``."""
  return jnp.stack([_DISTRIBUTED[k](x, y, axis_name=axis_name)
                    for k in _NAMES])


def _values_and_jacobians(f):
  return lambda x, y: (f(x, y), jax.jacrev(f)(x, y))


@pytest.fixture(scope="module")
def single_device_reference():
  x, y = (jnp.asarray(a) for a in cases.pair_batch(20))
  values, jac = jax.jit(_values_and_jacobians(_all_losses))(x, y)
  assert np.all(np.asarray(values) > 0)
  return x, y, values, jac


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_global_batch_equals_single_device(single_device_reference, mode):
  x, y, ref_v, ref_g = single_device_reference
  local = _values_and_jacobians(functools.partial(_all_losses, axis_name="d"))
  n = jax.device_count()
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, g = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P("d"), P("d")),
        out_specs=(P(), P(None, "d"))))(x, y)
  else:
    v, g = jax.pmap(local, axis_name="d")(x.reshape(n, -1, x.shape[1]),
                                          y.reshape(n, -1))
    v, g = v[0], jnp.moveaxis(g, 0, 1).reshape(ref_g.shape)
  for k, name in enumerate(_NAMES):
    np.testing.assert_allclose(float(v[k]), float(ref_v[k]), rtol=1e-5,
                               err_msg=name)
    np.testing.assert_allclose(np.asarray(g[k]), np.asarray(ref_g[k]),
                               atol=1e-5, err_msg=name)


# ----------------------------------------------------------------------------
# The contrastive family (SupCon, NT-Xent, pairwise CE, pairwise sigmoid) in
# both geometries: dense == blockwise == ring, with and without miner masks.
# Its batch is this file's (B = 16, label 9 without a positive).
# ----------------------------------------------------------------------------

assert B == cases.FAMILY_B


@pytest.mark.parametrize("case", sorted(cases.FAMILY_CASES))
def test_contrastive_family_dense_blockwise_ring_equal_on_eight_devices(case):
  assert jax.device_count() == 8
  _, fn, hyper = cases.family_case(case)
  x, labels = cases.family_batch(seed=1), jnp.asarray(cases.FAMILY_LABELS)
  dense = cases.family_vg(fn, x, labels, **hyper)
  close(cases.family_vg(fn, x, labels, block_size=3, **hyper), dense)
  close(cases.family_sharded_vg(fn, x, labels, collective="ring",
                                block_size=1, **hyper), dense)
  close(cases.family_sharded_vg(fn, x, labels, block_size=3, **hyper), dense)


@pytest.mark.parametrize("case", sorted(cases.FAMILY_CASES))
def test_contrastive_family_miner_masks_on_every_engine(case):
  name, fn, hyper = cases.family_case(case)
  rng = np.random.default_rng(5)
  pm, nm = (rng.random((B, B)) < 0.7 for _ in range(2))
  x, labels = cases.family_batch(seed=2), jnp.asarray(cases.FAMILY_LABELS)
  masks = dict(pos_mask=jnp.asarray(pm), neg_mask=jnp.asarray(nm))
  dense = cases.family_vg(fn, x, labels, **masks, **hyper)
  np.testing.assert_allclose(
      float(dense[0]),
      loss_ref(name, x, cases.FAMILY_LABELS, hyper, pos_mask=pm, neg_mask=nm),
      rtol=2e-5)
  close(cases.family_vg(fn, x, labels, block_size=5, **masks, **hyper), dense)
  close(cases.family_sharded_vg(fn, x, labels, masks["pos_mask"],
                                masks["neg_mask"], collective="ring",
                                block_size=1, **hyper), dense)
