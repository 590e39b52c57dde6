"""Tests of L-Softmax and SphereFace (circle_jax/losses/large_margin.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.grad_check import check_grads

from circle_jax import losses
from circle_jax.losses import large_margin
from tests.losses import class_matrix_checks as cmc

# Slow (value and gradient against PML on every engine, 8 simulated devices):
# not in the fast tier (CONTRIBUTING.md); CI runs it.
pytestmark = pytest.mark.slow

_RNG = np.random.default_rng(7)
_B, _D, _C = 12, 5, 4
_X = _RNG.normal(size=(_B, _D))
_Y = _RNG.integers(0, _C, _B)
_W = _RNG.normal(size=(_C, _D))

_PAIRS = {"large_margin_softmax": ("LargeMarginSoftmaxLoss",
                                   losses.large_margin_softmax_loss),
          "sphereface": ("SphereFaceLoss", losses.sphereface_loss)}
# PML's defaults (m = 4, s = 1), then other margins and scales.
_HYPER = [{}, {"margin": 3, "scale": 2.0}, {"margin": 1, "scale": 0.5},
          {"margin": 2}, {"margin": 5, "scale": 0.3}]


@pytest.mark.parametrize("hyper", _HYPER, ids=str)
@pytest.mark.parametrize("name", sorted(_PAIRS))
def test_equals_pytorch_metric_learning(name, hyper):
  pytest.importorskip("torch")
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  cls, fn = _PAIRS[name]
  want = cmc.pml_value_and_grads(
      getattr(pml, cls)(num_classes=_C, embedding_size=_D, **hyper),
      _X, _Y, _W)
  got = cmc.ours_value_and_grads(fn, _X, _Y, _W, **hyper)
  cmc.assert_close_to_pml(got, want, rtol=2e-6)


def _psi_loop(theta, m):
  """The paper's eq. 6, written with the angle (float64)."""
  k = min(int(theta // (math.pi / m)), m - 1)
  return (-1) ** k * math.cos(m * theta) - 2 * k


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
def test_psi_is_the_monotonic_extension_of_cos_m_theta(m):
  theta = np.linspace(0.0, math.pi, 97)[:-1] + 1e-3
  got = np.asarray(large_margin.cos_with_margin(
      jnp.asarray(np.cos(theta), jnp.float32), m))
  want = np.array([_psi_loop(t, m) for t in theta])
  np.testing.assert_allclose(got, want, atol=1e-4)
  assert np.all(np.diff(got) < 0)  # monotonic decreasing in theta


def test_hand_computed():
  # x = 2 (cos t, sin t), t = pi / 3, W = [e0, e1], m = 2, s = 1:
  # target psi = cos(2 pi / 3) = -1/2, logit 2 * 1 * (-1/2) = -1;
  # other logit W_1 . x = 2 sin(pi / 3) = sqrt(3).
  t = math.pi / 3
  x = jnp.array([[2 * math.cos(t), 2 * math.sin(t)]], jnp.float32)
  w = jnp.eye(2, dtype=jnp.float32)
  want = math.log(math.exp(-1.0) + math.exp(math.sqrt(3))) + 1.0
  for fn in (losses.large_margin_softmax_loss, losses.sphereface_loss):
    np.testing.assert_allclose(fn(x, jnp.array([0]), w, margin=2), want,
                               rtol=1e-6)
  # ||W_0|| = 3 multiplies L-Softmax's target logit, not SphereFace's.
  w3 = w.at[0].multiply(3.0)
  np.testing.assert_allclose(
      losses.large_margin_softmax_loss(x, jnp.array([0]), w3, margin=2),
      math.log(math.exp(-3.0) + math.exp(math.sqrt(3))) + 3.0, rtol=1e-6)
  np.testing.assert_allclose(
      losses.sphereface_loss(x, jnp.array([0]), w3, margin=2), want,
      rtol=1e-6)


def test_margin_one_is_the_plain_softmax():
  x, w = jnp.asarray(_X, jnp.float32), jnp.asarray(_W, jnp.float32)
  np.testing.assert_allclose(
      losses.large_margin_softmax_loss(x, _Y, w, margin=1),
      losses.softmax_loss(x, _Y, w), rtol=1e-5)


@pytest.mark.parametrize("name", sorted(_PAIRS))
def test_sharded_class_matrix_and_batch_equal_the_whole(name):
  cmc.check_sharded_equals_whole(_PAIRS[name][1], margin=3, scale=0.5)


@pytest.mark.parametrize("name", sorted(_PAIRS))
def test_check_grads(name):
  fn = _PAIRS[name][1]
  x = jnp.asarray(_X, jnp.float32)
  w = jnp.asarray(_W, jnp.float32)
  check_grads(lambda a, b: fn(a, _Y, b, margin=3, scale=0.5), (x, w),
              order=1, modes=["rev"], eps=1e-3, atol=2e-2, rtol=2e-2)


def test_zero_rows_give_finite_gradients():
  x = jnp.asarray(_X, jnp.float32).at[0].set(0.0)
  w = jnp.asarray(_W, jnp.float32).at[1].set(0.0)
  for fn in (losses.large_margin_softmax_loss, losses.sphereface_loss):
    g = jax.grad(lambda a, b, f=fn: f(a, _Y, b), argnums=(0, 1))(x, w)
    assert all(np.isfinite(np.asarray(v)).all() for v in g)


@pytest.mark.parametrize("bad", [0, 2.5, -1, True, "4"])
def test_bad_margin_raises_one_line(bad):
  with pytest.raises(ValueError, match=r"^`margin` .* positive integer"):
    losses.sphereface_loss(_X, _Y, _W, margin=bad)


def test_bad_inputs_raise_clear_errors():
  with pytest.raises(ValueError, match="scale"):
    losses.large_margin_softmax_loss(_X, _Y, _W, scale=0.0)
  with pytest.raises(ValueError, match="dimension"):
    losses.large_margin_softmax_loss(_X, _Y, _W[:, :2])


def test_registry_entries():
  for name, (_, fn) in _PAIRS.items():
    entry = losses.get_loss(name)
    assert entry.fn is fn and entry.kind == "classifier"
    assert entry.shards_classes and entry.supports_axis_name
    assert dict(entry.defaults) == {"margin": 4, "scale": 1.0}
    w = entry.init_params(jax.random.PRNGKey(0), _C, _D)
    assert w.shape == (_C, _D)
