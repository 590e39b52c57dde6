"""One device, shard_map and pmap train steps agree on the same global batch."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from circle_jax import parallel
from circle_jax.train import optim, state as state_lib, step as step_lib
from tests.train import helpers

NUM_STEPS = 3


def _initial_state(entry, model, tx):
  images = jnp.zeros((2, 6, 6, 1))
  loss_params = None
  if entry.param_name:
    proxies = jax.random.normal(jax.random.PRNGKey(7), (4, model.embedding_dim))
    loss_params = {entry.param_name: proxies}
  return helpers.initial_state(
      model, tx, images, key=jax.random.PRNGKey(0), loss_params=loss_params)


def _batches():
  return [jax.tree.map(np.asarray, helpers.fake_batch(jax.random.PRNGKey(i)))
          for i in range(NUM_STEPS)]


def _run(mode, entry, model, tx, psum_grads=None):
  state = _initial_state(entry, model, tx)
  loss_fn = step_lib.make_loss_fn(entry)
  key = jax.random.PRNGKey(3)
  placement = parallel.get_placement(mode)
  if psum_grads is None:
    step = step_lib.make_train_step(loss_fn, placement=placement, base_key=key)
  else:  # deliberately wrong reduction, to show the comparison can fail.
    from jax.sharding import PartitionSpec as P
    fn = functools.partial(step_lib.train_step, loss_fn=loss_fn, base_key=key,
                           axis_name=parallel.AXIS, psum_grads=psum_grads)
    step = jax.jit(jax.shard_map(fn, mesh=placement.mesh,
                                 in_specs=(P(), P(parallel.AXIS)),
                                 out_specs=(P(), P())))
  host = parallel.SingleDevice().to_host(state_lib.state_to_tree(state))
  state = state_lib.state_from_tree(state, placement.replicate(host))
  losses = []
  for batch in _batches():
    state, metrics = step(state, placement.shard_batch(batch))
    metrics = jax.device_get(placement.first_replica(metrics))
    assert bool(metrics["finite"])
    losses.append(float(metrics["loss"]))
  return placement.to_host(state_lib.state_to_tree(state)), losses


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
  chex.assert_trees_all_close(got["params"], ref["params"], atol=2e-5,
                              rtol=1e-4)
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
  chex.assert_trees_all_close(a, b, atol=2e-5, rtol=1e-4)
  init = _initial_state(helpers.PAIR, model, tx)
  mean_a = a["batch_stats"]["backbone"]["BatchNorm_0"]["mean"]
  assert np.abs(mean_a - init.batch_stats["backbone"]["BatchNorm_0"]["mean"]).max() > 1e-3


def test_nonfinite_loss_is_flagged():
  model = helpers.TinyNet(use_bn=False)
  tx = optax.sgd(0.1)
  entry = helpers.Entry("nan", lambda e, l, p=None, axis_name=None:
                        jnp.sum(e) * jnp.nan)
  state = _initial_state(entry, model, tx)
  one = parallel.SingleDevice()
  step = step_lib.make_train_step(step_lib.make_loss_fn(entry), placement=one,
                                  base_key=jax.random.PRNGKey(0), donate=False)
  _, metrics = step(state, helpers.fake_batch(jax.random.PRNGKey(0)))
  assert not bool(metrics["finite"])
  good = step_lib.make_train_step(step_lib.make_loss_fn(helpers.PAIR),
                                  placement=one, base_key=jax.random.PRNGKey(0),
                                  donate=False)
  _, metrics = good(state, helpers.fake_batch(jax.random.PRNGKey(0)))
  assert bool(metrics["finite"])


@pytest.mark.parametrize("batch, match", [
    ({"image": np.zeros((8, 6, 6)), "label": np.zeros(8, np.int32)},
     r"trailing channel axis"),
    ({"image": np.zeros((8, 6, 6, 1)), "label": np.zeros(6, np.int32)},
     r"\(8, 6, 6, 1\) and \(6,\)"),
    ({"image": np.zeros((8, 6, 6, 1))}, r"'label' \[b\]"),
])
def test_bad_batch_shapes_fail_at_trace_time_naming_the_fix(batch, match):
  state = _initial_state(helpers.PAIR, helpers.TinyNet(use_bn=False),
                         optax.sgd(0.1))
  step = step_lib.make_train_step(step_lib.make_loss_fn(helpers.PAIR),
                                  placement=parallel.SingleDevice(),
                                  base_key=jax.random.PRNGKey(0), donate=False)
  with pytest.raises(ValueError, match=match):
    step(state, batch)


def _frames_from_step_to_rule(monkeypatch):
  """The frames in circle_jax's own files from ``train_step`` to the
  formula (``Circle.logits``) inclusive, recorded in a real train step of
  the registry's Circle loss on a tiny model and batch."""
  import inspect
  import os

  import circle_jax
  from circle_jax import losses
  from circle_jax.losses import circle

  package = os.path.dirname(os.path.abspath(circle_jax.__file__)) + os.sep
  original, stacks = circle.Circle.logits, []

  def logits(self, s):
    stacks.append(inspect.stack(context=0))
    return original(self, s)

  monkeypatch.setattr(circle.Circle, "logits", logits)
  entry = losses.get_loss("circle")
  state = _initial_state(entry, helpers.TinyNet(use_bn=False), optax.sgd(0.1))
  step_lib.train_step(state, helpers.fake_batch(jax.random.PRNGKey(0)),
                      loss_fn=step_lib.make_loss_fn(entry),
                      base_key=jax.random.PRNGKey(0))
  assert stacks, "the step never reached Circle.logits"
  outer = [f for f in stacks[0][1:]]  # caller first ... train_step last
  top = next(i for i, f in enumerate(outer) if f.function == "train_step")
  path = [f"{os.path.relpath(f.filename, package)}:{f.function}"
          for f in outer[:top + 1]
          if os.path.abspath(f.filename).startswith(package)]
  return path[::-1] + ["Circle.logits"]


def test_the_step_reaches_the_formula_in_at_most_six_frames(monkeypatch):
  """Issue 39: the registry entry and its hyperparameters are bound when the
  step is built, so no adapter stands between the step and the loss
  (10 frames before: train_step, objective, make_loss_fn's closure,
  LossEntry.apply, forms' wrapper, the generated form, embedding_loss, an
  engine lambda, dense_per_anchor, Circle.logits)."""
  path = _frames_from_step_to_rule(monkeypatch)
  print(f"{len(path)} frames:", " -> ".join(path))
  assert path[0] == "train/step.py:train_step"
  assert "losses/circle.py:circle_loss" in path
  assert len(path) <= 6, path


def test_the_objective_adds_more_losses_and_regularizers():
  """``LossFn.additions``: the config's regularizers and the weighted terms
  of ``config.more_losses``, each with its own class matrix and
  regularizers."""
  from circle_jax import losses
  x = jax.random.normal(jax.random.PRNGKey(0), (6, 4))
  y = jnp.array([0, 0, 1, 1, 2, 2])
  w = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
  fn = step_lib.make_loss_fn(
      losses.get_loss("circle"),
      {"embedding_regularizer": "lp", "embedding_reg_weight": 0.3},
      more=[("cls", losses.get_loss("normface"), 0.5,
             {"weight_regularizer": "center_invariant"})])
  params = {losses.combine.MORE_LOSSES: {"cls": {"class_weights": w}}}
  got = fn.additions(x, y, params, key=jax.random.PRNGKey(2),
                     axis_name=None)
  want = (0.3 * losses.lp_regularizer(x) + 0.5 * (
      losses.normface_loss(x, y, w)
      + losses.center_invariant_regularizer(w)))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  assert step_lib.make_loss_fn(losses.get_loss("circle")).additions(
      x, y, {}, key=None, axis_name=None) is None


def test_each_loss_sees_its_own_miner_in_the_train_step(monkeypatch):
  """``config.miner`` reaches the main loss (here HDC, a miner of
  losses/pml_miners.py) and a term of ``config.more_losses`` gets its own
  (batch-hard, of losses/miners.py; issue 40 item 7): in a real train step
  the masks each loss receives are its miner's of the embeddings it sees."""
  from circle_jax import config as config_lib, config_facts, losses
  from circle_jax.losses import engine
  seen = {}
  original = engine.embedding_loss

  def spy(rule, embeddings, labels, **options):
    if options.get("pos_mask") is not None:
      jax.debug.callback(
          lambda *a, name=type(rule).__name__: seen.setdefault(
              name, [np.asarray(x) for x in a]),
          embeddings, labels, options["pos_mask"], options["neg_mask"])
    return original(rule, embeddings, labels, **options)

  config = config_lib.base_config()
  config.loss = config_lib.loss_config("circle")
  config.miner.name, config.miner.filter_percentage = "hdc", 0.3
  config.more_losses.con = config_lib.more_loss(
      "contrastive", 0.5, miner={"name": "batch_hard"})
  config.more_losses.plain = config_lib.more_loss("contrastive", 0.1)
  loss_fn = step_lib.make_loss_fn(
      losses.get_loss("circle"), {}, config_facts.more_losses(config),
      config.miner.to_dict(), config_facts.more_loss_miners(config))
  monkeypatch.setattr(engine, "embedding_loss", spy)
  state = _initial_state(losses.get_loss("circle"),
                         helpers.TinyNet(use_bn=False), optax.sgd(0.1))
  step = jax.jit(functools.partial(step_lib.train_step, loss_fn=loss_fn,
                                   base_key=jax.random.PRNGKey(0)))
  _, metrics = step(state, helpers.fake_batch(jax.random.PRNGKey(0)))
  jax.effects_barrier()
  assert bool(metrics["finite"])
  assert set(seen) == {"Circle", "Contrastive"}  # "plain" mines nothing
  for rule, miner in (("Circle", functools.partial(
      losses.hdc_miner, filter_percentage=0.3)),
                      ("Contrastive", losses.batch_hard_miner)):
    x, y, pos, neg = seen[rule]
    want = miner(jnp.asarray(x), jnp.asarray(y))
    np.testing.assert_array_equal(pos, want[0])
    np.testing.assert_array_equal(neg, want[1])
    assert 0 < pos.sum() < (y[:, None] == y[None]).sum() - len(y)
  with pytest.raises(ValueError, match="not terms of"):
    step_lib.make_loss_fn(losses.get_loss("circle"),
                          more_miners={"nope": {"name": "hdc"}})


def test_the_miner_mines_against_the_cross_batch_memory():
  """With references (the cross-batch memory's ``ref``) the step's miner
  mines anchors x references and the loss gets those masks (PML's miners
  with ``ref_emb``); a miner of the batch only says so in one line."""
  from circle_jax import losses
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 4))
  y = jnp.arange(8) % 4
  ref = losses.Candidates(jax.random.normal(jax.random.PRNGKey(1), (6, 4)),
                          jnp.arange(6) % 3)
  fn = step_lib.make_loss_fn(losses.get_loss("contrastive"), {},
                             miner={"name": "pair_margin",
                                    "pos_margin": 1.0})
  got, unmined, want = jax.jit(lambda x, ref: (
      fn(x, y, {}, key=None, axis_name=None, ref=ref),
      losses.contrastive_loss(x, y, ref=ref),
      losses.contrastive_loss(x, y, ref=ref, **dict(zip(
          ("pos_mask", "neg_mask"),
          losses.pair_margin_miner(x, y, ref=ref, pos_margin=1.0))))))(
              x, ref)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  assert float(got) != float(unmined)
  angular = step_lib.make_loss_fn(losses.get_loss("contrastive"), {},
                                  miner={"name": "angular"})
  with pytest.raises(ValueError, match="takes no reference"):
    angular(x, y, {}, key=None, axis_name=None, ref=ref)
