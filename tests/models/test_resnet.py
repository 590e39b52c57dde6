"""Tests of circle_jax/models/resnet.py (Keras parity is in test_convert.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import models
from tests.models import helpers


def test_resnet50_size_matches_keras():
  shapes = helpers.variable_shapes(models.ResNet(), (1, 64, 64, 3))
  n = sum(v.size for v in jax.tree.leaves(shapes))
  # keras.applications.ResNet50(include_top=False).count_params(), including
  # the BatchNorm moving statistics.
  assert n == 23_587_712
  for depth, blocks in ((50, 16), (101, 33), (152, 50)):
    stages = models.STAGE_SIZES[f"resnet{depth}"]
    assert sum(stages) == blocks and 3 * blocks + 2 == depth


@pytest.mark.slow
def test_resnet50_forward_train_and_eval():
  model = models.get_model("resnet50", embedding_dim=16, pooling="avg+max")
  x = np.random.default_rng(0).uniform(-1, 1, (2, 64, 64, 3)).astype(
      np.float32)
  variables = helpers.random_variables(helpers.variable_shapes(model, x.shape))

  bound_head = models.EmbeddingHead(16, "avg+max")
  @jax.jit
  def run(variables, x):
    train, state = model.apply(variables, x, train=True,
                               mutable=["batch_stats"])
    feats = model.apply(variables, x, train=False, method="features")
    ev = bound_head.apply({"params": variables["params"]["head"]}, feats)
    return train, state, ev, feats

  train, state, ev, feats = run(variables, x)
  assert feats.shape == (2, 2, 2, 2048)
  for e in (train, ev):
    assert e.shape == (2, 16) and e.dtype == jnp.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
  assert np.abs(train - ev).max() > 1e-3
  before = variables["batch_stats"]["backbone"]["conv5_block3"]["bn_3"]
  after = state["batch_stats"]["backbone"]["conv5_block3"]["bn_3"]
  assert not np.allclose(after["mean"], before["mean"])
