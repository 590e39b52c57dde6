"""Tests of circle_jax/models/layers.py: ceil-mode pooling, global pooling."""

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
  assert layers.global_pool(x.astype(jnp.bfloat16), "avg").dtype == jnp.float32
  with pytest.raises(ValueError, match="pooling"):
    layers.global_pool(x, "gem")
