"""Tests of the baseline pair losses against naive float64 references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax import ops
from circle_jax import losses
from circle_jax.losses import miners
from tests.losses.reference import (contrastive_ref, lifted_ref_ordered,
                                    lifted_ref_paper, margin_ref, n_pair_ref,
                                    triplet_ref)

# Slow (many compiled cases): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


def jitted(fn):
  """``fn`` compiled as one program (keyword arguments closed over): far
  cheaper than op-by-op eager execution on the shared CI cores."""
  def call(*args, **kwargs):
    return jax.jit(lambda *a: fn(*a, **kwargs))(*args)
  return call


# ----------------------------------------------------------------------------
# Data and float64 references (naive loops, one anchor at a time).
# ----------------------------------------------------------------------------

LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 3, 4, 5, 2, 6, 3])  # 16


def pair_batch(seed=0, b=16, d=5):
  x = np.random.default_rng(seed).normal(size=(b, d)).astype(np.float32)
  return x, LABELS[:b]


# ----------------------------------------------------------------------------
# Hand-computed tiny cases.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# Against the float64 references, with and without miner masks.
# ----------------------------------------------------------------------------

_X, _Y = pair_batch(1)
_RNG = np.random.default_rng(2)
_PM, _NM = _RNG.random((16, 16)) < 0.6, _RNG.random((16, 16)) < 0.6
_BETA = np.linspace(0.8, 1.4, 7).astype(np.float32)
_DW_KEY = jax.random.PRNGKey(3)

# name -> (loss(x, y, **kw) under jit, float64 reference(x, y)).
_CASES = {
    "contrastive": (
        functools.partial(losses.contrastive_loss, pos_margin=0.6,
                          neg_margin=1.2),
        lambda x, y: contrastive_ref(x, y, 0.6, 1.2)),
    "contrastive_masked": (
        functools.partial(losses.contrastive_loss, pos_margin=0.6,
                          neg_margin=1.2, pos_mask=_PM, neg_mask=_NM),
        lambda x, y: contrastive_ref(x, y, 0.6, 1.2, _PM, _NM)),
    **{f"triplet_{m}{suffix}": (
        functools.partial(losses.triplet_margin_loss, margin=0.3, mining=m,
                          **masks),
        functools.partial(triplet_ref, margin=0.3, mining=m, **masks))
       for m in ("all", "batch_hard", "semi_hard")
       for suffix, masks in (("", {}),
                             ("_masked", {"pos_mask": _PM,
                                          "neg_mask": _NM}))},
    "lifted": (functools.partial(losses.lifted_structure_loss, margin=1.0),
               lambda x, y: lifted_ref_paper(x, y, 1.0)),
    "lifted_masked": (
        functools.partial(losses.lifted_structure_loss, margin=0.7,
                          pos_mask=_PM, neg_mask=_NM),
        lambda x, y: lifted_ref_ordered(x, y, 0.7, _PM, _NM)),
    "n_pair": (functools.partial(losses.n_pair_loss, l2_reg=0.1),
               lambda x, y: n_pair_ref(x, y, 0.1)),
    "n_pair_masked": (
        functools.partial(losses.n_pair_loss, l2_reg=0.1, pos_mask=_PM,
                          neg_mask=_NM),
        lambda x, y: n_pair_ref(x, y, 0.1, _PM, _NM)),
    "margin": (
        lambda x, y: losses.margin_loss(x, y, _BETA, margin=0.2, nu=0.1),
        lambda x, y: margin_ref(x, y, _BETA, 0.2, 0.1)),
    "margin_scalar_beta": (
        lambda x, y: losses.margin_loss(x, y, 1.1, margin=0.2, nu=0.1),
        lambda x, y: margin_ref(x, y, 1.1, 0.2, 0.1)),
    "margin_masked": (
        lambda x, y: losses.margin_loss(x, y, _BETA, pos_mask=_PM,
                                        neg_mask=_NM),
        lambda x, y: margin_ref(x, y, _BETA, 0.2, 0.0, pos_mask=_PM,
                                neg_mask=_NM)),
}


@pytest.fixture(scope="module")
def case_values():
  """Every case of ``_CASES`` plus the sampler's weights: one program."""
  @jax.jit
  def run(x, y):
    out = {name: fn(x, y) for name, (fn, _) in _CASES.items()}
    out["dw_weights"] = miners.distance_weighted_miner(x, y, _DW_KEY)
    out["margin_dw"] = losses.margin_loss(x, y, _BETA, key=_DW_KEY, nu=0.05)
    out["margin_dw_weights"] = losses.margin_loss(
        x, y, _BETA, nu=0.05, pair_weights=out["dw_weights"])
    return out
  return jax.tree.map(np.asarray, run(_X, _Y))


@pytest.mark.parametrize("name", sorted(_CASES))
def test_matches_float64_reference(case_values, name):
  want = _CASES[name][1](_X, _Y)
  assert want > 0
  np.testing.assert_allclose(float(case_values[name]), want, rtol=2e-5)


def test_margin_with_key_equals_weighted_form_of_the_sampler(case_values):
  w = case_values["dw_weights"]
  assert w.max() >= 1 and np.all(w == np.round(w))
  np.testing.assert_allclose(
      float(case_values["margin_dw"]),
      margin_ref(_X, _Y, _BETA, 0.2, 0.05, weights=w), rtol=2e-5)
  np.testing.assert_allclose(float(case_values["margin_dw_weights"]),
                             float(case_values["margin_dw"]), rtol=1e-6)
  with pytest.raises(ValueError, match="not both"):
    losses.margin_loss(_X, _Y, _BETA, key=_DW_KEY, pair_weights=w)


# ----------------------------------------------------------------------------
# Matrix forms, gradients, numerics.
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
  for name, (matrix_form, wrapper) in run(*pair_batch(12)).items():
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
_X6 = jnp.asarray(pair_batch(16, b=6)[0]).astype(jnp.bfloat16)
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
  x, y = pair_batch(15, b=8, d=3)
  fns = _wrappers()
  names = ["contrastive", "triplet_all", "lifted", "margin"]

  @jax.jit
  def f(x):
    total = sum((k + 1.0) * fns[n](x, jnp.asarray(y))
                for k, n in enumerate(names))
    return total + losses.n_pair_loss(x, jnp.asarray(y), l2_reg=0.1)
  check_grads(f, (jnp.asarray(x),), order=1, modes=["rev"], eps=1e-3,
              atol=2e-2, rtol=2e-2)


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


def test_jit_and_vmap_equal_eager():
  _, y = pair_batch(17)
  xs = np.stack([pair_batch(17)[0], pair_batch(18)[0]])
  f = lambda x: losses.triplet_margin_loss(x, jnp.asarray(y), mining="all")
  eager = float(f(xs[0]))
  np.testing.assert_allclose(float(jax.jit(f)(xs[0])), eager, rtol=1e-6)
  got = np.asarray(jax.jit(jax.vmap(f))(xs))
  np.testing.assert_allclose(got[0], eager, rtol=1e-6)
  np.testing.assert_allclose(got[1], triplet_ref(xs[1], y, 0.2, "all"),
                             rtol=2e-5)


def test_bad_inputs_raise_clear_errors():
  x, y = pair_batch(19, b=4)
  with pytest.raises(ValueError, match="mining"):
    losses.triplet_margin_loss(x, y, mining="hardest")
  with pytest.raises(ValueError, match="margin"):
    losses.triplet_margin_loss(x, y, margin=-1.0)
  with pytest.raises(ValueError, match="embeddings"):
    losses.contrastive_loss(x[0], y)
  with pytest.raises(TypeError, match="labels"):
    losses.lifted_structure_loss(x, y.astype(np.float32))
  with pytest.raises(ValueError, match="pos_mask"):
    losses.n_pair_loss(x, y, pos_mask=np.ones((4, 3), bool))
  with pytest.raises(ValueError, match="beta"):
    losses.margin_loss(x, y, np.ones((2, 2), np.float32))
  with pytest.raises(TypeError, match="beta"):
    losses.margin_loss(x, y, np.ones((4,), np.int32))
  with pytest.raises(ValueError, match="pair_weights"):
    losses.margin_loss(x, y, 1.2, pair_weights=np.ones((4, 5)))
  with pytest.raises(ValueError, match="square"):
    losses.contrastive_loss_from_distance(np.ones((4, 3)), y)


# ----------------------------------------------------------------------------
# Global batch across 8 devices: values and gradients equal one device.
# ----------------------------------------------------------------------------


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
  x, y = (jnp.asarray(a) for a in pair_batch(20))
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


def test_miner_masks_on_devices_match_single_device_blocks():
  x, y = (jnp.asarray(a) for a in pair_batch(21))
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
