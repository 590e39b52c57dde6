"""bfloat16 embeddings at the papers' scales (gamma=256, beta=50, alpha=32).

The peer library shrinks these scales in its half-precision tests; we don't.
The losses cast bfloat16 embeddings to float32 and compute everything in
float32, so:

1. on the *same* (bf16-rounded) inputs, bf16 and float32 embeddings give the
   same loss, and the bf16 gradient is the float32 gradient rounded to bf16;
2. against the original float32 embeddings, the only difference is the input
   rounding (relative 2^-9 per coordinate). Stated tolerance, from the
   measured spread over three clusterings of the data (worst 6e-3 for both):
   loss within ``1e-2 * |L| + 1e-4``, gradient relative L2 error below
   ``2e-2`` (cosine to the float32 gradient above 0.999);
3. a loss computed *in* bfloat16 (a naive Circle loss, the negative control)
   misses that tolerance at gamma=256, so the tolerance can tell the two apart.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import circle_jax.losses as L

B, D, C = 32, 64, 8
VALUE_RTOL, VALUE_ATOL = 1e-2, 1e-4
GRAD_REL_L2 = 2e-2


def _data(noise):
  rng = np.random.default_rng(0)
  labels = np.arange(B) % C
  centers = rng.normal(size=(C, D))
  x = (centers[labels] + noise * rng.normal(size=(B, D))).astype(np.float32)
  w = rng.normal(size=(C, D)).astype(np.float32)
  return x, labels, w


# name -> loss(embeddings, labels, class_vectors) at the papers' scales. (The
# blockwise losses equal the dense ones, see test_blockwise.py.)
LOSSES = {
    "circle": lambda e, y, w: L.circle_loss(e, y, gamma=256.0, margin=0.25),
    "circle_class_level": lambda e, y, w: L.circle_loss_class_level(
        e, y, w, gamma=256.0, margin=0.25),
    "multi_similarity": lambda e, y, w: L.multi_similarity_loss(
        e, y, alpha=2.0, beta=50.0, base=0.5),
    "proxy_anchor": lambda e, y, w: L.proxy_anchor_loss(
        e, y, w, alpha=32.0, margin=0.1),
    "ranked_list": lambda e, y, w: L.ranked_list_loss(e, y, t_neg=10.0),
    "ranked_proxy_anchor": lambda e, y, w: L.ranked_proxy_anchor_loss(
        e, y, w, t_neg=20.0),
}


@functools.lru_cache(maxsize=None)
def _both(name):
  """One compilation per loss: value and grad for bf16 and float32 inputs."""
  vg = jax.value_and_grad(LOSSES[name])
  return jax.jit(lambda x16, x32, y, w: (vg(x16, y, w), vg(x32, y, w)))


def _call(name, x16, x32, labels, w):
  """``((v16, g16), (v32, g32))`` as float64 numpy, checking g16's dtype."""
  try:
    (v16, g16), (v32, g32) = _both(name)(x16, x32, labels, w)
  except NotImplementedError:
    pytest.skip(f"{name} is not implemented yet")
  assert g16.dtype == jnp.bfloat16 and v16.dtype == jnp.float32
  return ((float(v16), np.asarray(g16, np.float64)),
          (float(v32), np.asarray(g32, np.float64)))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_bf16_is_float32_compute_on_the_rounded_inputs(name):
  x, labels, w = _data(noise=1.0)
  x16 = jnp.asarray(x, jnp.bfloat16)
  (v16, g16), (v32, g32) = _call(name, x16, x16.astype(jnp.float32), labels, w)
  assert np.isfinite(v16) and np.all(np.isfinite(g16))
  np.testing.assert_allclose(v16, v32, rtol=1e-6, atol=1e-7)
  # bf16 keeps 8 significant bits: the rounding error is <= 2^-9 relative.
  np.testing.assert_allclose(g16, g32, rtol=2**-8, atol=1e-30)


@pytest.mark.parametrize("noise", [1.0, 3.0])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_bf16_embeddings_stay_close_to_float32(name, noise):
  x, labels, w = _data(noise)
  (v16, g16), (v32, g32) = _call(name, jnp.asarray(x, jnp.bfloat16),
                                 jnp.asarray(x), labels, w)
  assert np.isfinite(v16) and np.all(np.isfinite(g16))
  assert v32 != 0.0 and np.any(g32 != 0.0)  # a non-trivial case
  np.testing.assert_allclose(v16, v32, rtol=VALUE_RTOL, atol=VALUE_ATOL)
  rel = np.linalg.norm(g16 - g32) / np.linalg.norm(g32)
  assert rel < GRAD_REL_L2, rel


def _naive_bf16_circle(e, y, gamma=256.0, m=0.25):
  """Circle loss computed in bfloat16 throughout (what we must not do)."""
  z = e / jnp.linalg.norm(e, axis=1, keepdims=True)
  s = z @ z.T
  same = y[:, None] == y[None, :]
  pos = same & ~jnp.eye(len(y), dtype=bool)
  neg = ~same
  lp = -gamma * jax.nn.relu(1 + m - s) * (s - (1 - m))
  ln = gamma * jax.nn.relu(s + m) * (s - m)
  lse = lambda v, k: jax.nn.logsumexp(jnp.where(k, v, -jnp.inf), axis=1)
  return jnp.mean(jax.nn.softplus(lse(lp, pos) + lse(ln, neg)))


def test_negative_control_bf16_compute_misses_the_tolerance():
  x, labels, w = _data(noise=1.0)
  x16 = jnp.asarray(x, jnp.bfloat16)
  _, (v32, g32) = _call("circle", x16, jnp.asarray(x), labels, w)
  v, g = jax.jit(jax.value_and_grad(_naive_bf16_circle))(x16,
                                                         jnp.asarray(labels))
  g = np.asarray(g, np.float64)
  value_ok = abs(float(v) - v32) <= VALUE_ATOL + VALUE_RTOL * abs(v32)
  grad_ok = np.linalg.norm(g - g32) / np.linalg.norm(g32) < GRAD_REL_L2
  assert not (value_ok and grad_ok)


@pytest.mark.parametrize("name", ["circle", "multi_similarity", "proxy_anchor",
                                  "circle_class_level"])
def test_bf16_paper_scales_degenerate_inputs_are_finite(name):
  _, labels, w = _data(noise=1.0)
  for x in (np.zeros((B, D)), np.ones((B, D)), np.full((B, D), 1e30)):
    (v, g), _ = _call(name, jnp.asarray(x, jnp.bfloat16),
                      jnp.asarray(x, jnp.float32), labels, w)
    assert np.isfinite(v) and np.all(np.isfinite(g)), name
