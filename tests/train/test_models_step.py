"""One train step on fake data for each model of circle_jax.models."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses, models, parallel
from circle_jax.train import optim, state as state_lib, step as step_lib

# Slow (train steps compiled per model or chunking): not in the fast tier.
pytestmark = pytest.mark.slow


# Compiling a ResNet-50 / BN-Inception train step takes minutes on a 2-core
# CPU: the default suite runs conv4 and a 1-block-per-stage ResNet (the same
# bottleneck, stem and head code); CIRCLE_JAX_SLOW_TESTS=1 adds the full ones.
SLOW = pytest.mark.skipif(not os.environ.get("CIRCLE_JAX_SLOW_TESTS"),
                          reason="set CIRCLE_JAX_SLOW_TESTS=1")


def _model(name, freeze_bn):
  if name == "resnet_tiny":
    return models.EmbeddingModel(
        backbone=models.ResNet(stage_sizes=(1, 1, 1, 1), freeze_bn=freeze_bn),
        embedding_dim=8, pooling="avg+max", freeze_bn=freeze_bn)
  return models.get_model(name, embedding_dim=8, freeze_bn=freeze_bn)


@pytest.mark.parametrize("name, size, channels", [
    ("conv4", 28, 1), ("resnet_tiny", 32, 3),
    pytest.param("resnet50", 32, 3, marks=SLOW),
    pytest.param("bn_inception", 64, 3, marks=SLOW)])
def test_one_train_step(name, size, channels):
  model = _model(name, freeze_bn=name != "conv4")
  entry = losses.get_loss("circle")
  images = jax.random.normal(jax.random.PRNGKey(0), (8, size, size, channels))
  variables = model.init(jax.random.PRNGKey(1), images[:1], train=False)
  frozen = models.frozen_bn_paths(variables) if name != "conv4" else ()
  tx = optim.make_optimizer(name="adamw", learning_rate=1e-3,
                            weight_decay=1e-4, frozen_paths=frozen)
  state = state_lib.TrainState.create(
      apply_fn=model.apply, params={"model": variables["params"], "loss": {}},
      tx=tx, batch_stats=variables["batch_stats"])
  step = step_lib.make_train_step(step_lib.make_loss_fn(entry),
                                  placement=parallel.SingleDevice(),
                                  base_key=jax.random.PRNGKey(2), donate=False)
  batch = {"image": images, "label": jnp.arange(8, dtype=jnp.int32) % 4}
  new, metrics = step(state, batch)
  assert bool(metrics["finite"]) and float(metrics["loss"]) > 0
  assert int(new.step) == 1
  head_before = state.params["model"]["head"]
  head_after = new.params["model"]["head"]
  assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0 for a, b in zip(
      jax.tree.leaves(head_before), jax.tree.leaves(head_after)))
  flat_old = dict(jax.tree_util.tree_flatten_with_path(state.params["model"])[0])
  flat_new = dict(jax.tree_util.tree_flatten_with_path(new.params["model"])[0])
  for path, old in flat_old.items():
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    if keys in frozen:  # frozen BatchNorm: affine params and stats unchanged.
      np.testing.assert_array_equal(flat_new[path], old)
  if name == "conv4":  # train-mode BN updates the running statistics.
    assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0 for a, b in zip(
        jax.tree.leaves(state.batch_stats), jax.tree.leaves(new.batch_stats)))
  else:
    for a, b in zip(jax.tree.leaves(state.batch_stats),
                    jax.tree.leaves(new.batch_stats)):
      np.testing.assert_array_equal(a, b)
