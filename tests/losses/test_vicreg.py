"""Tests of VICReg (circle_jax/losses/vicreg.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax import losses

# Slow (value and gradient against PML on every engine, 8 simulated devices):
# not in the fast tier (CONTRIBUTING.md); CI runs it.
pytestmark = pytest.mark.slow

_RNG = np.random.default_rng(5)
_N, _D = 16, 6
_A = 0.7 * _RNG.normal(size=(_N, _D))
_B = _A + 0.3 * _RNG.normal(size=(_N, _D))
# PML's defaults, then other weights and epsilon (one weight zero).
_HYPER = [{}, {"invariance_lambda": 2.0, "variance_mu": 3.0,
               "covariance_v": 0.5, "eps": 1e-2},
          {"invariance_lambda": 0.0, "variance_mu": 40.0,
           "covariance_v": 4.0}]


def _numpy(z, z2, invariance_lambda=25.0, variance_mu=25.0,
           covariance_v=1.0, eps=1e-4):
  """The loss written as loops, float64."""
  n, d = z.shape
  s = sum((z[i, j] - z2[i, j]) ** 2 for i in range(n) for j in range(d))
  total = invariance_lambda * s / (n * d)
  for v in (z, z2):
    mean = [sum(v[i, j] for i in range(n)) / n for j in range(d)]
    cov = [[sum((v[i, j] - mean[j]) * (v[i, k] - mean[k]) for i in range(n))
            / (n - 1) for k in range(d)] for j in range(d)]
    total += variance_mu * sum(
        max(0.0, 1.0 - np.sqrt(cov[j][j] + eps)) for j in range(d)) / (2 * d)
    total += covariance_v * sum(
        cov[j][k] ** 2 for j in range(d) for k in range(d) if j != k) / d
  return total


def _ours(a, b, **hyper):
  v, g = jax.jit(jax.value_and_grad(
      functools.partial(losses.vicreg_loss, **hyper), argnums=(0, 1)))(
          jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
  return float(v), np.asarray(g[0]), np.asarray(g[1])


@pytest.mark.parametrize("hyper", _HYPER, ids=str)
def test_equals_pytorch_metric_learning_and_the_loops(hyper):
  torch = pytest.importorskip("torch")
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  at = torch.tensor(_A, requires_grad=True)
  bt = torch.tensor(_B, requires_grad=True)
  want = pml.VICRegLoss(**hyper)(at, ref_emb=bt)
  want.backward()
  v, ga, gb = _ours(_A, _B, **hyper)
  np.testing.assert_allclose(v, want.item(), rtol=2e-6)
  np.testing.assert_allclose(v, _numpy(_A, _B, **hyper), rtol=2e-6)
  for got, w in ((ga, at.grad.numpy()), (gb, bt.grad.numpy())):
    np.testing.assert_allclose(got, w, atol=2e-6 * np.abs(w).max())


def test_hand_computed():
  # N = 2, D = 1: z = [1, -1] (variance 2, std > 1: no variance term),
  # z' = [1, 1] (variance 0, std 0.01: v = 0.99 / 2); no covariance pairs;
  # s = (0 + 4) / 2 = 2.  25 * 2 + 25 * 0.495 = 62.375.
  z = jnp.array([[1.0], [-1.0]])
  z2 = jnp.array([[1.0], [1.0]])
  np.testing.assert_allclose(losses.vicreg_loss(z, z2), 62.375, rtol=1e-6)
  # Covariance: D = 2, z = [[1, 1], [-1, -1]] has C = [[2, 2], [2, 2]]:
  # c = (4 + 4) / 2 = 4 per view; identical views: s = 0, no variance term.
  z = jnp.array([[1.0, 1.0], [-1.0, -1.0]])
  np.testing.assert_allclose(losses.vicreg_loss(z, z), 8.0, rtol=1e-6)


def test_views_layout_is_the_two_view_loss():
  x = np.empty((2 * _N, _D), np.float32)
  x[0::2], x[1::2] = _A, _B
  labels = np.repeat(np.arange(_N), 2)
  np.testing.assert_allclose(
      losses.vicreg_loss_of_views(x, labels),
      losses.vicreg_loss(_A.astype(np.float32), _B.astype(np.float32)),
      rtol=1e-6)
  entry = losses.get_loss("vicreg")
  np.testing.assert_allclose(entry.apply(x, labels, covariance_v=2.0),
                             losses.vicreg_loss(_A.astype(np.float32),
                                                _B.astype(np.float32),
                                                covariance_v=2.0), rtol=1e-6)


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_global_batch_over_8_devices_equals_one_device(mode):
  a, b = _A.astype(np.float32), _B.astype(np.float32)
  want_v, want_ga, want_gb = _ours(a, b)
  local = jax.value_and_grad(
      functools.partial(losses.vicreg_loss, axis_name="d"), argnums=(0, 1))
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, (ga, gb) = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P("d"), P("d")),
        out_specs=(P(), (P("d"), P("d")))))(a, b)
  else:
    v, (ga, gb) = jax.pmap(local, axis_name="d")(
        a.reshape(8, -1, _D), b.reshape(8, -1, _D))
    np.testing.assert_array_equal(v, np.full(8, v[0]))
    v = v[0]
  np.testing.assert_allclose(v, want_v, rtol=1e-5)
  np.testing.assert_allclose(np.reshape(ga, a.shape), want_ga, rtol=1e-4,
                             atol=1e-6)
  np.testing.assert_allclose(np.reshape(gb, b.shape), want_gb, rtol=1e-4,
                             atol=1e-6)


def test_check_grads():
  check_grads(losses.vicreg_loss, (jnp.asarray(_A, jnp.float32),
                                   jnp.asarray(_B, jnp.float32)),
              order=1, modes=["rev"], eps=1e-3, atol=2e-2, rtol=2e-2)


def test_bad_inputs_raise_one_line():
  a = _A.astype(np.float32)
  with pytest.raises(ValueError, match="same shape"):
    losses.vicreg_loss(a, a[:4])
  with pytest.raises(ValueError, match="at least 2 pairs"):
    losses.vicreg_loss(a[:1], a[:1])
  with pytest.raises(ValueError, match="covariance_v"):
    losses.vicreg_loss(a, a, covariance_v=-1.0)
  with pytest.raises(ValueError, match="eps"):
    losses.vicreg_loss(a, a, eps=0.0)
  with pytest.raises(ValueError, match="odd batch of 15.*sampler='views'"):
    losses.vicreg_loss_of_views(a[:15], np.arange(15))
  with pytest.raises(TypeError, match="ref_emb"):
    losses.vicreg_loss(a, np.zeros((_N, _D), np.int32))


def test_odd_rows_per_device_gather_the_global_batch():
  """24 rows over 8 devices: 3 each, the pairs cross devices."""
  rng = np.random.default_rng(2)
  x = rng.normal(size=(24, _D)).astype(np.float32)
  labels = np.repeat(np.arange(12), 2).astype(np.int32)
  want = jax.jit(jax.value_and_grad(losses.vicreg_loss_of_views))(x, labels)
  local = jax.value_and_grad(functools.partial(losses.vicreg_loss_of_views,
                                               axis_name="d"))
  mesh = Mesh(np.array(jax.devices()), ("d",))
  v, g = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P("d")),
                               out_specs=(P(), P("d"))))(x, labels)
  np.testing.assert_allclose(v, want[0], rtol=1e-5)
  np.testing.assert_allclose(g, want[1], rtol=1e-4, atol=1e-6)
