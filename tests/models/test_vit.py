"""Tests of circle_jax/models/vit.py that need no torch (the weight import:
test_vit_weights.py; both against timm: test_vit_timm.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import models
from circle_jax.models import vit as vit_lib
from circle_jax.models import vit_weights
from tests.models import helpers

# Slow (every ViT family compiled): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


tiny = helpers.tiny_vit
init = helpers.init_vit
timm_state_dict = helpers.timm_state_dict


def images(size=16, n=2, seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (n, size, size, 3))


def test_registry_sizes_and_patches():
  for size, (width, depth, heads) in vit_lib.SIZES.items():
    for patch in (14, 16):
      model = models.get_model(f"vit_{size}{patch}", embedding_dim=8)
      assert (model.backbone.width, model.backbone.depth,
              model.backbone.num_heads, model.backbone.patch_size,
              model.backbone.pos_grid) == (width, depth, heads, patch,
                                           224 // patch)
  shapes = jax.eval_shape(lambda: models.get_model(
      "vit_s16", embedding_dim=8).init(jax.random.PRNGKey(0),
                                       jnp.zeros((1, 224, 224, 3)),
                                       train=False))
  n = sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))
  assert abs(n - (21_665_664 + 384 * 8 + 8)) < 1e5  # timm's ViT-S/16 trunk.


@pytest.mark.parametrize("family", sorted(vit_lib.FAMILIES))
def test_every_family_embeds_any_multiple_of_the_patch(family):
  model = models.get_model("vit_ti16", embedding_dim=8, family=family,
                           image_size=16, patch_size=4, depth=1, width=16,
                           num_heads=2)
  v = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16, 16, 3)),
                 train=False)
  for shape in ((2, 16, 16, 3), (2, 24, 12, 3)):
    e = jax.jit(lambda x: model.apply(v, x, train=False))(jnp.ones(shape))
    assert e.shape == (2, 8) and e.dtype == jnp.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1, rtol=1e-5)


def test_pooling_options_differ_and_cls_needs_a_class_token():
  outs = {}
  for pool in vit_lib.POOLS:
    m = tiny(pool=pool)
    outs[pool] = m.apply(init(m), images(), train=False)
  assert not np.allclose(outs["cls"], outs["mean"])
  assert not np.allclose(outs["cls"], outs["map"])
  m = tiny(class_token=False, pool="cls")
  with pytest.raises(ValueError, match="class_token"):
    init(m)


def test_bad_image_size_is_one_clear_error():
  m = tiny()
  with pytest.raises(ValueError, match="multiple of the patch size 4"):
    m.init(jax.random.PRNGKey(0), jnp.zeros((1, 18, 16, 3)), train=False)


def test_pos_embed_resampling_is_identity_on_its_own_grid():
  pos = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 5))
  assert vit_lib.resample_pos_embed(pos, (4, 4)) is pos
  up = vit_lib.resample_pos_embed(pos, (8, 6))
  assert up.shape == (1, 48, 5)
  const = jnp.ones((1, 16, 5))  # a constant field stays constant.
  np.testing.assert_allclose(vit_lib.resample_pos_embed(const, (7, 3)), 1,
                             rtol=1e-6)


def test_remat_gives_the_same_values_and_gradients():
  x = images()
  base, rem = tiny("dinov2"), tiny("dinov2", remat=True)
  v = init(base)
  stacked = vit_weights.stack_blocks(v["params"], 2)
  assert jax.tree_util.tree_structure(stacked) == jax.tree_util.tree_structure(
      init(rem)["params"])

  def loss(module, params):
    return jnp.sum(module.apply({"params": params}, x, train=False) ** 2)

  np.testing.assert_allclose(loss(rem, stacked), loss(base, v["params"]),
                             rtol=1e-6)
  g0 = jax.jit(jax.grad(lambda p: loss(base, p)))(v["params"])
  g1 = jax.jit(jax.grad(lambda p: loss(rem, p)))(stacked)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
      vit_weights.stack_blocks(g0, 2), g1)
  # The converter loads per-block checkpoints into the stacked layout.
  sd, params = timm_state_dict(base)
  got = vit_weights.convert_timm_vit(sd, rem)["params"]
  jax.tree_util.tree_map(np.testing.assert_array_equal, got,
                         vit_weights.stack_blocks(params, 2))


def test_bfloat16_compute_keeps_float32_parameters_and_output():
  m32, m16 = tiny(), tiny(dtype=jnp.bfloat16)
  v = init(m16)
  assert all(x.dtype == jnp.float32
             for x in jax.tree_util.tree_leaves(v))
  y16 = m16.apply(v, images(), train=False)
  y32 = m32.apply(v, images(), train=False)
  assert y16.dtype == jnp.float32
  np.testing.assert_allclose(y16, y32, atol=0.1 * float(jnp.abs(y32).max()))


@pytest.mark.parametrize("remat", [False, True])
def test_dropout_and_drop_path_act_only_in_training(remat):
  m = tiny(dropout=0.2, drop_path=0.5, remat=remat)
  v, x = init(m), images()
  eval1 = m.apply(v, x, train=False)
  np.testing.assert_array_equal(eval1, tiny(remat=remat).apply(v, x,
                                                               train=False))
  t1 = m.apply(v, x, train=True, rngs={"dropout": jax.random.PRNGKey(1)})
  t2 = m.apply(v, x, train=True, rngs={"dropout": jax.random.PRNGKey(2)})
  assert not np.allclose(t1, t2) and not np.allclose(t1, eval1)
  with pytest.raises(ValueError, match="drop_path"):
    init(tiny(drop_path=1.0))


def test_layer_scale_and_registers_are_parameters():
  v = init(tiny("dinov2_reg"))["params"]
  assert v["reg_token"].shape == (1, 4, 16)
  assert v["pos_embed"].shape == (1, 16, 16)  # no entries for cls, registers.
  assert v["blocks_0"]["ls1"].shape == (16,)
  assert init(tiny("dinov2"))["params"]["pos_embed"].shape == (1, 17, 16)


def test_input_spec_follows_the_family():
  clip = models.input_spec("vit_b16", "clip")
  assert clip.mean[0] == pytest.approx(0.48145466)
  assert models.input_spec("vit_s16", "dino").std == (0.229, 0.224, 0.225)
  assert models.input_spec("vit_s16").mean == (0.5, 0.5, 0.5)  # augreg
  with pytest.raises(ValueError, match="family"):
    models.input_spec("vit_s16", "imagenet21k")
  from circle_jax.data import augment  # pylint: disable=g-import-not-at-top
  for fam in vit_lib.FAMILIES.values():  # every family's data preset exists.
    mean, std = augment.RGB_NORMALISATION[fam.preprocess]
    spec = models.input_spec("vit_s16", [k for k, v in vit_lib.FAMILIES.items()
                                         if v is fam][0])
    assert (spec.mean, spec.std) == (mean, std)


def test_frozen_patch_embedding_gets_no_gradient():
  x = images()
  for frozen in (False, True):
    m = tiny(frozen_patch_embed=frozen)
    v = init(m)
    g = jax.jit(jax.grad(lambda p, m=m: jnp.sum(
        m.apply({"params": p}, x, train=False) ** 2)))(v["params"])
    pe = jnp.abs(g["patch_embed"]["kernel"]).max()
    assert (float(pe) == 0.0) == frozen
    assert float(jnp.abs(g["blocks_0"]["attn"]["qkv"]["kernel"]).max()) > 0
