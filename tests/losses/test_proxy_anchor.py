"""Tests of Proxy-Anchor and Ranked Proxy-Anchor (losses/proxy_anchor.py)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax.losses import (
    proxy_anchor_loss,
    proxy_anchor_loss_from_similarity,
    ranked_proxy_anchor_loss,
    ranked_proxy_anchor_loss_from_distance,
)
from tests.losses import reference as ref
from tests.losses.reference import pa_reference, rpal_reference

# Slow (sharded and sampled class matrices): not in the fast tier.
pytestmark = pytest.mark.slow

PA = dict(margin=0.1, alpha=32.0)
RPAL = dict(alpha=1.4, margin=0.4, t_neg=20.0)


# ----------------------------------------------------------------------------
# Float64 references, written naively (one proxy, one sample at a time).
# ----------------------------------------------------------------------------


def _distances64(x, proxies, kind):
  s = ref.cos(x, proxies)
  return np.sqrt(np.maximum(2 - 2 * s, 0)) if kind == "euclidean" else 1 - s


@pytest.fixture(scope="module")
def batch():
  # Seed 42 keeps every distance >= 0.01 away from the boundaries alpha and
  # alpha - margin (checked in the check_grads tests), so float32 and float64
  # agree on the non-trivial sets and finite differences do not cross them.
  rng = np.random.default_rng(42)
  x = rng.normal(size=(12, 3)).astype(np.float32)
  labels = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 4, 4, 4], np.int32)
  proxies = rng.normal(size=(6, 3)).astype(np.float32)  # classes 3, 5 empty
  return x, labels, proxies


# ----------------------------------------------------------------------------
# Proxy-Anchor values and gradients.
# ----------------------------------------------------------------------------


def test_proxy_anchor_hand_computed():
  # Samples on the proxies of their classes (cos 1 to own, 0 to the other);
  # class 2 has no sample. Positive term over 2 proxies, negative over C = 3.
  x = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
  proxies = jnp.eye(3) * 5.0  # normalised inside
  got = proxy_anchor_loss(x, jnp.array([0, 1]), proxies, alpha=2.0,
                          margin=0.1)
  pos = np.log1p(np.exp(-2.0 * 0.9))          # each of proxies 0 and 1
  neg01 = np.log1p(np.exp(2.0 * 0.1))         # one negative with cos 0
  neg2 = np.log1p(2 * np.exp(2.0 * 0.1))      # both samples, cos 0
  want = (2 * pos) / 2 + (2 * neg01 + neg2) / 3
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


@pytest.mark.parametrize("hyper", [PA, dict(margin=0.3, alpha=8.0)])
def test_proxy_anchor_matches_float64_reference(batch, hyper):
  x, labels, proxies = batch
  want, _ = pa_reference(ref.cos(x, proxies), labels, **hyper)
  got = proxy_anchor_loss(jnp.asarray(x), jnp.asarray(labels),
                          jnp.asarray(proxies), **hyper)
  assert got.dtype == jnp.float32 and got.shape == ()
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_proxy_anchor_similarity_gradient_is_the_papers(batch):
  x, labels, proxies = batch
  s = ref.cos(x, proxies)
  _, want = pa_reference(s, labels, **PA)
  got = jax.grad(proxy_anchor_loss_from_similarity)(
      jnp.asarray(s, jnp.float32), jnp.asarray(labels))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_proxy_anchor_check_grads(batch):
  x, labels, proxies = batch
  f = lambda x, p: proxy_anchor_loss(x, jnp.asarray(labels), p, alpha=4.0)
  check_grads(f, (jnp.asarray(x), jnp.asarray(proxies)), order=1,
              modes=("rev",), eps=1e-3, atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------
# Ranked Proxy-Anchor values and gradients.
# ----------------------------------------------------------------------------


def test_ranked_proxy_anchor_hand_computed():
  # Distances given directly: 3 samples, 2 proxies, labels [0, 0, 1].
  d = jnp.array([[1.2, 1.3],    # pos of p0 (hinge 0.2), neg of p1 (0.1)
                 [0.8, 1.0],    # pos of p0, trivial; neg of p1 (0.4)
                 [1.0, 1.5]])   # neg of p0 (0.4); pos of p1, hinge 0.5
  got = ranked_proxy_anchor_loss_from_distance(d, jnp.array([0, 0, 1]),
                                               t_neg=0.0)
  pos = (0.2 + 0.5) / 2       # p0: mean over its one non-trivial positive
  neg = (0.4 + (0.1 + 0.4) / 2) / 2
  np.testing.assert_allclose(float(got), pos + neg, rtol=1e-6)
  got = ranked_proxy_anchor_loss_from_distance(d, jnp.array([0, 0, 1]),
                                               t_neg=10.0)
  w1, w4 = np.exp(1.0), np.exp(4.0)
  neg = (0.4 + (0.1 * w1 + 0.4 * w4) / (w1 + w4)) / 2
  np.testing.assert_allclose(float(got), pos + neg, rtol=1e-6)


@pytest.mark.parametrize("kind", ["euclidean", "cosine"])
def test_ranked_proxy_anchor_matches_float64_reference(batch, kind):
  x, labels, proxies = batch
  want, _ = rpal_reference(_distances64(x, proxies, kind), labels, **RPAL)
  got = ranked_proxy_anchor_loss(jnp.asarray(x), jnp.asarray(labels),
                                 jnp.asarray(proxies), distance=kind)
  assert got.dtype == jnp.float32 and got.shape == ()
  assert want > 0.05
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_ranked_proxy_anchor_distance_gradient_has_constant_weights(batch):
  x, labels, proxies = batch
  d = _distances64(x, proxies, "euclidean")
  _, want = rpal_reference(d, labels, **RPAL)
  got = jax.grad(ranked_proxy_anchor_loss_from_distance)(
      jnp.asarray(d, jnp.float32), jnp.asarray(labels))
  assert np.count_nonzero(want) > 10
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


def test_ranked_proxy_anchor_check_grads(batch):
  x, labels, proxies = batch
  d = _distances64(x, proxies, "euclidean")
  assert np.abs(d - 1.4).min() > 0.01 and np.abs(d - 1.0).min() > 0.01
  f = lambda x, p: ranked_proxy_anchor_loss(x, jnp.asarray(labels), p,
                                            t_neg=0.0)
  check_grads(f, (jnp.asarray(x), jnp.asarray(proxies)), order=1,
              modes=("rev",), eps=1e-3, atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------
# Transformations.
# ----------------------------------------------------------------------------

LOSSES = {"pa": proxy_anchor_loss, "rpal": ranked_proxy_anchor_loss}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_jit_vmap_and_no_retracing(batch, name):
  loss = LOSSES[name]
  x, labels, proxies = batch
  chex.clear_trace_counter()
  xs = jnp.stack([jnp.asarray(x), jnp.asarray(x)[::-1], -jnp.asarray(x)])
  ls = jnp.stack([jnp.asarray(labels)] * 3)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def batched(xs, ls, p):
    return jax.vmap(loss, in_axes=(0, 0, None))(xs, ls, p)

  got = batched(xs, ls, jnp.asarray(proxies))
  got2 = batched(xs + 0.0, ls, jnp.asarray(proxies))  # no retrace
  want = [float(loss(xi, jnp.asarray(labels), jnp.asarray(proxies)))
          for xi in xs]
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(got2))


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_global_batch_equals_single_device(name, mode):
  loss = LOSSES[name]
  n = jax.device_count()
  assert n == 8
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
  # Devices hold different classes; class 5 never occurs.
  labels = jnp.asarray(np.repeat([0, 1, 2, 3, 4, 0, 1, 2], 2), jnp.int32)
  proxies = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
  ref_v, (ref_gx, ref_gp) = jax.value_and_grad(loss, argnums=(0, 2))(
      x, labels, proxies)

  f = jax.value_and_grad(functools.partial(loss, axis_name="d"),
                         argnums=(0, 2))
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, (gx, gp) = jax.jit(jax.shard_map(
        f, mesh=mesh, in_specs=(P("d"), P("d"), P()),
        out_specs=(P(), (P("d"), P()))))(x, labels, proxies)
  else:
    v, (gx, gp) = jax.pmap(f, axis_name="d", in_axes=(0, 0, None))(
        x.reshape(n, 2, 4), labels.reshape(n, 2), proxies)
    np.testing.assert_allclose(np.asarray(v), float(ref_v), rtol=1e-5)
    # pmap: each device holds its share of the proxy gradient; psum it.
    v, gx, gp = v[0], gx.reshape(16, 4), gp.sum(0)
  np.testing.assert_allclose(float(v), float(ref_v), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(gx), np.asarray(ref_gx), atol=1e-5)
  np.testing.assert_allclose(np.asarray(gp), np.asarray(ref_gp), atol=1e-5)


# ----------------------------------------------------------------------------
# Numerics, degenerate batches and labels.
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("name", "hyper"))
def _value_and_grad(x, labels, proxies, name, hyper=()):
  return jax.value_and_grad(LOSSES[name], argnums=(0, 2))(
      x, labels, proxies, **dict(hyper))


def _assert_finite(v, grads):
  assert np.isfinite(float(v))
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g, np.float32)))


def test_large_scale_and_bfloat16_are_finite_and_correct(batch):
  x, labels, proxies = batch
  s = ref.cos(x, proxies)
  # alpha = 1000: exp(alpha * (s + margin)) overflows unless max-shifted.
  hyper = (("alpha", 1000.0),)
  v, g = _value_and_grad(jnp.asarray(x), jnp.asarray(labels),
                         jnp.asarray(proxies), "pa", hyper)
  want, _ = pa_reference(s, labels, margin=0.1, alpha=1000.0)
  np.testing.assert_allclose(float(v), want, rtol=1e-5)
  _assert_finite(v, g)
  xb, pb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(proxies, jnp.bfloat16)
  s_b = ref.cos(np.asarray(xb, np.float32), np.asarray(pb, np.float32))
  v, g = _value_and_grad(xb, jnp.asarray(labels), pb, "pa")
  assert v.dtype == jnp.float32 and g[0].dtype == jnp.bfloat16
  np.testing.assert_allclose(float(v), pa_reference(s_b, labels, **PA)[0],
                             rtol=1e-4)
  _assert_finite(v, g)
  v, g = _value_and_grad(xb, jnp.asarray(labels), pb, "rpal",
                         (("t_neg", 1e4),))
  d_b = np.sqrt(np.maximum(2 - 2 * s_b, 0))
  want, _ = rpal_reference(d_b, labels, **dict(RPAL, t_neg=1e4))
  np.testing.assert_allclose(float(v), want, rtol=1e-4)
  _assert_finite(v, g)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_zero_identical_and_huge_norm_embeddings(batch, name):
  x, labels, proxies = batch
  x, proxies = np.array(x), np.array(proxies)
  x[0] = 0.0
  x[4] = x[3]
  x[7] = proxies[1]      # a sample on another class's proxy: d = 0
  x[9] *= 1e15
  proxies[5] = 0.0       # a zero proxy
  v, g = _value_and_grad(jnp.asarray(x), jnp.asarray(labels),
                         jnp.asarray(proxies), name)
  _assert_finite(v, g)
  s = ref.cos(x, proxies)
  if name == "pa":
    want, _ = pa_reference(s, labels, **PA)
  else:
    want, _ = rpal_reference(np.sqrt(np.maximum(2 - 2 * s, 0)), labels,
                             **RPAL)
  # x[7] sits on proxy 1: in float32 sqrt(2 - 2 cos) is only accurate to
  # ~sqrt(eps) = 3.5e-4 next to d = 0, hence the absolute tolerance.
  np.testing.assert_allclose(float(v), want, rtol=1e-5, atol=5e-4)
  x[9] *= 1e20  # the squared norm overflows float32: must not give NaN
  v, g = _value_and_grad(jnp.asarray(x), jnp.asarray(labels),
                         jnp.asarray(proxies), name)
  _assert_finite(v, g)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_out_of_range_labels_are_ignored(batch, name):
  x, labels, proxies = batch
  bad = labels.copy()
  bad[[2, 5]] = [-1, 6]  # C = 6
  v, g = _value_and_grad(jnp.asarray(x), jnp.asarray(bad),
                         jnp.asarray(proxies), name)
  keep = np.array([i not in (2, 5) for i in range(12)])
  want, want_g = _value_and_grad(jnp.asarray(x[keep]),
                                 jnp.asarray(labels[keep]),
                                 jnp.asarray(proxies), name)
  np.testing.assert_allclose(float(v), float(want), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(g[0])[~keep], 0.0)
  np.testing.assert_allclose(np.asarray(g[0])[keep], np.asarray(want_g[0]),
                             atol=1e-6)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_degenerate_batches(name):
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
  proxies = jnp.asarray(rng.normal(size=(3, 3)), jnp.float32)
  s = ref.cos(np.asarray(x), np.asarray(proxies))

  def want(labels):
    if name == "pa":
      return pa_reference(s[:len(labels)], labels, **PA)[0]
    d = np.sqrt(np.maximum(2 - 2 * s[:len(labels)], 0))
    return rpal_reference(d, labels, **RPAL)[0]

  for labels in ([1], [0, 0, 0, 0], [0, 1, 2, 0], [-1, -1, 7, 3]):
    labels = np.array(labels, np.int32)
    v, g = _value_and_grad(x[:len(labels)], jnp.asarray(labels), proxies,
                           name)
    _assert_finite(v, g)
    np.testing.assert_allclose(float(v), want(labels), rtol=1e-5, atol=1e-7)
  # No valid label at all: nothing to pull or push, zero loss and gradient.
  assert float(v) == 0.0
  assert all(np.all(np.asarray(gi) == 0.0) for gi in g)
  # Samples inside their proxy's sphere and beyond alpha from the others:
  # every RPAL pair is trivial.
  if name == "rpal":
    e = jnp.eye(3)
    v, g = _value_and_grad(-e, jnp.array([0, 1, 2]), -e, name)
    assert float(v) == 0.0
    assert all(np.all(np.asarray(gi) == 0.0) for gi in g)


# ----------------------------------------------------------------------------
# Bad inputs.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_bad_inputs_raise_naming_the_argument(name):
  loss = LOSSES[name]
  x, labels, proxies = jnp.ones((4, 3)), jnp.array([0, 0, 1, 1]), jnp.ones((2, 3))
  with pytest.raises(ValueError, match="proxies.*dimension 5"):
    loss(x, labels, jnp.ones((2, 5)))
  with pytest.raises(ValueError, match="proxies"):
    loss(x, labels, jnp.ones((3,)))
  with pytest.raises(TypeError, match="proxies"):
    loss(x, labels, jnp.ones((2, 3), jnp.int32))
  with pytest.raises(ValueError, match="embeddings"):
    loss(jnp.ones((4, 3, 1)), labels, proxies)
  with pytest.raises(TypeError, match="labels"):
    loss(x, labels.astype(jnp.float32), proxies)
  with pytest.raises(ValueError, match="labels"):
    loss(x, labels[:3], proxies)
  with pytest.raises(ValueError, match="alpha"):
    loss(x, labels, proxies, alpha=-1.0)


def test_bad_matrix_and_option_inputs():
  labels = jnp.array([0, 1])
  with pytest.raises(ValueError, match="similarity"):
    proxy_anchor_loss_from_similarity(jnp.ones((2,)), labels)
  with pytest.raises(ValueError, match="distance"):
    ranked_proxy_anchor_loss_from_distance(jnp.ones((2, 3, 1)), labels)
  with pytest.raises(ValueError, match="labels"):
    ranked_proxy_anchor_loss_from_distance(jnp.ones((3, 3)), labels)
  with pytest.raises(ValueError, match="distance.*'cosine'"):
    ranked_proxy_anchor_loss(jnp.ones((2, 3)), labels, jnp.ones((2, 3)),
                             distance="l1")
  with pytest.raises(ValueError, match="margin"):
    ranked_proxy_anchor_loss(jnp.ones((2, 3)), labels, jnp.ones((2, 3)),
                             margin=-0.5)
