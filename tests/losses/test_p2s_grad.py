"""Tests of P2SGrad (circle_jax/losses/p2s_grad.py)."""

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

_RNG = np.random.default_rng(11)
_B, _D, _C = 12, 5, 4
_X = _RNG.normal(size=(_B, _D))
_Y = _RNG.integers(0, _C, _B)
_W = _RNG.normal(size=(_C, _D))
_W_UNIT = _W / np.linalg.norm(_W, axis=1, keepdims=True)


def _numpy(x, y, w):
  """The loss written as loops, float64."""
  total = 0.0
  for i in range(len(y)):
    for c in range(w.shape[0]):
      cos = x[i] @ w[c] / np.linalg.norm(x[i]) / np.linalg.norm(w[c])
      total += (np.clip(cos, -1, 1) - (c == y[i])) ** 2
  return total / (len(y) * w.shape[0])


def _pml(w):
  pytest.importorskip("torch")
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  loss = pml.P2SGradLoss(descriptors_dim=_D, num_classes=_C)
  return cmc.pml_value_and_grads(loss, _X, _Y, w, weight_attr="weight")


@pytest.mark.parametrize("w", [_W_UNIT, _W], ids=["unit_rows", "any_rows"])
def test_equals_pytorch_metric_learning(w):
  """PML's value and embedding gradient; PML renormalises its weight in
  place and differentiates it as a raw matrix: our gradient is the part of
  its gradient orthogonal to each unit row, over the row's norm."""
  want_v, want_gx, want_gw = _pml(w)
  v, gx, gw = cmc.ours_value_and_grads(losses.p2s_grad_loss, _X, _Y, w)
  np.testing.assert_allclose(v, want_v, rtol=2e-6)
  np.testing.assert_allclose(v, _numpy(_X, _Y, w), rtol=2e-6)
  np.testing.assert_allclose(gx, want_gx, atol=2e-6 * np.abs(want_gx).max())
  norms = np.linalg.norm(w, axis=1, keepdims=True)
  unit = w / norms
  tangent = (want_gw - np.sum(want_gw * unit, 1, keepdims=True) * unit)
  np.testing.assert_allclose(gw, tangent / norms,
                             atol=2e-6 * np.abs(tangent).max())
  assert np.abs(gw - want_gw).max() > 1e-2  # the difference is real


def test_hand_computed():
  x = jnp.array([[3.0, 0.0]])
  w = jnp.eye(2)
  # cos = [1, 0]: label 0 gives no error; label 1 gives 1 + 1 over 2.
  np.testing.assert_allclose(losses.p2s_grad_loss(x, jnp.array([0]), w), 0.0,
                             atol=1e-12)
  np.testing.assert_allclose(losses.p2s_grad_loss(x, jnp.array([1]), w), 1.0)


def test_sharded_class_matrix_and_batch_equal_the_whole():
  cmc.check_sharded_equals_whole(losses.p2s_grad_loss)


def test_check_grads():
  check_grads(lambda a, b: losses.p2s_grad_loss(a, _Y, b),
              (jnp.asarray(_X, jnp.float32), jnp.asarray(_W, jnp.float32)),
              order=1, modes=["rev"], eps=1e-3, atol=2e-2, rtol=2e-2)


def test_init_has_unit_rows():
  w = losses.get_loss("p2s_grad").init_params(jax.random.PRNGKey(0), 50, 8)
  assert w.shape == (50, 8)
  np.testing.assert_allclose(np.linalg.norm(w, axis=1), 1.0, rtol=1e-6)


def test_bad_inputs_raise_clear_errors():
  with pytest.raises(ValueError, match="dimension"):
    losses.p2s_grad_loss(_X, _Y, _W[:, :2])
  with pytest.raises(ValueError, match="shard_classes=True needs"):
    losses.p2s_grad_loss(_X, _Y, _W, shard_classes=True)
  with pytest.raises(TypeError, match="sample_rate"):
    losses.p2s_grad_loss(_X, _Y, _W, sample_rate=0.5)  # not a softmax
