"""Tests of Potential Field DML (circle_jax/losses/potential_field.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.grad_check import check_grads

from circle_jax import losses
from tests.losses import engine_checks

_RNG = np.random.default_rng(5)
_B, _D, _C = 8, 4, 5
_X = _RNG.normal(size=(_B, _D))
_Y = np.array([0, 0, 1, 1, 1, 2, 3, 3], np.int32)  # class 4: proxy only
_P = _RNG.normal(size=(_C, _D))
_HYPER = {"alpha": 1.5, "delta": 0.3, "lambda_rep": 0.7, "lambda_proxy": 2.0}


def _fn(x, labels, **kw):
  return losses.potential_field_loss(x, labels, jnp.asarray(_P, jnp.float32),
                                     **kw)


def _cosine_distance(a, b):
  a = np.asarray(a, np.float64) / np.linalg.norm(a)
  b = np.asarray(b, np.float64) / np.linalg.norm(b)
  return np.linalg.norm(a - b)


def _loops(x, y, p, alpha=1.0, delta=0.5, lambda_rep=1.0, lambda_proxy=1.0,
           ref=None, ref_y=None, dist=_cosine_distance):
  """The loss as loops over the ordered pairs (with the references ``ref``
  as the columns if given) and the (sample, proxy) pairs, float64."""
  def energy(pairs):
    att = [-(d + delta) ** -alpha for d, same in pairs if same]
    rep = [(d + delta) ** -alpha for d, same in pairs if not same]
    return ((sum(att) / len(att) if att else 0.0)
            + lambda_rep * (sum(rep) / len(rep) if rep else 0.0))
  cols, col_y = (x, y) if ref is None else (ref, ref_y)
  batch = [(dist(x[i], cols[j]), y[i] == col_y[j])
           for i in range(len(x)) for j in range(len(cols))
           if ref is not None or i != j]
  proxy = [(dist(x[i], p[c]), y[i] == c)
           for i in range(len(x)) for c in range(len(p))]
  return energy(batch) + lambda_proxy * energy(proxy)


def test_value_and_gradients_equal_the_loop_reference():
  x, p = jnp.asarray(_X, jnp.float32), jnp.asarray(_P, jnp.float32)
  grads = jax.jit(jax.value_and_grad(
      lambda x, p, h: losses.potential_field_loss(x, _Y, p, **h),
      argnums=(0, 1)))
  for hyper in ({}, _HYPER):  # traced hyperparameters: one compile
    v, (gx, gp) = grads(x, p, {k: jnp.float32(v) for k, v in hyper.items()})
    want = _loops(_X, _Y, _P, **hyper)
    np.testing.assert_allclose(float(v), want, rtol=2e-5)
    np.testing.assert_allclose(
        gx, engine_checks.grad_ref(lambda a: _loops(a, _Y, _P, **hyper), _X),
        atol=1e-4)
    np.testing.assert_allclose(
        gp, engine_checks.grad_ref(lambda a: _loops(_X, _Y, a, **hyper), _P),
        atol=1e-4)
  assert np.abs(gp[4]).max() > 0  # an absent class's proxy is repelled


def test_hand_computed():
  # Unit vectors at 0 and 90 degrees, labels [0, 1], proxies e0 (class 0)
  # and e1 (class 1); alpha 1, delta 0.5. Batch: no positive, negatives at
  # d = sqrt 2. Proxies: own at d = 0, others at sqrt 2.
  e = jnp.eye(2, dtype=jnp.float32)
  phi = 1 / (np.sqrt(2) + 0.5)
  want = phi + (-1 / 0.5 + phi)
  got = jax.jit(losses.potential_field_loss)(e, jnp.array([0, 1]), e)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_check_grads():
  f = jax.jit(lambda x, p: losses.potential_field_loss(x, _Y, p, **_HYPER))
  check_grads(f, (_X.astype(np.float32), _P.astype(np.float32)), order=1,
              modes=["rev"], eps=1e-3, atol=2e-2, rtol=2e-2)


def test_blockwise_and_the_8_device_ring_equal_dense():
  x = jnp.asarray(_RNG.normal(size=(16, _D)), jnp.float32)
  y = np.repeat(np.arange(4, dtype=np.int32), 4)
  want = engine_checks.vg(_fn, x, y, **_HYPER)
  engine_checks.close(engine_checks.vg(_fn, x, y, block_size=3, **_HYPER),
                      want)
  engine_checks.close(engine_checks.sharded_vg(
      _fn, x, y, collective="ring", block_size=3, **_HYPER), want)


def test_references_and_the_poincare_ball():
  # A memory as the pair part's columns (the proxy part keeps the batch).
  rng = np.random.default_rng(9)
  mem = rng.normal(size=(6, _D))
  mem_y = np.array([0, 1, 2, 3, 4, 0], np.int32)
  got = jax.jit(lambda x, m: _fn(x, _Y, ref=losses.Candidates(m, mem_y),
                                 **_HYPER))(_X.astype(np.float32),
                                            mem.astype(np.float32))
  np.testing.assert_allclose(
      float(got), _loops(_X, _Y, _P, ref=mem, ref_y=mem_y, **_HYPER),
      rtol=2e-5)
  # The ball (c 0.1, r 2.3): its distances (the geometry's) in the formula.
  ball = losses.engine.resolve_geometry("poincare")

  points = np.concatenate([_X, _P])
  z = ball.embed(jnp.asarray(points, jnp.float32))
  table = np.asarray(ball.to_distance(ball.tile(z, z)), np.float64)
  row = {v.tobytes(): i for i, v in enumerate(points)}

  def ball_distance(a, b):
    return table[row[a.tobytes()], row[b.tobytes()]]
  got = jax.jit(lambda x: _fn(x, _Y, geometry="poincare", **_HYPER))(
      _X.astype(np.float32))
  np.testing.assert_allclose(
      float(got), _loops(_X, _Y, _P, dist=ball_distance, **_HYPER),
      rtol=1e-4)


def test_empty_sets_give_zero_loss_and_zero_gradient():
  x = jnp.asarray(_X, jnp.float32)
  # All labels distinct: no positive pair; no repulsion, no proxy term.
  v, g = engine_checks.vg(_fn, x, jnp.arange(_B), lambda_rep=0.0,
                          lambda_proxy=0.0)
  assert float(v) == 0.0 and not np.any(np.asarray(g))
  # Empty miner masks, proxies off.
  none = np.zeros((_B, _B), bool)
  v, g = engine_checks.vg(_fn, x, _Y, pos_mask=none, neg_mask=none,
                          lambda_proxy=0.0)
  assert float(v) == 0.0 and not np.any(np.asarray(g))


def test_bad_inputs():
  for name in ("alpha", "delta", "lambda_rep", "lambda_proxy"):
    with pytest.raises(ValueError, match=name):
      losses.potential_field_loss(_X, _Y, _P, **{name: -1.0})
  with pytest.raises(ValueError, match="proxies"):
    losses.potential_field_loss(_X, _Y, _P[:, :2])
