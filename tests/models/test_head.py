"""Tests of circle_jax/models/head.py: pooling + linear + L2 normalisation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.models import head


def _head_vars(kernel, bias):
  return {"params": {"embedding": {"kernel": jnp.asarray(kernel, jnp.float32),
                                   "bias": jnp.asarray(bias, jnp.float32)}}}


def test_head_hand_computed():
  # Feature map with channel means (1, 2) and maxes (2, 4).
  f = np.array([[[[0.0, 0.0], [2.0, 4.0]]]], np.float32)  # [1, 1, 2, 2]
  kernel = np.array([[3.0, 0.0], [0.0, 1.0]])              # z = (3 a, b)
  v = _head_vars(kernel, [0.0, 0.0])
  out = head.EmbeddingHead(2, "avg").apply(v, f)           # mean (1, 2)
  np.testing.assert_allclose(out, [[3 / 13**0.5, 2 / 13**0.5]], rtol=1e-6)
  out = head.EmbeddingHead(2, "avg+max").apply(v, f)       # (3, 6)
  np.testing.assert_allclose(out, [[9 / 117**0.5, 6 / 117**0.5]], rtol=1e-6)


def test_head_zero_embedding_is_finite_with_finite_gradient():
  f = jnp.zeros((2, 3, 3, 4))
  v = _head_vars(np.ones((4, 5)), np.zeros(5))
  m = head.EmbeddingHead(5)
  out = m.apply(v, f)
  np.testing.assert_array_equal(out, 0.0)
  g = jax.grad(lambda v: jnp.sum(m.apply(v, f)))(v)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(g))


def test_head_output_is_float32_unit_norm_for_bf16_features():
  f = jax.random.normal(jax.random.PRNGKey(0), (4, 2, 2, 8)).astype(jnp.bfloat16)
  m = head.EmbeddingHead(3)
  v = jax.jit(m.init)(jax.random.PRNGKey(1), f)
  out = jax.jit(m.apply)(v, f)
  assert out.dtype == jnp.float32 and out.shape == (4, 3)
  np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, rtol=1e-5)
  assert v["params"]["embedding"]["kernel"].dtype == jnp.float32


def test_embedding_init_is_kaiming_fan_out():
  m = head.EmbeddingHead(256)
  k = m.init(jax.random.PRNGKey(0), jnp.zeros((1, 1, 1, 512)))["params"][
      "embedding"]["kernel"]
  # Var = 2 / fan_out = 2 / 256 (Proxy-Anchor's kaiming_normal_(mode='fan_out')).
  np.testing.assert_allclose(np.var(np.asarray(k)), 2 / 256, rtol=0.05)


def test_bad_images_are_clear_errors():
  # The message says what is wrong and names the fix.
  with pytest.raises(ValueError,
                     match=r"shape \(8, 8, 3\).*rank 4.*`images\[None\]`"):
    head._check_images(jnp.zeros((8, 8, 3)))
  with pytest.raises(TypeError, match=r"uint8.*floating.*input_spec"):
    head._check_images(jnp.zeros((1, 8, 8, 3), jnp.uint8))
  head._check_images(jnp.zeros((1, 8, 8, 3), jnp.bfloat16))   # accepted
