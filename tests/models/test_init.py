"""Tests of circle_jax/models/__init__.py: get_model, input_spec, BN freezing."""

import functools

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from circle_jax import models
from tests.models import helpers


def test_get_model_rejects_bad_arguments():
  with pytest.raises(ValueError, match="bn_inception, conv4, resnet101"):
    models.get_model("resnet18", embedding_dim=8)
  for bad in (0, -3, 2.0, True):
    with pytest.raises(ValueError, match="embedding_dim"):
      models.get_model("conv4", embedding_dim=bad)
  with pytest.raises(ValueError, match="pooling"):
    models.get_model("conv4", embedding_dim=8, pooling="gem")
  with pytest.raises(TypeError, match="conv4"):
    models.get_model("conv4", embedding_dim=8, depth=3)


def test_top_level_params_are_backbone_and_head_for_every_model():
  for name, hw in (("conv4", 28), ("resnet50", 64), ("bn_inception", 64)):
    shapes = helpers.variable_shapes(
        models.get_model(name, embedding_dim=16), (1, hw, hw, 3))
    assert sorted(shapes["params"]) == ["backbone", "head"], name
    assert sorted(shapes["batch_stats"]) == ["backbone"], name
    assert shapes["params"]["head"]["embedding"]["kernel"].shape[1] == 16


def test_input_spec_hand_computed():
  rgb = np.array([[[[10, 20, 30]]]], np.uint8)
  np.testing.assert_allclose(
      models.input_spec("resnet50").apply(rgb),
      [[[[30 - 103.939, 20 - 116.779, 10 - 123.68]]]], rtol=1e-6)
  np.testing.assert_allclose(
      models.input_spec("bn_inception").apply(rgb),
      [[[[30 - 104.0, 20 - 117.0, 10 - 128.0]]]], rtol=1e-6)
  np.testing.assert_allclose(models.input_spec("conv4").apply(rgb),
                             rgb / 255.0, rtol=1e-6)
  with pytest.raises(ValueError, match="got '1'.*3-channel.*tile grayscale"):
    models.input_spec("resnet50").apply(np.zeros((1, 4, 4, 1)))
  with pytest.raises(ValueError, match="known models"):
    models.input_spec("vgg")


# ---------------------------------------------------------------------------
# BatchNorm freezing on conv4 (the mechanism is architecture independent).
# ---------------------------------------------------------------------------

_X = np.random.default_rng(0).normal(size=(8, 12, 12, 1)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _conv4(freeze_bn):
  model = models.get_model("conv4", embedding_dim=4, freeze_bn=freeze_bn,
                           width=8)
  variables = helpers.random_variables(
      helpers.variable_shapes(model, _X.shape))
  return model, variables


def test_frozen_bn_paths_are_exactly_the_batchnorm_affine_params():
  _, variables = _conv4(True)
  want = {("backbone", f"block{i}_bn", leaf)
          for i in range(1, 5) for leaf in ("scale", "bias")}
  assert models.frozen_bn_paths(variables) == want
  labels = flax.traverse_util.flatten_dict(
      models.param_labels(variables, freeze_bn=True))
  assert {p for p, l in labels.items() if l == "frozen"} == want
  assert labels[("backbone", "block1_conv", "kernel")] == "backbone"
  assert labels[("head", "embedding", "kernel")] == "head"
  labels = models.param_labels(variables, freeze_bn=False)
  assert "frozen" not in jax.tree.leaves(labels)
  with pytest.raises(ValueError, match="batch_stats"):
    models.frozen_bn_paths({"params": variables["params"]})


def _one_update(freeze_bn):
  model, variables = _conv4(freeze_bn)
  tx = optax.multi_transform(
      {"backbone": optax.adamw(1e-2, weight_decay=0.1),
       "head": optax.adamw(1e-1, weight_decay=0.1),
       "frozen": optax.set_to_zero()},
      models.param_labels(variables, freeze_bn=freeze_bn))
  params = variables["params"]

  def loss(params):
    emb, new_state = model.apply(
        {"params": params, "batch_stats": variables["batch_stats"]}, _X,
        train=True, mutable=["batch_stats"])
    return jnp.sum(emb[:4] * emb[4:]), new_state

  @jax.jit
  def step(params):
    grads, new_state = jax.grad(loss, has_aux=True)(params)
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates), new_state

  return (variables,) + step(params)


def _changed(before, after, path):
  return not np.array_equal(
      flax.traverse_util.flatten_dict(before)[path],
      flax.traverse_util.flatten_dict(after)[path])


@pytest.mark.parametrize("freeze_bn", [True, False])
def test_bn_freezing_keeps_stats_and_affine_params(freeze_bn):
  variables, params, new_state = _one_update(freeze_bn)
  bn = ("backbone", "block2_bn")
  for leaf in ("scale", "bias"):
    assert _changed(variables["params"], params, bn + (leaf,)) != freeze_bn
  for leaf in ("mean", "var"):
    assert _changed(variables["batch_stats"], new_state["batch_stats"],
                    bn + (leaf,)) != freeze_bn
  # Everything else trains in both cases.
  assert _changed(variables["params"], params,
                  ("backbone", "block2_conv", "kernel"))
  assert _changed(variables["params"], params, ("head", "embedding", "kernel"))


def _train_and_eval(freeze_bn):
  model, variables = _conv4(freeze_bn)
  return jax.jit(lambda v: (
      model.apply(v, _X, train=True, mutable=["batch_stats"])[0],
      model.apply(v, _X, train=False)))(variables)


def test_frozen_bn_train_mode_equals_eval_mode():
  train, ev = _train_and_eval(True)
  np.testing.assert_allclose(train, ev, rtol=1e-6, atol=1e-7)
  train, ev = _train_and_eval(False)
  assert np.abs(train - ev).max() > 1e-3


def test_sync_bn_over_devices_matches_single_device_batch():
  """With bn_axis_name, 8 devices x 1 image == one device with 8 images."""
  n = jax.device_count()
  assert n == 8, "conftest sets 8 simulated CPU devices"
  _, variables = _conv4(False)
  model = models.get_model("conv4", embedding_dim=4, width=8,
                           bn_axis_name="batch")
  single = models.get_model("conv4", embedding_dim=4, width=8)
  mesh = Mesh(np.array(jax.devices()), ("batch",))

  def per_device(x):
    return model.apply(variables, x, train=True, mutable=["batch_stats"])

  sharded = jax.jit(jax.shard_map(
      per_device, mesh=mesh, in_specs=P("batch"), out_specs=(P("batch"), P()),
      check_vma=False))
  emb, state = sharded(_X)
  want, want_state = single.apply(variables, _X, train=True,
                                  mutable=["batch_stats"])
  np.testing.assert_allclose(emb, want, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(state, want_state, rtol=1e-5, atol=1e-6)
