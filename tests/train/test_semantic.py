"""VPTSP-G's semantic proxies in the train step (circle_jax/train/semantic.py):
one step against a hand-run reference, 8 devices against one, refusals."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import config as config_lib
from circle_jax import models
from circle_jax import parallel
from circle_jax.losses import vptsp
from circle_jax.models import semantic_proxies
from circle_jax.models import vit_prompts
from circle_jax.train import config_checks
from circle_jax.train import optim
from circle_jax.train import semantic
from circle_jax.train import state as state_lib
from circle_jax.train import step as step_lib
from circle_jax import losses

C, E, K = 8, 4, 2
VIT = dict(depth=1, width=8, num_heads=2, patch_size=4, image_size=8,
           num_prompts=2, prompt_depth=1)
TX = optim.make_optimizer(name="sgd", learning_rate=0.05, momentum=0.9,
                          lr_multipliers={"loss": 10.0})


def _parts():
  model = models.get_model("vit_ti16", embedding_dim=E, **VIT)
  net = semantic_proxies.SemanticProxyNet(num_classes=C, width=8,
                                          embedding_dim=E, num_prompts=2,
                                          prompt_depth=1)
  hook = semantic.SemanticHook(net, k=K)
  variables = jax.jit(functools.partial(model.init, train=False))(
      jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)))
  net_params, memory = jax.jit(hook.init)(jax.random.PRNGKey(1))
  proxies = vptsp.code_proxy_init(jax.random.PRNGKey(2), C, E)
  state = state_lib.TrainState.create(
      apply_fn=model.apply, tx=TX, loss_state=memory,
      params={"model": variables["params"],
              "loss": {"proxies": proxies, semantic.PARAMS: net_params}})
  loss_fn = step_lib.make_loss_fn(losses.get_loss("vptsp_proxy_anchor"),
                                  extra=hook)
  return model, state, loss_fn


def _batch(i):
  key = jax.random.PRNGKey(10 + i)
  labels = np.repeat(np.asarray(jax.random.permutation(key, C)), K)
  images = np.asarray(jax.random.normal(key, (C * K, 8, 8, 1)))
  return {"image": images, "label": labels.astype(np.int32)}


def _reference_loss(model, params, memory, batch):
  """The step's objective written out: the ViT with class prompts, the
  proxy head, the GRU (ReLU candidate) by hand, the rho-mixed Proxy-Anchor."""
  images, labels = batch["image"], batch["label"]
  emb = model.apply({"params": params["model"]}, images, train=True)
  sem = params["loss"][semantic.PARAMS]
  cls = model.apply({"params": params["model"]}, images, train=True,
                    prompt_tokens=[sem["prompts_0"][labels]],
                    method="features")[:, 0, 0]
  mu = cls.mean(-1, keepdims=True)
  var = ((cls - mu) ** 2).mean(-1, keepdims=True)
  x = ((cls - mu) / jnp.sqrt(var + vit_prompts.HEAD_NORM_EPS)
       * sem["head_norm"]["scale"] + sem["head_norm"]["bias"])
  p = x @ sem["head"]["kernel"] + sem["head"]["bias"]
  p = p / jnp.linalg.norm(p, axis=-1, keepdims=True)
  sig = jax.nn.sigmoid
  rows = []
  for run in range(C):
    c = labels[run * K]
    h = memory[c]
    for i in range(K):
      xi = p[run * K + i]
      z = sig(xi @ sem["W_iz"] + h @ sem["W_hz"] + sem["b_iz"])
      r = sig(xi @ sem["W_ir"] + h @ sem["W_hr"] + sem["b_ir"])
      n = jax.nn.relu(xi @ sem["W_in"] + r * (h @ sem["W_hn"]) + sem["b_in"])
      h = (1 - z) * n + z * h
    rows.append((c, h))
  new = memory
  for c, h in rows:
    new = new.at[c].set(h)
  new = new / jnp.linalg.norm(new, axis=-1, keepdims=True)
  loss = vptsp.vptsp_proxy_anchor_loss(emb, labels, params["loss"]["proxies"],
                                       new)
  return loss, jax.lax.stop_gradient(new)


@pytest.mark.slow  # a ViT step: CI, not the fast tier
def test_one_step_equals_the_hand_run_step():
  model, state, loss_fn = _parts()
  batch = _batch(0)
  new, metrics = jax.jit(lambda s, b: step_lib.train_step(
      s, b, loss_fn=loss_fn, base_key=jax.random.PRNGKey(3)))(state, batch)
  (loss, memory), grads = jax.jit(jax.value_and_grad(
      lambda p: _reference_loss(model, p, state.loss_state, batch),
      has_aux=True))(state.params)
  expected = state.apply_gradients(grads=grads)
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
  chex.assert_trees_all_close(new.params, expected.params, atol=2e-5,
                              rtol=1e-5)
  np.testing.assert_allclose(new.loss_state, memory, atol=1e-6)
  # The memory's rows of the batch's classes moved (all 8 here), and the
  # semantic branch and the ViT got gradients through them.
  assert np.all(np.abs(new.loss_state - state.loss_state).max(-1) > 1e-4)
  sem = grads["loss"][semantic.PARAMS]
  assert np.abs(sem["prompts_0"]).max() > 0 and np.abs(sem["W_hz"]).max() > 0
  # The checkpoint tree carries the memory, and puts it back.
  tree = state_lib.state_to_tree(new)
  back = state_lib.state_from_tree(state, tree)
  np.testing.assert_array_equal(back.loss_state, new.loss_state)


@pytest.mark.slow  # a ViT step: CI, not the fast tier
def test_eight_devices_equal_one_device():
  assert jax.device_count() == 8
  out = {}
  for mode in ("none", "shard_map", "pmap"):
    _, state, loss_fn = _parts()
    placement = parallel.get_placement(mode)
    step = step_lib.make_train_step(loss_fn, placement=placement,
                                    base_key=jax.random.PRNGKey(3))
    host = parallel.SingleDevice().to_host(state_lib.state_to_tree(state))
    state = state_lib.state_from_tree(state, placement.replicate(host))
    for i in range(2):
      state, _ = step(state, placement.shard_batch(_batch(i)))
    if mode == "pmap":  # every device holds the same memory
      per_device = np.asarray(state.loss_state)
      np.testing.assert_array_equal(per_device, per_device[:1].repeat(8, 0))
    out[mode] = placement.to_host(state_lib.state_to_tree(state))
  init = _parts()[1]
  assert np.abs(out["none"]["loss_state"] - init.loss_state).max() > 1e-3
  for mode in ("shard_map", "pmap"):
    chex.assert_trees_all_close(out[mode]["params"], out["none"]["params"],
                                atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(out[mode]["loss_state"],
                               out["none"]["loss_state"], atol=2e-5)


def test_from_config_builds_the_hook_and_refuses_non_vits():
  c = config_lib.base_config()
  c.loss = config_lib.loss_config("vptsp_proxy_anchor")
  c.model.embedding_dim = E
  c.semantic_proxies.prompt_depth = 1
  vit = models.get_model("vit_ti16", embedding_dim=E, **VIT)
  hook = semantic.from_config(c, vit, C)
  assert (hook.k, hook.net.width, hook.net.num_classes) == (
      c.batch.images_per_class, 8, C)
  assert semantic.from_config(config_lib.base_config(), vit, C) is None
  with pytest.raises(config_checks.ConfigError, match="vit_"):
    semantic.from_config(c, models.get_model("conv4", embedding_dim=E), C)
  c.semantic_proxies.prompt_depth = 2
  with pytest.raises(config_checks.ConfigError, match="at most 1"):
    semantic.from_config(c, vit, C)
  c.semantic_proxies.prompt_depth = 1
  c.batch.sampler = "random"
  with pytest.raises(config_checks.ConfigError, match="'pk'"):
    semantic.from_config(c, vit, C)


def test_the_step_refuses_a_memory_without_its_hook():
  _, state, loss_fn = _parts()
  bare = step_lib.make_loss_fn(losses.get_loss("vptsp_proxy_anchor"))
  for s, fn in ((state, bare), (state.replace(loss_state=None), loss_fn)):
    with pytest.raises(ValueError, match="extra hook"):
      jax.eval_shape(lambda s, fn=fn, b=_batch(0): step_lib.train_step(
          s, b, loss_fn=fn, base_key=jax.random.PRNGKey(0)), s)
