"""Tests of circle_jax/models/bn_inception.py (PyTorch parity: test_convert.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import models
from circle_jax.models import bn_inception
from tests.models import helpers

# Slow (compared with the reference framework): not in the fast tier.
pytestmark = pytest.mark.slow


def test_block_channels_chain():
  """Each block's output width is the next block's input width (Cadene)."""
  shapes = helpers.variable_shapes(models.BNInception(), (1, 64, 64, 3))
  p = shapes["params"]
  cin = 192
  for key, spec in bn_inception.INCEPTION_BLOCKS.items():
    assert p[f"inception_{key}_3x3_reduce"]["kernel"].shape[2] == cin, key
    cin = (spec.c1x1 + spec.c3x3 + spec.cdouble
           + (spec.pool_proj if spec.pool_proj else cin))
  assert cin == 1024
  assert p["inception_4d_1x1"]["kernel"].shape == (1, 1, 608, 96)
  assert p["inception_5a_1x1"]["kernel"].shape == (1, 1, 1056, 352)


def test_forward_train_and_eval():
  model = models.get_model("bn_inception", embedding_dim=8)
  x = np.random.default_rng(0).uniform(-1, 1, (2, 64, 64, 3)).astype(
      np.float32)
  variables = helpers.random_variables(helpers.variable_shapes(model, x.shape))
  head = models.EmbeddingHead(8)

  @jax.jit
  def run(variables, x):
    train, state = model.apply(variables, x, train=True,
                               mutable=["batch_stats"])
    feats = model.apply(variables, x, train=False, method="features")
    return train, state, head.apply(
        {"params": variables["params"]["head"]}, feats), feats

  train, state, ev, feats = run(variables, x)
  assert feats.shape == (2, 2, 2, 1024)
  for e in (train, ev):
    assert e.shape == (2, 8) and e.dtype == jnp.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
  assert np.abs(train - ev).max() > 1e-3
  assert not np.allclose(
      state["batch_stats"]["backbone"]["inception_5b_1x1_bn"]["mean"],
      variables["batch_stats"]["backbone"]["inception_5b_1x1_bn"]["mean"])


@pytest.mark.parametrize("hw,ok", [(224, True), (227, True), (96, True),
                                   (80, False)])
def test_input_sizes(hw, ok):
  """3c/4e concatenate a stride-2 conv with a ceil-mode pool (see docstring)."""
  def trace():
    return helpers.variable_shapes(models.BNInception(), (1, hw, hw, 3))
  if ok:
    trace()
  else:
    with pytest.raises(ValueError, match="multiples of 32"):
      trace()


@pytest.mark.parametrize("hw", list(range(16, 130, 3)) + [224, 227, 229])
def test_input_problem_says_exactly_which_sizes_trace(hw):
  """The check made before anything is built agrees with tracing."""
  model = models.BNInception()
  problem = model.input_problem(hw, hw)
  try:
    helpers.variable_shapes(model, (1, hw, hw, 3))
  except ValueError:
    assert "multiples of 32, at least 64" in problem
  else:
    assert problem == ""
