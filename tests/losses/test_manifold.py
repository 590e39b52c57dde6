"""Tests of the Manifold loss (circle_jax/losses/manifold.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.grad_check import check_grads

from circle_jax import losses
from tests.losses import class_matrix_checks as cmc

# Slow (value and gradient against PML on every engine, 8 simulated devices):
# not in the fast tier (CONTRIBUTING.md); CI runs it.
pytestmark = pytest.mark.slow

_RNG = np.random.default_rng(6)
_N, _D, _K = 12, 5, 4
_X = _RNG.normal(size=(_N, _D))
_Y = _RNG.integers(0, _K, _N)
_P = _RNG.normal(size=(_K, _D))
_FN = losses.manifold_loss
# PML's defaults, then other weights, walks and margins.
_HYPER = [{}, {"lambdaC": 0.3, "alpha": 0.5, "margin": 0.01},
          {"lambdaC": 0.0, "margin": 0.05}, {"alpha": 0.95, "margin": 0.0}]


@pytest.mark.parametrize("hyper", _HYPER, ids=str)
def test_equals_pytorch_metric_learning(hyper):
  """PML's meta-classes given as its ``indices_tuple`` (our labels)."""
  torch = pytest.importorskip("torch")
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  loss = pml.ManifoldLoss(l=_D, K=_K, **hyper).double()
  loss.proxies.data = torch.tensor(_P)
  xt = torch.tensor(_X, requires_grad=True)
  v = loss(xt, indices_tuple=torch.tensor(_Y))
  v.backward()
  want = (v.item(), xt.grad.numpy(), loss.proxies.grad.numpy())
  got = cmc.ours_value_and_grads(_FN, _X, _Y, _P, **hyper)
  cmc.assert_close_to_pml(got, want, rtol=2e-6)


def test_lambda_c_infinite_is_the_context_loss_alone():
  x, p = jnp.asarray(_X, jnp.float32), jnp.asarray(_P, jnp.float32)
  context = _FN(x, _Y, p, lambdaC=2.0) - _FN(x, _Y, p, lambdaC=1.0)
  np.testing.assert_allclose(_FN(x, _Y, p, lambdaC=math.inf), context,
                             rtol=1e-4)
  assert np.isfinite(float(jax.grad(
      lambda a: _FN(a, _Y, p, lambdaC=math.inf))(x).sum()))


def test_hand_computed_random_walk():
  """Two embeddings, one proxy each, all orthogonal: S = e^0 = 1 off the
  diagonal, S_bar = S / 3, F = (1 - a)(I - a S / 3)^{-1}; with alpha = 0.5
  the intrinsic and context terms follow from F by hand below."""
  x = jnp.eye(4)[:2]
  p = jnp.eye(4)[2:]
  a = 0.5
  s_bar = (np.ones((4, 4)) - np.eye(4)) / 3
  f = (1 - a) * np.linalg.inv(np.eye(4) - a * s_bar)
  # F is symmetric with equal off-diagonal entries: every t = margin.
  t = 0.1
  assert np.allclose(f[0, 2], f[0, 3])
  want = np.log1p(np.exp(t)) * 2  # intrinsic + context, one other proxy
  np.testing.assert_allclose(
      _FN(x, jnp.array([0, 1]), p, alpha=a, margin=t), want, rtol=1e-5)


def test_sharded_proxies_and_batch_equal_the_whole():
  cmc.check_sharded_equals_whole(_FN, lambdaC=0.5, alpha=0.6, margin=0.01)


def test_check_grads():
  check_grads(lambda a, b: _FN(a, _Y, b, margin=0.01),
              (jnp.asarray(_X, jnp.float32), jnp.asarray(_P, jnp.float32)),
              order=1, modes=["rev"], eps=1e-3, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bad, match", [
    ({"alpha": 1.0}, "alpha"), ({"lambdaC": -1.0}, "lambdaC"),
    ({"shard_classes": True}, "shard_classes=True needs"),
    ({"num_classes": 7}, "num_classes=7")], ids=str)
def test_bad_inputs_raise_one_line(bad, match):
  with pytest.raises(ValueError, match=match):
    _FN(_X, _Y, _P, **bad)


def test_registry_entry():
  entry = losses.get_loss("manifold")
  assert entry.fn is _FN and entry.kind == "proxy" and entry.shards_classes
  assert entry.param_name == "proxies"
  assert dict(entry.defaults) == {"lambdaC": 1.0, "alpha": 0.8,
                                  "margin": 5e-4}
  assert entry.init_params(jax.random.PRNGKey(0), _K, _D).shape == (_K, _D)
