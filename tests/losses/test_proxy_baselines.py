"""Tests of Proxy-NCA and SoftTriple against naive float64 references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax import losses
from circle_jax.losses import proxy_baselines
from tests.losses.reference import (proxy_nca_ref, soft_triple_ref,
                                    soft_triple_reg_ref)

# Slow (sharded and sampled class matrices): not in the fast tier.
pytestmark = pytest.mark.slow

_RNG = np.random.default_rng(0)
_C, _D, _K = 5, 4, 3
_Y = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0])
_X = _RNG.normal(size=(16, _D)).astype(np.float32)
_PROXIES = _RNG.normal(size=(_C, _D)).astype(np.float32)
_CENTERS = _RNG.normal(size=(_C * _K, _D)).astype(np.float32)


_CASES = {
    "proxy_nca": (
        lambda x, y, p, w: losses.proxy_nca_loss(x, y, p, scale=3.0),
        lambda: proxy_nca_ref(_X, _Y, _PROXIES, 3.0, False)),
    "proxy_nca_include_positive": (
        lambda x, y, p, w: losses.proxy_nca_loss(x, y, p, scale=8.0,
                                                 include_positive=True),
        lambda: proxy_nca_ref(_X, _Y, _PROXIES, 8.0, True)),
    "soft_triple": (
        lambda x, y, p, w: losses.soft_triple_loss(
            x, y, w, centers_per_class=_K, la=20.0, gamma=0.1, margin=0.01,
            tau=0.2),
        lambda: soft_triple_ref(_X, _Y, _CENTERS, _K, 20.0, 0.1, 0.01, 0.2)),
    "soft_triple_soft_assign": (
        lambda x, y, p, w: losses.soft_triple_loss(
            x, y, w, centers_per_class=_K, la=7.0, gamma=2.0, margin=0.3,
            tau=0.0),
        lambda: soft_triple_ref(_X, _Y, _CENTERS, _K, 7.0, 2.0, 0.3, 0.0)),
}


@pytest.fixture(scope="module")
def values():
  @jax.jit
  def run(x, y, p, w):
    out = {name: fn(x, y, p, w) for name, (fn, _) in _CASES.items()}
    # K = 1: SoftTriple is CosFace with scale la and margin delta.
    out["soft_triple_k1"] = losses.soft_triple_loss(
        x, y, p, centers_per_class=1, la=10.0, margin=0.2)
    out["cosface_equivalent"] = losses.cosface_loss(x, y, p, margin=0.2,
                                                    scale=10.0)
    out["reg"] = proxy_baselines.soft_triple_regularizer(
        w, centers_per_class=_K)
    # Hand-computed: x on proxy 0 of two orthogonal proxies.
    e = jnp.eye(2, dtype=jnp.float32)
    out["hand_excluded"] = losses.proxy_nca_loss(e[:1], jnp.array([0]), e,
                                                 scale=2.5)
    out["hand_included"] = losses.proxy_nca_loss(
        e[:1], jnp.array([0]), e, scale=2.5, include_positive=True)
    return out
  return jax.tree.map(np.asarray, run(_X, _Y, _PROXIES, _CENTERS))


@pytest.mark.parametrize("name", sorted(_CASES))
def test_matches_float64_reference(values, name):
  np.testing.assert_allclose(float(values[name]), _CASES[name][1](),
                             rtol=2e-5, atol=1e-6)


def test_proxy_nca_hand_computed(values):
  # d_0 = 0, d_1 = 2.5 * ||e0 - e1||^2 = 5.
  np.testing.assert_allclose(values["hand_excluded"], -5.0, rtol=1e-6)
  np.testing.assert_allclose(values["hand_included"], np.log1p(np.exp(-5.0)),
                             rtol=1e-5)


def test_soft_triple_one_center_is_cosface_and_regularizer_reference(values):
  np.testing.assert_allclose(values["soft_triple_k1"],
                             values["cosface_equivalent"], rtol=1e-6)
  np.testing.assert_allclose(values["reg"], soft_triple_reg_ref(_CENTERS, _K),
                             rtol=1e-5)


def test_check_grads_embeddings_and_class_vectors():
  @jax.jit
  def f(x, p, w):
    return (losses.proxy_nca_loss(x, _Y, p, scale=3.0)
            + 2.0 * losses.soft_triple_loss(x, _Y, w, centers_per_class=_K,
                                            la=5.0, gamma=0.5))
  check_grads(f, (_X, _PROXIES, _CENTERS), order=1, modes=["rev"],
              eps=1e-3, atol=2e-2, rtol=2e-2)


def test_single_class_and_bf16_edge_cases():
  @jax.jit
  def run(x, y, p, xb):
    nca = lambda x: losses.proxy_nca_loss(x, y, p)
    st = lambda x: losses.soft_triple_loss(x, y, jnp.tile(p, (2, 1)),
                                           centers_per_class=2)
    return (jax.value_and_grad(nca)(x), jax.value_and_grad(nca)(xb),
            jax.value_and_grad(st)(xb))
  x = jnp.asarray(_X[:4])
  xb = x.at[1].set(0.0).astype(jnp.bfloat16)
  (v, g), (vb, gb), (vs, gs) = run(x, jnp.zeros(4, jnp.int32),
                                   jnp.asarray(_PROXIES[:1]), xb)
  # One class and the positive excluded: the NCA denominator is empty.
  assert float(v) == 0.0 and float(vb) == 0.0
  np.testing.assert_array_equal(np.asarray(g), 0.0)
  assert vs.dtype == jnp.float32 and np.isfinite(float(vs))
  assert np.all(np.isfinite(np.asarray(gs, np.float32)))
  assert np.all(np.isfinite(np.asarray(gb, np.float32)))


def test_bad_inputs_raise_clear_errors():
  with pytest.raises(ValueError, match="not a multiple"):
    losses.soft_triple_loss(_X, _Y, _CENTERS[:-1], centers_per_class=_K)
  with pytest.raises(ValueError, match="centers_per_class"):
    losses.soft_triple_loss(_X, _Y, _CENTERS, centers_per_class=1.5)
  with pytest.raises(ValueError, match="dimension"):
    losses.proxy_nca_loss(_X, _Y, _PROXIES[:, :3])
  with pytest.raises(ValueError, match="scale"):
    losses.proxy_nca_loss(_X, _Y, _PROXIES, scale=0.0)
  with pytest.raises(TypeError, match="labels"):
    losses.proxy_nca_loss(_X, _Y.astype(np.float32), _PROXIES)


# ----------------------------------------------------------------------------
# Global batch across 8 devices.
# ----------------------------------------------------------------------------


def _both(x, y, p, w, axis_name=None):
  return jnp.stack([
      losses.proxy_nca_loss(x, y, p, scale=3.0, axis_name=axis_name),
      losses.soft_triple_loss(x, y, w, centers_per_class=_K, la=5.0,
                              gamma=0.5, axis_name=axis_name),
  ])


def _value_and_jacobians(f):
  return lambda *a: (f(*a), jax.jacrev(f, argnums=(0, 2, 3))(*a))


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_global_batch_equals_single_device(mode):
  args = (_X, _Y, _PROXIES, _CENTERS)
  ref_v, (ref_gx, ref_gp, ref_gw) = jax.jit(_value_and_jacobians(_both))(
      *args)
  local = _value_and_jacobians(functools.partial(_both, axis_name="d"))
  if mode == "shard_map":
    # Replicated class vectors: their gradient inside the map is the
    # full-batch gradient (JAX sums the replicated input's cotangent).
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, (gx, gp, gw) = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P("d"), P("d"), P(), P()),
        out_specs=(P(), (P(None, "d"), P(), P()))))(*args)
  else:
    # pmap: each device holds its share; the usual psum gives the total.
    def per_device(x, y, p, w):
      v, (gx, gp, gw) = local(x, y, p, w)
      return v, (gx, jax.lax.psum(gp, "d"), jax.lax.psum(gw, "d"))
    v, (gx, gp, gw) = jax.pmap(per_device, axis_name="d",
                               in_axes=(0, 0, None, None))(
                                   _X.reshape(8, 2, _D), _Y.reshape(8, 2),
                                   _PROXIES, _CENTERS)
    v, gp, gw = v[0], gp[0], gw[0]
    gx = jnp.moveaxis(gx, 0, 1).reshape(ref_gx.shape)
  np.testing.assert_allclose(np.asarray(v), np.asarray(ref_v), rtol=1e-5)
  for got, want in ((gx, ref_gx), (gp, ref_gp), (gw, ref_gw)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
