"""GradCache: the chunked train step equals the unchunked one (circle_jax.train.gradcache)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax import parallel
from circle_jax.train import config_checks, gradcache, optim
from circle_jax.train import state as state_lib
from circle_jax.train import step as step_lib
from tests.train import helpers

# Slow (train steps compiled per model or chunking): not in the fast tier.
pytestmark = pytest.mark.slow

NUM_STEPS = 3
GLOBAL_BATCH = 32  # 4 images per device on the 8 simulated devices.
SGD = optim.make_optimizer(name="sgd", learning_rate=0.5, momentum=0.9,
                           lr_multipliers={"loss": 10.0})


def _initial_state(model, entry=helpers.PROXY):
  loss_params = None
  if entry.param_name:
    loss_params = {entry.param_name: jax.random.normal(
        jax.random.PRNGKey(7), (4, model.embedding_dim))}
  return helpers.initial_state(
      model, SGD, jnp.zeros((2, 6, 6, 1)), key=jax.random.PRNGKey(0),
      loss_params=loss_params)


def _run(mode, model, chunk, entry=helpers.PROXY):
  """``NUM_STEPS`` steps; returns the host state and the losses."""
  placement = parallel.get_placement(mode)
  state = _initial_state(model, entry)
  step = step_lib.make_train_step(
      step_lib.make_loss_fn(entry), placement=placement,
      base_key=jax.random.PRNGKey(3), embed_chunk_size=chunk)
  host = parallel.SingleDevice().to_host(state_lib.state_to_tree(state))
  state = state_lib.state_from_tree(state, placement.replicate(host))
  losses = []
  for i in range(NUM_STEPS):
    batch = jax.tree.map(np.asarray, helpers.fake_batch(
        jax.random.PRNGKey(i), batch_size=GLOBAL_BATCH))
    state, metrics = step(state, placement.shard_batch(batch))
    metrics = jax.device_get(placement.first_replica(metrics))
    assert bool(metrics["finite"])
    losses.append(float(metrics["loss"]))
  return placement.to_host(state_lib.state_to_tree(state)), losses


MODELS = {"no_bn": helpers.TinyNet(use_bn=False),
          "frozen_bn": helpers.TinyNet(freeze_bn=True)}


@pytest.mark.parametrize("model, mode, chunk", [
    ("no_bn", "none", 8), ("no_bn", "shard_map", 2),
    ("frozen_bn", "none", 4), ("frozen_bn", "shard_map", 1),
    ("frozen_bn", "pmap", 2)])
def test_chunked_steps_equal_unchunked_steps(mode, chunk, model):
  assert jax.device_count() == 8
  ref, ref_losses = _run(mode, MODELS[model], 0)
  got, losses = _run(mode, MODELS[model], chunk)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  chex.assert_trees_all_close(got, ref, atol=1e-6, rtol=1e-5)
  # The parameters moved (model and proxies), so the comparison means something.
  init = _initial_state(MODELS[model]).params
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
      jax.tree.leaves(got["params"]), jax.tree.leaves(init))]
  assert min(moved) > 1e-3


def test_shard_map_chunked_equals_one_device_unchunked():
  """The loss stays the global-batch loss over axis_name under chunking."""
  ref, ref_losses = _run("none", MODELS["frozen_bn"], 0, helpers.PAIR)
  got, losses = _run("shard_map", MODELS["frozen_bn"], 2, helpers.PAIR)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  chex.assert_trees_all_close(got["params"], ref["params"], atol=2e-5,
                              rtol=1e-4)
  # Frozen BatchNorm statistics are returned bit for bit.
  chex.assert_trees_all_equal(got["batch_stats"], ref["batch_stats"])


def _embed_fn(model):
  return functools.partial(step_lib.embed, model.apply)


def test_training_mode_bn_chunks_are_per_chunk_models():
  """BatchNorm in training mode: the chunked embedding and its gradient are
  those of each chunk embedded as a batch of its own, and the statistics are
  the mean of the chunks' running-average updates; chunks of the whole batch
  are the unchunked step, smaller ones are not (what config_checks refuses
  without batch.embed_chunk_bn='per_chunk')."""
  model = helpers.TinyNet(freeze_bn=False)
  state = _initial_state(model)
  images = helpers.fake_batch(jax.random.PRNGKey(1))["image"]  # 16 images
  weights = jax.random.normal(jax.random.PRNGKey(2), (16, 4))
  embed = _embed_fn(model)

  def per_chunk(params):
    outs = [embed(params, state.batch_stats, images[i:i + 4])
            for i in range(0, 16, 4)]
    emb = jnp.concatenate([o[0] for o in outs])
    stats = jax.tree.map(lambda *s: sum(s) / 4, *[o[1] for o in outs])
    return jnp.sum(weights * emb), stats

  def chunked(params, size):
    emb, stats = gradcache.chunked(embed, size)(params, state.batch_stats,
                                                images)
    return jnp.sum(weights * emb), stats

  params = state.params["model"]
  grad = lambda f: jax.jit(jax.value_and_grad(f, has_aux=True))  # noqa: E731
  (want, want_stats), want_grad = grad(per_chunk)(params)
  (got, got_stats), got_grad = grad(lambda p: chunked(p, 4))(params)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  chex.assert_trees_all_close(got_grad, want_grad, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(got_stats, want_stats, atol=1e-7, rtol=1e-6)
  (whole, _), whole_grad = grad(
      lambda p: (jnp.sum(weights * embed(p, state.batch_stats, images)[0]),
                 None))(params)
  (one, _), one_grad = grad(lambda p: chunked(p, 16))(params)
  np.testing.assert_allclose(one, whole, rtol=1e-6)
  chex.assert_trees_all_close(one_grad, whole_grad, atol=1e-5, rtol=1e-5)
  assert abs(float(got) - float(whole)) > 1e-3


def test_chunked_gradient_is_numerically_right_in_float64():
  """check_grads on a float64 model: tanh(x W + c) with a per-chunk mean."""
  def embed(params, stats, x):
    h = jnp.tanh(x @ params["w"] + params["c"])
    return h - jnp.mean(h, 0), stats  # couples the images of a chunk

  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.PRNGKey(4), (8, 3), jnp.float64)
    weights = jax.random.normal(jax.random.PRNGKey(5), (8, 2), jnp.float64)
    params = {"w": jax.random.normal(jax.random.PRNGKey(6), (3, 2),
                                     jnp.float64),
              "c": jnp.array([0.1, -0.2])}
    f = lambda p: jnp.sum(weights * gradcache.chunked(embed, 2)(  # noqa: E731
        p, {}, x)[0] ** 2)
    check_grads(f, (params,), order=1, modes=["rev"])


def test_indivisible_chunk_fails_at_trace_time_naming_the_field():
  model = helpers.TinyNet(use_bn=False)
  state = _initial_state(model)
  step = step_lib.make_train_step(
      step_lib.make_loss_fn(helpers.PAIR), placement=parallel.SingleDevice(),
      base_key=jax.random.PRNGKey(0), donate=False, embed_chunk_size=5)
  with pytest.raises(ValueError, match=r"16 images .* not divisible by the "
                     r"embedding chunk size 5.*embed_chunk_size"):
    step(state, helpers.fake_batch(jax.random.PRNGKey(0)))
  with pytest.raises(ValueError, match="`chunk_size` must be a positive int"):
    gradcache.chunked(_embed_fn(model), 0)


# The digits job: global batch 5 x 8 = 40, 5 images per device on 8 devices.
@pytest.mark.parametrize("overrides, message", [
    ({"batch.embed_chunk_size": 3}, "config.batch.embed_chunk_size: 3 does not "
     r"divide the per-device batch of 5 images; use one of \[1, 5\]"),
    ({"batch.embed_chunk_size": -1}, "config.batch.embed_chunk_size: must be "
     "an int >= 0"),
    ({"batch.embed_chunk_size": 5}, "config.batch.embed_chunk_size: chunks "
     "change BatchNorm's batch statistics.*model.freeze_bn=True.*"
     "embed_chunk_bn=per_chunk"),
    ({"batch.embed_chunk_bn": "sync"}, "config.batch.embed_chunk_bn: must be "
     "'exact' or 'per_chunk'"),
])
def test_config_errors(overrides, message):
  c = helpers.digits_config(**overrides)
  with pytest.raises(config_checks.ConfigError, match=message) as e:
    config_checks.check_config(c, device_count=8, process_count=1)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides", [
    {"batch.embed_chunk_size": 5, "model.freeze_bn": True},
    {"batch.embed_chunk_size": 1, "batch.embed_chunk_bn": "per_chunk"},
])
def test_config_accepts_frozen_bn_or_the_opt_in(overrides):
  config_checks.check_config(helpers.digits_config(**overrides),
                             device_count=8, process_count=1)


def test_per_chunk_bn_with_sync_bn_normalises_each_global_chunk():
  """``embed_chunk_bn='per_chunk'`` with synchronised BatchNorm under
  shard_map: device d's chunk j is normalised with the statistics of chunk j
  of all 8 devices together. So the embeddings, their gradient and the new
  statistics are those of one device embedding each such global chunk as a
  batch of its own (conv4, BN in training mode)."""
  from circle_jax import models  # pylint: disable=g-import-not-at-top
  n_dev, local, size = 8, 4, 2
  synced = models.get_model("conv4", embedding_dim=4, width=4,
                            bn_axis_name="d")
  plain = models.get_model("conv4", embedding_dim=4, width=4)
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.random((n_dev * local, 8, 8, 1)), jnp.float32)
  weights = jnp.asarray(rng.normal(size=(n_dev * local, 4)), jnp.float32)
  variables = plain.init(jax.random.PRNGKey(0), images[:2], train=False)
  params, stats = variables["params"], variables["batch_stats"]

  # One device: global chunk j = rows [size j, size (j + 1)) of every device.
  order = np.concatenate([np.arange(d * local + size * j,
                                    d * local + size * (j + 1))
                          for j in range(local // size)
                          for d in range(n_dev)])
  chunk = n_dev * size

  def reference(p):
    x = images[order]
    outs = [_embed_fn(plain)(p, stats, x[i:i + chunk])
            for i in range(0, len(order), chunk)]
    emb = jnp.zeros_like(weights).at[order].set(
        jnp.concatenate([o[0] for o in outs]))
    new = jax.tree.map(lambda *s: sum(s) / len(outs), *[o[1] for o in outs])
    return jnp.sum(weights * emb), (emb, new)

  mesh = Mesh(np.array(jax.devices()[:n_dev]), ("d",))

  def on_devices(p):
    def local_fn(p, x, w):
      def total(p):
        emb, new = gradcache.chunked(_embed_fn(synced), size)(p, stats, x)
        return jax.lax.psum(jnp.sum(w * emb), "d"), (emb, new)
      (value, (emb, new)), grad = jax.value_and_grad(total, has_aux=True)(p)
      return value, emb, new, grad
    return jax.jit(jax.shard_map(
        local_fn, mesh=mesh, in_specs=(P(), P("d"), P("d")),
        out_specs=(P(), P("d"), P(), P())))(p, images, weights)

  (want, (want_emb, want_stats)), want_grad = jax.jit(
      jax.value_and_grad(reference, has_aux=True))(params)
  got, got_emb, got_stats, got_grad = on_devices(params)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  chex.assert_trees_all_close(got_emb, want_emb, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(got_stats, want_stats, atol=1e-6, rtol=1e-5)
  # The conv biases before BatchNorm have a zero gradient: float noise there.
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_grad))
  assert scale > 1e-2
  chex.assert_trees_all_close(got_grad, want_grad, atol=1e-4 * scale,
                              rtol=1e-4)
  # Not the unsynchronised per-device chunks, nor the whole batch at once.
  whole = _embed_fn(plain)(params, stats, images)[0]
  assert float(jnp.abs(got_emb - whole).max()) > 1e-3
  alone = _embed_fn(plain)(params, stats, images[:size])[0]  # device 0 only
  assert float(jnp.abs(got_emb[:size] - alone).max()) > 1e-3
