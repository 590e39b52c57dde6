"""Optimisers: PyTorch semantics, parameter groups, warm-up freeze, schedules."""

import functools
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from circle_jax import config as config_lib
from circle_jax.train import optim


def _params():
  return {
      "model": {"backbone": {"w": jnp.array([1.0, -2.0])},
                "head": {"w": jnp.array([0.5])}},
      "loss": {"proxies": jnp.array([[3.0, 0.0]])},
  }


def _grads(t):
  return {
      "model": {"backbone": {"w": jnp.array([0.1 * (t + 1), -0.3])},
                "head": {"w": jnp.array([0.2])}},
      "loss": {"proxies": jnp.array([[-0.05, 0.4]])},
  }


def _run(tx, steps):
  params = _params()
  state = tx.init(params)
  history = [params]
  for t in range(steps):
    updates, state = tx.update(_grads(t), state, params)
    params = optax.apply_updates(params, updates)
    history.append(params)
  return history


def _adam_reference(ws, gs, lr, *, b1=0.9, b2=0.999, eps=1e-8, wd=0.0,
                    decoupled=False, start=0):
  """torch.optim.Adam / AdamW on one tensor, the tensor frozen before `start`."""
  w = np.array(ws, np.float64)
  m = np.zeros_like(w)
  v = np.zeros_like(w)
  k = 0
  for t, g in enumerate(gs):
    if t < start:
      continue
    k += 1
    g = np.array(g, np.float64)
    if wd and not decoupled:
      g = g + wd * w
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step = (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)
    if wd and decoupled:
      step = step + wd * w
    w = w - lr[t] * step
  return w


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_groups_weight_decay_and_warmup_freeze_match_torch_semantics(name):
  lr, steps, freeze = 0.01, 5, 2
  tx = optim.make_optimizer(
      name=name, learning_rate=lr, weight_decay=0.1,
      lr_multipliers={"head": 10.0, "loss": 100.0},
      freeze_backbone_steps=freeze)
  hist = _run(tx, steps)
  gs = [_grads(t) for t in range(steps)]
  decoupled = name == "adamw"
  # Backbone: untouched during the freeze, then fresh Adam moments.
  for t in range(freeze + 1):
    np.testing.assert_array_equal(hist[t]["model"]["backbone"]["w"], [1.0, -2.0])
  want = _adam_reference([1.0, -2.0], [g["model"]["backbone"]["w"] for g in gs],
                         [lr] * steps, wd=0.1, decoupled=decoupled, start=freeze)
  np.testing.assert_allclose(hist[-1]["model"]["backbone"]["w"], want, rtol=1e-5, atol=1e-5)
  want = _adam_reference([0.5], [g["model"]["head"]["w"] for g in gs],
                         [10 * lr] * steps, wd=0.1, decoupled=decoupled)
  np.testing.assert_allclose(hist[-1]["model"]["head"]["w"], want, rtol=1e-5, atol=1e-5)
  want = _adam_reference([[3.0, 0.0]], [g["loss"]["proxies"] for g in gs],
                         [100 * lr] * steps, wd=0.1, decoupled=decoupled)
  np.testing.assert_allclose(hist[-1]["loss"]["proxies"], want, rtol=1e-5, atol=1e-5)


def test_sgd_momentum_rmsprop_and_frozen_paths():
  tx = optim.make_optimizer(name="sgd", learning_rate=0.1, momentum=0.9,
                            frozen_paths=[("head", "w")])
  hist = _run(tx, 2)
  g0, g1 = _grads(0), _grads(1)
  buf = 0.9 * np.asarray(g0["model"]["backbone"]["w"]) + np.asarray(
      g1["model"]["backbone"]["w"])
  want = np.array([1.0, -2.0]) - 0.1 * np.asarray(g0["model"]["backbone"]["w"]) - 0.1 * buf
  np.testing.assert_allclose(hist[-1]["model"]["backbone"]["w"], want, rtol=1e-6)
  np.testing.assert_array_equal(hist[-1]["model"]["head"]["w"], [0.5])

  tx = optim.make_optimizer(name="rmsprop", learning_rate=0.1, eps=1e-8)
  hist = _run(tx, 1)
  g = np.asarray(_grads(0)["loss"]["proxies"], np.float64)
  v = 0.01 * g * g  # torch: v = alpha v + (1 - alpha) g^2, alpha = 0.99
  want = np.array([[3.0, 0.0]]) - 0.1 * g / (np.sqrt(v) + 1e-8)
  np.testing.assert_allclose(hist[-1]["loss"]["proxies"], want, rtol=1e-5, atol=1e-5)


def test_path_prefix_multipliers_override_the_group():
  """A slash key sets the multiplier of the leaves under it (the longest
  prefix wins); a prefix under the backbone freezes with it; the config
  section takes such keys by item and the saved config keeps them."""
  params = _params()
  params["loss"]["hier"] = {"p": jnp.array([1.0]), "q": jnp.array([2.0])}
  params["model"]["backbone"]["prompt"] = jnp.array([0.0])
  grads = jax.tree.map(jnp.ones_like, params)
  tx = optim.make_optimizer(
      name="sgd", learning_rate=0.1, freeze_backbone_steps=1,
      lr_multipliers={"loss": 10.0, "loss/hier": 50.0, "loss/hier/q": 2.0,
                      "model/backbone/prompt": 3.0})
  state = tx.init(params)
  moves = []
  for _ in range(2):
    updates, state = tx.update(grads, state, params)
    moves.append(jax.tree.map(
        lambda u: round(float(-u.ravel()[0]), 6), updates))
  assert moves[0]["loss"] == {"proxies": 1.0, "hier": {"p": 5.0, "q": 0.2}}
  assert moves[0]["model"]["backbone"] == {"w": 0.0, "prompt": 0.0}
  assert moves[1]["model"]["backbone"] == {"w": 0.1, "prompt": 0.3}
  assert moves[0]["model"]["head"]["w"] == 0.1
  with pytest.raises(ValueError, match="'loss/hierr', which is above no"):
    optim.make_optimizer(lr_multipliers={"loss/hierr": 2.0}).init(params)
  with pytest.raises(ValueError, match="starts with 'model/' or 'loss/'"):
    optim.make_optimizer(lr_multipliers={"hier/p": 2.0})

  c = config_lib.base_config()
  c.optim.lr_multipliers["loss/hier"] = 50.0
  saved = config_lib.from_dict(c.to_dict())
  assert saved.optim.lr_multipliers.to_dict() == {
      "backbone": 1.0, "head": 1.0, "loss": 1.0, "loss/hier": 50.0}
  lrs = optim.learning_rates(saved.optim, 10)(0)
  assert lrs["loss/hier"] == pytest.approx(50 * lrs["backbone"])
  with pytest.raises(AttributeError, match="lr_multipliers.proxy: the config"):
    c.optim.lr_multipliers.proxy = 2.0



def test_glob_pattern_groups_biases_and_frozen_weights_never_move():
  """BitFit's group: a glob key ('model/backbone/*bias') gives every bias
  its multiplier, the prompt prefix its own; frozen kernels get a zero
  update under AdamW's decoupled decay and no optimiser moments change."""
  params = {"model": {
      "backbone": {"blocks_0": {"qkv": {"kernel": jnp.ones((2,)),
                                        "bias": jnp.ones((2,))},
                                "ln": {"scale": jnp.ones((2,)),
                                       "bias": jnp.ones((2,))}},
                   "prompts": {"layer_0": jnp.ones((2,))}},
      "head": {"w": jnp.ones((2,))}}, "loss": {}}
  frozen = [("backbone", "blocks_0", "qkv", "kernel"),
            ("backbone", "blocks_0", "ln", "scale")]
  tx = optim.make_optimizer(
      name="adamw", learning_rate=0.1, weight_decay=0.5,
      frozen_paths=frozen,
      lr_multipliers={"model/backbone/*bias": 2.0,
                      "model/backbone/prompts": 3.0})
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, new_state = tx.update(grads, state, params)
  move = jax.tree.map(lambda u: round(float(-u[0]), 5), updates)
  block = move["model"]["backbone"]["blocks_0"]
  # Adam's first step is lr * (1 + wd * w) = lr * 1.5 per unit multiplier.
  assert block == {"qkv": {"kernel": 0.0, "bias": 0.3},
                   "ln": {"scale": 0.0, "bias": 0.3}}
  assert move["model"]["backbone"]["prompts"]["layer_0"] == 0.45
  assert move["model"]["head"]["w"] == 0.15
  labels = optim.param_labels(
      params, frozenset(frozen),
      ("model/backbone/*bias", "model/backbone/prompts"))
  assert labels["model"]["backbone"]["blocks_0"] == {
      "qkv": {"kernel": "frozen", "bias": "model/backbone/*bias"},
      "ln": {"scale": "frozen", "bias": "model/backbone/*bias"}}
  for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)):
    if old.shape == () or np.all(np.asarray(old) == np.asarray(new)):
      continue
    assert old.shape == (2,)  # only trained leaves' moments move
  n_moments = sum(x.size for x in jax.tree.leaves(state) if x.ndim)
  assert n_moments == 2 * 2 * 4  # mu and nu of the 4 trained leaves only
  with pytest.raises(ValueError, match="'model/backbone/\\*bais', which is"):
    optim.make_optimizer(
        lr_multipliers={"model/backbone/*bais": 2.0}).init(params)

def test_clipping():
  tx = optim.make_optimizer(name="sgd", learning_rate=1.0, grad_clip_value=0.1)
  hist = _run(tx, 1)
  np.testing.assert_allclose(hist[1]["loss"]["proxies"], [[3.05, -0.1]], rtol=1e-6)
  tx = optim.make_optimizer(name="sgd", learning_rate=1.0, grad_clip_norm=1e-3)
  hist = _run(tx, 1)
  delta = jax.tree.map(lambda a, b: a - b, hist[1], hist[0])
  np.testing.assert_allclose(float(optax.global_norm(delta)), 1e-3, rtol=1e-4)


def test_schedules():
  s = optim.make_schedule(1.0, schedule="step", decay_every_steps=10,
                          decay_factor=0.5)
  np.testing.assert_allclose([float(s(t)) for t in (0, 9, 10, 25)],
                             [1, 1, 0.5, 0.25])
  s = optim.make_schedule(2.0, schedule="cosine", num_train_steps=110,
                          lr_warmup_steps=10)
  np.testing.assert_allclose([float(s(t)) for t in (0, 5, 10, 60, 110)],
                             [0, 1, 2, 1, 0], atol=1e-6)
  # The schedule follows the global step, also for a frozen backbone.
  tx = optim.make_optimizer(
      name="sgd", learning_rate=optim.make_schedule(
          1.0, schedule="step", decay_every_steps=1, decay_factor=0.5),
      freeze_backbone_steps=2)
  hist = _run(tx, 3)
  np.testing.assert_allclose(
      hist[3]["model"]["backbone"]["w"] - hist[2]["model"]["backbone"]["w"],
      -0.25 * np.asarray(_grads(2)["model"]["backbone"]["w"]), rtol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="lamb"), "optim.name"),
    (dict(schedule="poly"), "optim.schedule"),
    (dict(schedule="step"), "decay_every_steps"),
    (dict(learning_rate=-1.0), "learning_rate"),
    (dict(lr_multipliers={"proxies": 100.0}), "lr_multipliers"),
    (dict(weight_decay=-1.0), "weight_decay"),
])
def test_bad_settings_name_the_field(kwargs, match):
  """Through the config (schedule and optimiser fields together), and
  through the function that reads each field."""
  c = config_lib.optim_config()
  c.update(kwargs)
  with pytest.raises(ValueError, match=match):
    optim.optimizer_from_config(c, num_train_steps=10)
  fn = (optim.make_optimizer if set(kwargs) - set(optim.SCHEDULE_FIELDS)
        else functools.partial(optim.make_schedule, 1e-3))
  with pytest.raises(ValueError, match=match):
    fn(**kwargs)


def test_a_constant_equals_its_constant_schedule():
  """A float learning rate is the constant schedule at that value."""
  for name in optim.OPTIMIZERS:
    a = _run(optim.make_optimizer(name=name, learning_rate=0.1), 2)
    b = _run(optim.make_optimizer(name=name, learning_rate=optim.make_schedule(
        0.1, schedule="constant")), 2)
    chex.assert_trees_all_close(a, b, rtol=0, atol=0)


def test_one_set_of_defaults_the_configs():
  """make_optimizer's and make_schedule's defaults are config.optim's (read
  from circle_jax.config.optim_config, the one place they are written)."""
  fields = config_lib.base_config().optim.to_dict()
  assert fields == config_lib.optim_config().to_dict()
  assert (fields["name"], fields["learning_rate"]) == ("adam", 1e-3)
  keywords = set()
  for fn, own in [(optim.make_optimizer, ("frozen_paths",)),
                  (optim.make_schedule, ("learning_rate", "num_train_steps"))]:
    params = inspect.signature(fn).parameters
    defaults = {k: p.default for k, p in params.items() if k not in own}
    if fn is optim.make_optimizer:
      defaults["lr_multipliers"] = dict(defaults["lr_multipliers"])
    assert defaults == {k: fields[k] for k in defaults}, fn.__name__
    assert not keywords & set(defaults), fn.__name__  # each default once
    keywords |= set(defaults)
  assert keywords == set(fields)  # every field is a keyword of one of them
  assert set(optim.SCHEDULE_FIELDS) == keywords - set(
      inspect.signature(optim.make_optimizer).parameters)
