"""Tests of the numerical building blocks (circle_jax/ops.py): masked
logsumexps, the two-set exp pass, safe normalisation and distances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from scipy.special import logsumexp as sp_logsumexp

from circle_jax import ops
from jax.sharding import PartitionSpec as P


def test_masked_logsumexp_matches_scipy_and_ignores_masked_values():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, 7)) * 30
  mask = rng.random((5, 7)) < 0.5
  mask[0] = False
  x_poisoned = np.where(mask, x, 1e30)  # masked entries must not matter
  got = np.asarray(ops.masked_logsumexp(jnp.asarray(x_poisoned, jnp.float32),
                                            jnp.asarray(mask)))
  for i in range(5):
    want = sp_logsumexp(x[i][mask[i]]) if mask[i].any() else -np.inf
    np.testing.assert_allclose(got[i], want, rtol=1e-5)


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("jit", [False, True])
def test_two_set_exp_logsumexp_equals_two_masked_logsumexps(axis, jit):
  rng = np.random.default_rng(1)
  lp = rng.normal(size=(6, 9)) * 40
  ln = rng.normal(size=(6, 9)) * 40 + 100  # far apart: one shared shift fails
  side = rng.random((6, 9))
  pos, neg = side < 0.3, side > 0.6
  pos[0], neg[1] = False, False  # an empty positive and an empty negative set
  if axis == 0:
    pos[:, 2], neg[:, 3] = False, False
  args = [jnp.asarray(a, jnp.float32) for a in (lp, ln)] + [
      jnp.asarray(pos), jnp.asarray(neg)]

  def both(lp, ln, pos, neg):
    return _two_set_lse(lp, ln, pos, neg, axis=axis)

  got_p, got_n = (jax.jit(both) if jit else both)(*args)
  for logits, mask, got in ((lp, pos, got_p), (ln, neg, got_n)):
    want = [sp_logsumexp(v[m]) if m.any() else -np.inf
            for v, m in (zip(logits, mask) if axis == -1 else
                         zip(logits.T, mask.T))]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def _two_set_lse(lp, ln, pos, neg, shift=None, axis=-1):
  """Both sets' logsumexps from one ``ops.two_set_exp`` pass."""
  e, m_p, m_n = ops.two_set_exp(lp, ln, pos, neg, shift, axis=axis)
  return tuple(
      jnp.squeeze(ops.log_of_shifted_sum(
          jnp.sum(jnp.where(mask, e, 0.0), axis, keepdims=True), m), axis)
      for mask, m in ((pos, m_p), (neg, m_n)))


def test_two_set_exp_logsumexp_gradient_and_given_shift():
  rng = np.random.default_rng(2)
  lp = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
  ln = jnp.asarray(rng.normal(size=(4, 6)) * 3, jnp.float32)
  side = rng.random((4, 6))
  pos, neg = jnp.asarray(side < 0.4), jnp.asarray(side > 0.5)
  pos = pos.at[0].set(False)

  def two(lp, ln, shift=None):
    a, b = _two_set_lse(lp, ln, pos, neg, shift=shift)
    return jnp.sum(jnp.where(jnp.isfinite(a), a, 0.0) * 1.5
                   + jnp.where(jnp.isfinite(b), b, 0.0))

  def separate(lp, ln):
    a = ops.masked_logsumexp(lp, pos)
    b = ops.masked_logsumexp(ln, neg)
    return jnp.sum(jnp.where(jnp.isfinite(a), a, 0.0) * 1.5
                   + jnp.where(jnp.isfinite(b), b, 0.0))

  want_v, want_g = jax.value_and_grad(separate, (0, 1))(lp, ln)
  got_v, got_g = jax.value_and_grad(two, (0, 1))(lp, ln)
  np.testing.assert_allclose(got_v, want_v, rtol=1e-6)
  for g, w in zip(got_g, want_g):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
  # Any shift at or above the set's maximum that avoids underflow gives the
  # same result; empty sets' shifts (here -inf) are ignored.
  def above_max(x, mask, by):
    return jnp.max(jnp.where(mask, x, -jnp.inf), axis=1, keepdims=True) + by

  shift = (above_max(lp, pos, 0.5), above_max(ln, neg, 2.0))
  assert not np.isfinite(shift[0][0, 0])
  np.testing.assert_allclose(two(lp, ln, shift), want_v, rtol=1e-6)


def test_two_set_exp_clamps_a_shift_below_the_maximum():
  # A shift that a rounding difference puts below its set's maximum (by ulps
  # x scale: hundreds at logits of 1e10) must not overflow exp: every term
  # is <= 1, and the gradient is still the softmax weight's.
  lp = jnp.array([[3e10, 1e10, 0.0]], jnp.float32)
  pos = jnp.array([[True, True, False]])
  shift = (jnp.array([[3e10 - 2048.0]], jnp.float32), jnp.zeros((1, 1)))
  e, _, _ = ops.two_set_exp(lp, lp, pos, ~pos, shift)
  np.testing.assert_array_equal(e, [[1.0, 0.0, 1.0]])
  g = jax.grad(lambda x: jnp.sum(
      ops.two_set_exp(x, x, pos, ~pos, shift)[0]))(lp)
  np.testing.assert_array_equal(g, [[1.0, 0.0, 1.0]])
  lse = ops.masked_logsumexp(lp, pos)
  np.testing.assert_allclose(lse, [3e10], rtol=1e-7)


def test_logsumexp_helpers_propagate_nan_instead_of_reporting_empty():
  # A NaN similarity must reach the loss (the trainer's NaN guard), not look
  # like an empty set that contributes 0.
  x = jnp.array([[0.5, jnp.nan, 1.0]], jnp.float32)
  pos = jnp.array([[True, True, False]])
  assert np.isnan(ops.masked_logsumexp(x, pos)[0])
  a, b = _two_set_lse(x, x, pos, ~pos)
  assert np.isnan(a[0]) and float(b[0]) == 1.0


def test_empty_sets_give_zero_loss_and_zero_gradient():
  x = jnp.array([[1e4, -3.0, 2.0]], jnp.float32)
  mask = jnp.zeros((1, 3), bool)
  f = lambda x: jnp.sum(ops.log1p_sum_exp(x, mask))
  v, g = jax.value_and_grad(f)(x)
  assert float(v) == 0.0
  np.testing.assert_array_equal(np.asarray(g), 0.0)
  h = lambda x: jnp.sum(ops.masked_mean(x, mask))
  v, g = jax.value_and_grad(h)(x)
  assert float(v) == 0.0 and np.all(np.asarray(g) == 0.0)


def test_l2_normalize_zero_vector_is_finite():
  x = jnp.zeros((2, 4), jnp.bfloat16)
  y, vjp = jax.vjp(ops.l2_normalize, x)
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y), 0.0)
  (g,) = vjp(jnp.ones_like(y))
  assert np.all(np.isfinite(np.asarray(g, np.float32)))


def test_euclidean_from_cosine_identical_vectors_zero_distance_finite_grad():
  g = jax.grad(lambda s: jnp.sum(ops.euclidean_from_cosine(s)))(jnp.ones((2, 2)))
  assert np.all(np.isfinite(np.asarray(g)))
  np.testing.assert_array_equal(
      np.asarray(ops.euclidean_from_cosine(jnp.ones((2, 2)))), 0.0)


def test_l2_normalize_keeps_direction_of_huge_and_tiny_norms():
  x = jnp.array([[3e30, -4e30], [3e-30, 4e-30], [1.0, 0.0], [3e38, 2.25e38]],
                jnp.float32)
  for f in (ops.l2_normalize, jax.jit(ops.l2_normalize)):
    y = np.asarray(f(x))
    np.testing.assert_allclose(
        y, [[0.6, -0.8], [0.6, 0.8], [1.0, 0.0], [0.8, 0.6]], rtol=1e-6)


def test_l2_normalize_gradient_matches_analytic_jacobian():
  x = jnp.array([[1e20, 2e20, -2e20]], jnp.float32)
  ct = jnp.array([[0.3, -1.0, 0.5]], jnp.float32)
  (g,) = jax.vjp(ops.l2_normalize, x)[1](ct)
  xn = np.asarray(x, np.float64)[0]
  n = np.linalg.norm(xn)
  jac = (np.eye(3) - np.outer(xn, xn) / n**2) / n
  np.testing.assert_allclose(np.asarray(g)[0], jac @ np.asarray(ct, np.float64)[0],
                             rtol=1e-5)


def _mesh():
  return Mesh(np.array(jax.devices()), ("d",))


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


def test_vary_as_casts_an_invariant_value_where_a_reference_varies():
  """Inside shard_map, ``vary_as`` makes ``x`` vary where a reference does,
  and its transpose sums the cotangent over the devices: the gradient of
  sum_d <w_d, x> with respect to an invariant ``x`` is sum_d w_d."""
  n = jax.device_count()
  w = jnp.arange(3.0 * n).reshape(n, 3)
  x = jnp.asarray([1.0, -2.0, 0.5])

  def local(x, w):
    assert ops.varying_axes(x) == frozenset()
    cast = ops.vary_as(x, w)
    assert ops.varying_axes(cast) == {"d"} and ops.varying_axes(w) == {"d"}
    assert ops.vary_as(cast, w) is cast  # already varying: unchanged
    assert ops.vary_as(x) is x  # no reference: unchanged
    return jax.grad(lambda x: ops.global_sum(
        jnp.sum(ops.vary_as(x, w) * w), "d"))(x)

  g = jax.jit(jax.shard_map(local, mesh=_mesh(), in_specs=(P(), P("d")),
                            out_specs=P()))(x, w.reshape(-1))
  np.testing.assert_allclose(np.asarray(g), np.asarray(w.sum(0)), rtol=1e-6)
  # Outside a mapped function nothing varies: x itself.
  assert ops.vary_as(x, w) is x
