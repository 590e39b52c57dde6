"""One device, shard_map and pmap train steps agree on the same global batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from circle_jax.train import optim, state as state_lib, step as step_lib
from tests.train import helpers

NUM_STEPS = 3


def _initial_state(entry, model, tx):
  images = jnp.zeros((2, 6, 6, 1))
  loss_params = None
  if entry.param_name:
    proxies = jax.random.normal(jax.random.PRNGKey(7), (4, model.embedding_dim))
    loss_params = {entry.param_name: proxies}
  return state_lib.create_train_state(
      model, tx, images, key=jax.random.PRNGKey(0), loss_params=loss_params)


def _batches():
  return [jax.tree.map(np.asarray, helpers.fake_batch(jax.random.PRNGKey(i)))
          for i in range(NUM_STEPS)]


def _run(mode, entry, model, tx, psum_grads=None):
  state = _initial_state(entry, model, tx)
  loss_fn = step_lib.make_loss_fn(entry)
  key = jax.random.PRNGKey(3)
  if psum_grads is None:
    step = step_lib.make_train_step(loss_fn, mode=mode, base_key=key)
  else:  # deliberately wrong reduction, to show the comparison can fail.
    from jax.sharding import PartitionSpec as P
    fn = functools.partial(step_lib.train_step, loss_fn=loss_fn, base_key=key,
                           axis_name=step_lib.AXIS, psum_grads=psum_grads)
    step = jax.jit(jax.shard_map(fn, mesh=step_lib.make_mesh(),
                                 in_specs=(P(), P(step_lib.AXIS)),
                                 out_specs=(P(), P())))
  host = step_lib.to_host(state_lib.state_to_tree(state), mode="none")
  state = state_lib.state_from_tree(
      state, step_lib.replicate(host, mode=mode))
  losses = []
  for batch in _batches():
    state, metrics = step(state, step_lib.shard_batch(batch, mode=mode))
    metrics = jax.device_get(step_lib.first_replica(metrics, mode=mode))
    assert bool(metrics["finite"])
    losses.append(float(metrics["loss"]))
  return step_lib.to_host(state_lib.state_to_tree(state), mode=mode), losses


SGD = optim.make_optimizer(name="sgd", learning_rate=0.5, momentum=0.9,
                           lr_multipliers={"loss": 10.0})


@pytest.fixture(scope="module")
def frozen_bn_runs():
  model = helpers.TinyNet(freeze_bn=True)
  return {mode: _run(mode, helpers.PROXY, model, SGD)
          for mode in ("none", "shard_map", "pmap")}


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_parallel_step_equals_single_device(frozen_bn_runs, mode):
  assert jax.device_count() == 8
  ref, ref_losses = frozen_bn_runs["none"]
  got, losses = frozen_bn_runs[mode]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert int(got["step"]) == NUM_STEPS
  for a, b in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(ref["params"])):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
  # The parameters did move (otherwise the comparison above proves nothing).
  init = _initial_state(helpers.PROXY, helpers.TinyNet(freeze_bn=True), SGD)
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
      jax.tree.leaves(got["params"]), jax.tree.leaves(init.params))]
  assert min(moved) > 1e-3


def test_shard_map_param_gradients_are_not_summed_twice(frozen_bn_runs):
  """psum-ing the (already summed) shard_map gradients gives 8x the update."""
  ref, _ = frozen_bn_runs["none"]
  wrong, _ = _run("shard_map", helpers.PROXY, helpers.TinyNet(freeze_bn=True),
                  SGD, psum_grads=True)
  diff = max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
      jax.tree.leaves(wrong["params"]), jax.tree.leaves(ref["params"])))
  assert diff > 1e-2


def test_pair_loss_adam_bn_train_mode_shard_map_equals_pmap():
  """Per-device BatchNorm: both wrappers agree and the statistics stay replicated."""
  model = helpers.TinyNet(freeze_bn=False)
  tx = optim.make_optimizer(name="adam", learning_rate=1e-2)
  a, la = _run("shard_map", helpers.PAIR, model, tx)
  b, lb = _run("pmap", helpers.PAIR, model, tx)
  np.testing.assert_allclose(la, lb, rtol=1e-5)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=2e-5, rtol=1e-4)
  init = _initial_state(helpers.PAIR, model, tx)
  mean_a = a["batch_stats"]["backbone"]["BatchNorm_0"]["mean"]
  assert np.abs(mean_a - init.batch_stats["backbone"]["BatchNorm_0"]["mean"]).max() > 1e-3


def test_nonfinite_loss_is_flagged():
  model = helpers.TinyNet(use_bn=False)
  tx = optax.sgd(0.1)
  entry = helpers.Entry("nan", lambda e, l, p=None, axis_name=None:
                        jnp.sum(e) * jnp.nan)
  state = _initial_state(entry, model, tx)
  step = step_lib.make_train_step(step_lib.make_loss_fn(entry), mode="none",
                                  base_key=jax.random.PRNGKey(0), donate=False)
  _, metrics = step(state, helpers.fake_batch(jax.random.PRNGKey(0)))
  assert not bool(metrics["finite"])
  good = step_lib.make_train_step(step_lib.make_loss_fn(helpers.PAIR),
                                  mode="none", base_key=jax.random.PRNGKey(0),
                                  donate=False)
  _, metrics = good(state, helpers.fake_batch(jax.random.PRNGKey(0)))
  assert bool(metrics["finite"])


def test_unknown_mode_is_an_error():
  with pytest.raises(ValueError, match="parallelism"):
    step_lib.make_train_step(step_lib.make_loss_fn(helpers.PAIR), mode="dp",
                             base_key=jax.random.PRNGKey(0))
