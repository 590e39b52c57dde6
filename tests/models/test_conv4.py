"""Tests of circle_jax/models/conv4.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import models
from circle_jax.models import conv4
from tests.models import helpers


@pytest.mark.parametrize("hw,padding,out_hw", [
    (28, "VALID", 1),   # Omniglot 28x28 -> 1x1x64, as Prototypical Networks
    (28, "SAME", 2),    # 28 -> 14 -> 7 -> 4 -> 2
    (8, "SAME", 1),     # scikit-learn digits 8 -> 4 -> 2 -> 1 -> 1
])
def test_feature_map_shapes(hw, padding, out_hw):
  shapes = jax.eval_shape(
      lambda: conv4.Conv4(pool_padding=padding).init_with_output(
          jax.random.PRNGKey(0), jnp.zeros((2, hw, hw, 1)), train=False))
  assert shapes[0].shape == (2, out_hw, out_hw, 64)


def test_too_small_for_valid_pooling_is_a_clear_error():
  with pytest.raises(ValueError, match="pool_padding='SAME'"):
    jax.eval_shape(lambda: conv4.Conv4(pool_padding="VALID").init(
        jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)), train=False))
  with pytest.raises(ValueError, match="pool_padding"):
    jax.eval_shape(lambda: conv4.Conv4(pool_padding="same").init(
        jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)), train=False))


def test_forward_train_and_eval_on_digits_sized_images():
  model = models.get_model("conv4", embedding_dim=8)
  x = np.random.default_rng(0).uniform(size=(6, 8, 8, 1)).astype(np.float32)
  variables = helpers.random_variables(helpers.variable_shapes(model, x.shape))
  assert variables["params"]["backbone"]["block1_conv"]["kernel"].shape == (
      3, 3, 1, 64)

  @jax.jit
  def run(variables, x):
    emb, state = model.apply(variables, x, train=True, mutable=["batch_stats"])
    return emb, state, model.apply(variables, x, train=False)

  emb, state, ev = run(variables, x)
  for e in (emb, ev):
    assert e.shape == (6, 8) and e.dtype == jnp.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
  # Train mode normalises with batch statistics and updates the running ones.
  assert not np.allclose(emb, ev)
  assert not np.allclose(state["batch_stats"]["backbone"]["block1_bn"]["mean"],
                         variables["batch_stats"]["backbone"]["block1_bn"]["mean"])


def test_bfloat16_compute_keeps_float32_params_and_output():
  model = models.get_model("conv4", embedding_dim=8, dtype=jnp.bfloat16)
  model32 = models.get_model("conv4", embedding_dim=8)
  x = np.random.default_rng(1).uniform(size=(4, 8, 8, 3)).astype(np.float32)
  variables = helpers.random_variables(helpers.variable_shapes(model, x.shape))
  assert all(v.dtype == np.float32 for v in jax.tree.leaves(variables))
  out, out32 = jax.jit(lambda v, x: (model.apply(v, x, train=False),
                                     model32.apply(v, x, train=False)))(
                                         variables, x)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, out32, atol=0.05)
