"""A user's flax.nnx backbone plugs into the model registry and the trainer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from circle_jax import losses, models, parallel
from circle_jax.train import optim, state as state_lib, step as step_lib


class MyNet(nnx.Module):
  """Conv -> BatchNorm -> ReLU, written in NNX."""

  def __init__(self, *, width, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, width, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(width, rngs=rngs)

  def __call__(self, x, *, train: bool):
    return nnx.relu(self.bn(self.conv(x), use_running_average=not train))


class MyVectorNet(nnx.Module):
  """Returns a [B, C] vector (pooled inside)."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.dense = nnx.Linear(8 * 8, 6, rngs=rngs)

  def __call__(self, x, *, train: bool):
    del train
    return self.dense(x.reshape(x.shape[0], -1))


@pytest.fixture
def registry(monkeypatch):
  monkeypatch.setitem(models.MODELS, "my_net", models.nnx_backbone(MyNet))
  monkeypatch.setitem(models.MODELS, "my_vec",
                      models.nnx_backbone(MyVectorNet))


def test_nnx_backbone_trains_a_step_and_updates_its_batch_stats(registry):
  model = models.get_model("my_net", embedding_dim=4, width=8)
  images = jax.random.normal(jax.random.PRNGKey(0), (8, 8, 8, 1))
  variables = model.init(jax.random.PRNGKey(1), images[:1], train=False)
  assert set(variables["params"]["backbone"]["nnx"]) == {"conv", "bn"}
  assert set(variables["batch_stats"]["backbone"]["nnx"]["bn"]) == {
      "mean", "var"}
  # freeze_bn's optimiser side finds NNX BatchNorm parameters too.
  assert ("backbone", "nnx", "bn", "scale") in models.frozen_bn_paths(
      variables)
  tx = optim.make_optimizer(name="adamw", learning_rate=1e-2,
                            weight_decay=0.0)
  state = state_lib.TrainState.create(
      apply_fn=model.apply, params={"model": variables["params"], "loss": {}},
      tx=tx, batch_stats=variables["batch_stats"])
  step = step_lib.make_train_step(
      step_lib.make_loss_fn(losses.get_loss("circle")), placement=parallel.SingleDevice(),
      base_key=jax.random.PRNGKey(2), donate=False)
  batch = {"image": images, "label": jnp.arange(8, dtype=jnp.int32) % 4}
  new, metrics = step(state, batch)
  assert bool(metrics["finite"]) and float(metrics["loss"]) > 0
  for before, after in (
      (state.params["model"]["backbone"], new.params["model"]["backbone"]),
      (state.batch_stats, new.batch_stats)):
    assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 0 for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def test_vector_output_is_a_one_by_one_map_and_eval_is_deterministic(
    registry):
  model = models.get_model("my_vec", embedding_dim=3)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 1))
  variables = model.init(jax.random.PRNGKey(1), x, train=False)
  feats = model.apply(variables, x, train=False, method=model.features)
  assert feats.shape == (2, 1, 1, 6)
  np.testing.assert_array_equal(model.apply(variables, x, train=False),
                                model.apply(variables, x, train=False))
