"""Visual prompts, BitFit and ``tune`` of circle_jax/models/vit.py (VPTSP-G).

The prompted ViT is checked against a float64 numpy forward written here from
the VPTSP-G code's ``_forward_vpt_block`` (prompts prepended to a block's
input, dropped from its output), and the frozen parameters of ``tune`` get
no update through the trainer's real optimiser.
"""

import math

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from circle_jax import config as config_lib
from circle_jax import models
from circle_jax.models import vit_prompts
from circle_jax.models import vit_weights
from circle_jax.train import optim
from tests.models import helpers

WIDTH, HEADS, PATCH, SIZE = 8, 2, 4, 8


def _vit(**kw):
  return helpers.tiny_vit(patch=PATCH, image_size=SIZE, width=WIDTH,
                          num_heads=HEADS, **kw)


def _ln(x, p, eps):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def _dense(x, p):
  return x @ p["kernel"] + p["bias"]


def _block(x, p):
  """timm's pre-norm Block on ``[L, D]`` tokens of one image, float64."""
  erf = np.vectorize(math.erf)
  n, d = x.shape
  hd = d // HEADS
  y = _ln(x, p["norm1"]["ln"], 1e-6)
  qkv = _dense(y, p["attn"]["qkv"]).reshape(n, 3, HEADS, hd)
  heads = []
  for h in range(HEADS):
    q, k, v = qkv[:, 0, h], qkv[:, 1, h], qkv[:, 2, h]
    a = q @ k.T / math.sqrt(hd)
    a = np.exp(a - a.max(-1, keepdims=True))
    heads.append((a / a.sum(-1, keepdims=True)) @ v)
  x = x + _dense(np.concatenate(heads, -1), p["attn"]["proj"])
  y = _dense(_ln(x, p["norm2"]["ln"], 1e-6), p["mlp"]["fc1"])
  y = 0.5 * y * (1 + erf(y / math.sqrt(2)))
  return x + _dense(y, p["mlp"]["fc2"])


def _reference(params, image, layer_prompts, head_norm=True):
  """The prompted ViT of one ``[H, W, 3]`` image; ``layer_prompts[i]``
  ``[n_i, D]`` (or None) is prepended to block ``i``'s input."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  g = SIZE // PATCH
  patches = image.reshape(g, PATCH, g, PATCH, 3).transpose(0, 2, 1, 3, 4)
  x = patches.reshape(g * g, -1) @ p["patch_embed"]["kernel"].reshape(
      -1, WIDTH) + p["patch_embed"]["bias"]
  x = np.concatenate([p["cls_token"][0], x]) + p["pos_embed"][0]
  for i in range(2):
    tokens = layer_prompts[i] if i < len(layer_prompts) else None
    n = 0 if tokens is None else len(tokens)
    if n:
      x = np.concatenate([tokens, x])
    x = _block(x, p[f"blocks_{i}"])[n:]
  y = _ln(x, p["norm"]["ln"], 1e-6)[0]
  return _ln(y, p["head_norm"]["ln"], 1e-5) if head_norm else y


def test_prompted_vit_matches_a_float64_reference():
  """Deep prompts (3 then 2 tokens: ``prompt_step=1``), ``head_norm``, and
  per-example ``prompt_tokens`` replacing them (the class prompts, whose
  pass skips ``head_norm``)."""
  module = _vit(num_prompts=3, prompt_step=1, head_norm=True)
  assert vit_prompts.prompt_counts(3, None, 1, 2) == (3, 2)
  assert vit_prompts.prompt_counts(3, 1, 0, 2) == (3,)  # shallow
  assert vit_prompts.prompt_counts(5, 12, 2, 12) == (5, 3, 1, 0, 0, 0, 0, 0, 0,
                                                 0, 0, 0)
  params = helpers.random_variables(helpers.variable_shapes(
      module, (1, SIZE, SIZE, 3)))["params"]
  assert params["prompts"]["layer_0"].shape == (1, 3, WIDTH)
  assert params["prompts"]["layer_1"].shape == (1, 2, WIDTH)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, SIZE, SIZE, 3))
  own = [rng.normal(size=(2, 4, WIDTH)), rng.normal(size=(2, 1, WIDTH))]

  @jax.jit
  def forward(params, x, own):
    return (module.apply({"params": params}, x, train=False)[:, 0, 0],
            module.apply({"params": params}, x, train=False,
                         prompt_tokens=own)[:, 0, 0],
            module.apply({"params": params}, x, train=False,
                         prompt_tokens=own[:1])[:, 0, 0])

  shared, per_example, first_only = map(np.asarray, forward(
      params, jnp.asarray(x, jnp.float32),
      [jnp.asarray(t, jnp.float32) for t in own]))
  learned = [params["prompts"][f"layer_{i}"][0] for i in range(2)]
  for b in range(2):
    np.testing.assert_allclose(
        shared[b], _reference(params, x[b], learned), atol=2e-5)
    np.testing.assert_allclose(
        per_example[b], _reference(params, x[b], [t[b] for t in own],
                                   head_norm=False), atol=2e-5)
    np.testing.assert_allclose(
        first_only[b], _reference(params, x[b], [own[0][b]],
                                  head_norm=False), atol=2e-5)
  # The prompts do change the feature (a test that can fail).
  assert np.abs(shared - per_example).max() > 1e-2


def test_tune_freezes_all_but_prompts_biases_and_head_norm():
  """``frozen_module_paths`` of BitFit and prompt tuning, and one AdamW step
  with weight decay through the trainer's optimiser: frozen leaves keep
  their values exactly; the prompts, biases, head_norm and head move."""
  model = models.EmbeddingModel(backbone=_vit(num_prompts=2, head_norm=True,
                                              tune="bitfit"),
                                embedding_dim=4)
  variables = helpers.random_variables(helpers.variable_shapes(
      model, (1, SIZE, SIZE, 3)))
  flat = flax.traverse_util.flatten_dict(variables["params"])
  frozen = models.frozen_module_paths(variables, {"tune": "bitfit"})
  trained = {p for p in flat if p not in frozen}
  assert ("backbone", "blocks_0", "attn", "qkv", "bias") in trained
  assert ("backbone", "blocks_1", "norm2", "ln", "bias") in trained
  assert ("backbone", "patch_embed", "bias") in trained
  assert ("backbone", "head_norm", "ln", "scale") in trained
  assert ("backbone", "prompts", "layer_1") in trained
  assert ("backbone", "blocks_0", "norm1", "ln", "scale") in frozen
  assert ("backbone", "pos_embed") in frozen and ("backbone",
                                                  "cls_token") in frozen
  assert not any(p[0] == "head" for p in frozen)
  prompt_only = models.frozen_module_paths(variables, {"tune": "prompt"})
  assert {p for p in flat if p not in prompt_only} == {
      p for p in flat if p[0] == "head" or p[1] in vit_prompts.ADDED}
  assert models.frozen_module_paths(variables, {"tune": "full"}) == set()

  c = config_lib.base_config().optim
  c.name, c.weight_decay, c.learning_rate = "adamw", 0.1, 0.1
  tx = optim.optimizer_from_config(c, num_train_steps=2, frozen_paths=frozen)
  params = {"model": variables["params"], "loss": {}}
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, SIZE, SIZE, 3)),
                  jnp.float32)

  @jax.jit
  def step(params, state):
    grads = jax.grad(lambda p: jnp.sum(model.apply(
        {"params": p["model"]}, x, train=True)[:, 0]))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates)

  new = flax.traverse_util.flatten_dict(
      step(params, tx.init(params))["model"])
  for path, value in flat.items():
    moved = bool(np.any(np.asarray(new[path]) != value))
    assert moved == (path in trained), path


def test_prompted_weights_load_and_bad_options_are_one_line():
  """A timm checkpoint (no prompts) loads into a prompted ViT, whose prompts
  and head_norm keep their init; bad options and tokens raise."""
  plain = _vit()
  sd, params = helpers.timm_state_dict(plain)
  prompted = _vit(num_prompts=2, head_norm=True, tune="bitfit")
  loaded = vit_weights.convert_timm_vit(sd, prompted)["params"]
  np.testing.assert_array_equal(loaded["blocks_1"]["mlp"]["fc1"]["kernel"],
                                params["blocks_1"]["mlp"]["fc1"]["kernel"])
  assert loaded["prompts"]["layer_0"].shape == (1, 2, WIDTH)
  np.testing.assert_array_equal(loaded["head_norm"]["ln"]["scale"],
                                np.ones(WIDTH))
  x = jnp.zeros((1, SIZE, SIZE, 3))
  with pytest.raises(ValueError, match="`tune` must be one of full, bitfit"):
    helpers.variable_shapes(_vit(tune="lora"), x.shape)
  with pytest.raises(ValueError, match="need remat=False"):
    helpers.variable_shapes(_vit(num_prompts=2, remat=True), x.shape)
  with pytest.raises(ValueError, match=r"must be \[2 or 1, n, 8\]"):
    jax.eval_shape(lambda: prompted.init(
        jax.random.PRNGKey(0), jnp.zeros((2, SIZE, SIZE, 3)), train=False,
        prompt_tokens=[jnp.zeros((3, 1, WIDTH))]))


def test_prompt_init_is_torch_xavier_normal_of_the_first_blocks_tensor():
  """std ``sqrt(2 / ((tokens + rows) D))`` for every block (the code slices
  deeper blocks' tokens out of one ``[rows, tokens, D]`` tensor)."""
  init = vit_prompts.prompt_init(1, 80)
  x = np.asarray(init(jax.random.PRNGKey(0), (1, 40, 256)))
  assert x.std() == pytest.approx((2 / (81 * 256)) ** 0.5, rel=0.05)
