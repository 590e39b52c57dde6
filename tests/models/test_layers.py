"""Tests of circle_jax/models/layers.py: ceil-mode and disjoint max pooling,
global pooling."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.models import layers


def _torch_ceil_out(size, k, s, p):
  # PyTorch's pooling_output_shape, written independently of the module.
  out = int(np.ceil((size + 2 * p - k) / s)) + 1
  if (out - 1) * s >= size + p:
    out -= 1
  return out


def _naive_max_pool_ceil(x, k, s, p):
  """Per-window loops over a float64 [H, W] map; padding never wins."""
  h, w = x.shape
  oh, ow = _torch_ceil_out(h, k, s, p), _torch_ceil_out(w, k, s, p)
  out = np.empty((oh, ow))
  for i in range(oh):
    for j in range(ow):
      r0, c0 = i * s - p, j * s - p
      rows = [r for r in range(r0, r0 + k) if 0 <= r < h]
      cols = [c for c in range(c0, c0 + k) if 0 <= c < w]
      out[i, j] = max(x[r, c] for r in rows for c in cols)
  return out


@pytest.mark.parametrize("size,k,s,p,want", [
    (112, 3, 2, 0, 56),   # BN-Inception pool1 at 224 (floor would give 55)
    (28, 3, 2, 0, 14),    # inception_3c pool
    (6, 2, 3, 0, 2),      # last window would start in the padding: 3 -> 2
    (5, 2, 3, 1, 2),      # same with padding
    (7, 3, 1, 1, 7),      # inception_5b 3x3/1 pool keeps the size
])
def test_ceil_pool_size_hand_computed(size, k, s, p, want):
  assert layers.ceil_pool_size(size, k, s, p) == want


def test_max_pool_ceil_matches_naive_reference():
  rng = np.random.default_rng(0)
  # Even/odd sizes, strides below/at/above the window, with and without
  # padding, including cases where the last window is dropped (6, 2, 3, 0).
  for h, w, k, s, p in ((5, 4, 3, 2, 0), (6, 9, 2, 3, 0), (7, 9, 3, 2, 1),
                        (5, 9, 2, 3, 1), (6, 4, 3, 1, 1), (7, 4, 2, 1, 0)):
    x = rng.normal(size=(h, w)) - 5.0   # negative: zero padding would win
    got = np.asarray(layers.max_pool_ceil(
        jnp.asarray(x[None, :, :, None], jnp.float32), k, s, p))[0, :, :, 0]
    want = _naive_max_pool_ceil(x, k, s, p)
    assert got.shape == want.shape, (h, w, k, s, p)
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=str((h, w, k, s, p)))


def test_max_pool_ceil_matches_torch_when_available():
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 3, 11, 8)).astype(np.float32)
  for k, s, p in ((3, 2, 0), (3, 1, 1), (2, 3, 1), (3, 2, 1)):
    want = torch.nn.functional.max_pool2d(
        torch.from_numpy(x), k, s, p, ceil_mode=True).numpy()
    got = np.asarray(layers.max_pool_ceil(x.transpose(0, 2, 3, 1), k, s, p))
    np.testing.assert_array_equal(got.transpose(0, 3, 1, 2), want)


def test_pool_window_larger_than_input_is_a_clear_error():
  with pytest.raises(ValueError, match="larger input"):
    layers.max_pool_ceil(jnp.zeros((1, 2, 2, 1)), 3, 2)


def test_global_pool_hand_computed():
  x = np.zeros((1, 2, 2, 2), np.float32)
  x[0, :, :, 0] = [[1, 2], [3, 6]]
  x[0, :, :, 1] = [[-1, -1], [-1, -5]]
  np.testing.assert_allclose(layers.global_pool(x, "avg"), [[3.0, -2.0]])
  np.testing.assert_allclose(layers.global_pool(x, "max"), [[6.0, -1.0]])
  np.testing.assert_allclose(layers.global_pool(x, "avg+max"), [[9.0, -3.0]])
  # Row-major positions, channels innermost: (0,0), (0,1), (1,0), (1,1).
  np.testing.assert_allclose(layers.global_pool(x, "flatten"),
                             [[1, -1, 2, -1, 3, -1, 6, -5]])
  assert layers.global_pool(x.astype(jnp.bfloat16), "avg").dtype == jnp.float32
  with pytest.raises(ValueError, match="pooling"):
    layers.global_pool(x, "gem")


def _naive_disjoint_pool(x, k, padding):
  """Per-window loops over a float64 [H, W] map, and the gradient cell.

  Returns the pooled map and, per output cell, the (row, col) that gets its
  gradient: the first maximal cell in row-major window order (padding never
  wins). 'SAME' pads ceil(H/k)*k - H cells, the smaller half before.
  """
  h, w = x.shape
  if padding == "VALID":
    oh, ow, top, left = h // k, w // k, 0, 0
  else:
    oh, ow = -(-h // k), -(-w // k)
    top, left = (oh * k - h) // 2, (ow * k - w) // 2
  out = np.empty((oh, ow))
  arg = {}
  for i in range(oh):
    for j in range(ow):
      best = None
      for r in range(i * k - top, i * k - top + k):
        for c in range(j * k - left, j * k - left + k):
          if 0 <= r < h and 0 <= c < w and (best is None or x[r, c] > best[0]):
            best = (x[r, c], r, c)
      out[i, j], arg[i, j] = best[0], best[1:]
  return out, arg


_SLOW = pytest.mark.slow  # the fast tier keeps one case of each kind


@pytest.mark.parametrize("h,w,k,padding", [
    (28, 28, 2, "VALID"), pytest.param(7, 7, 2, "VALID", marks=_SLOW),
    (7, 9, 2, "SAME"), pytest.param(8, 8, 2, "SAME", marks=_SLOW),
    pytest.param(3, 3, 2, "SAME", marks=_SLOW),
    pytest.param(1, 1, 2, "SAME", marks=_SLOW),
    pytest.param(10, 11, 3, "SAME", marks=_SLOW), (10, 11, 3, "VALID")])
def test_max_pool_disjoint_values_and_gradients(h, w, k, padding):
  rng = np.random.default_rng(h * 100 + w * 10 + k)
  # Few distinct values: many ties, including windows of equal cells.
  x = rng.integers(-1, 2, size=(h, w)).astype(np.float64)
  want, arg = _naive_disjoint_pool(x, k, padding)
  x4 = jnp.asarray(x[None, :, :, None], jnp.float32)
  got = layers.max_pool_disjoint(x4, k, padding)
  np.testing.assert_array_equal(np.asarray(got)[0, :, :, 0], want)
  ct = rng.normal(size=want.shape)
  grad = jax.vjp(lambda v: layers.max_pool_disjoint(v, k, padding), x4)[1](
      jnp.asarray(ct[None, :, :, None], jnp.float32))[0]
  want_grad = np.zeros_like(x)
  for (i, j), (r, c) in arg.items():
    want_grad[r, c] += ct[i, j]
  np.testing.assert_allclose(np.asarray(grad)[0, :, :, 0], want_grad,
                             rtol=1e-6)


def test_max_pool_disjoint_equals_flax_max_pool_bitwise():
  """The drop-in claim: nn.max_pool's values and gradients, jit and vmap."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(np.maximum(rng.normal(size=(3, 2, 9, 7, 5)), 0.0),
                  jnp.float32)      # after a ReLU: windows of tied zeros
  for padding in ("SAME", "VALID"):
    ours = jax.jit(jax.vmap(
        lambda v: layers.max_pool_disjoint(v, 2, padding)))
    flax = jax.jit(jax.vmap(lambda v: nn.max_pool(
        v, (2, 2), strides=(2, 2), padding=padding)))
    np.testing.assert_array_equal(ours(x), flax(x))
    g = lambda f: jax.grad(lambda v: jnp.sum(jnp.sin(f(v))))(x)
    np.testing.assert_array_equal(g(ours), g(flax))
  y = layers.max_pool_disjoint(x[0].astype(jnp.bfloat16), 2, "SAME")
  assert y.dtype == jnp.bfloat16


def test_max_pool_disjoint_bad_input():
  with pytest.raises(ValueError, match=r"\[B, H, W, C\]"):
    layers.max_pool_disjoint(jnp.zeros((4, 4, 1)), 2)
  with pytest.raises(ValueError, match="padding must be"):
    layers.max_pool_disjoint(jnp.zeros((1, 4, 4, 1)), 2, "FULL")
  with pytest.raises(ValueError, match="at least 2x2"):
    layers.max_pool_disjoint(jnp.zeros((1, 1, 4, 1)), 2, "VALID")
