"""Tests of circle_jax/models/vit.py and vit_weights.py that need no torch."""

import os
import pickle

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import errors
from circle_jax import models
from circle_jax.models import convert
from circle_jax.models import vit as vit_lib
from circle_jax.models import vit_weights


def tiny(family="augreg", patch=4, image_size=16, **kw):
  opts = dict(depth=2, width=16, num_heads=2)
  opts.update(kw)
  return vit_lib.ViT(**vit_lib.vit_options("ti", patch, family,
                                           image_size=image_size, **opts))


def init(module, size=16):
  return module.init(jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)),
                     train=False)


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


# ---------------------------------------------------------------------------
# Weight import.
# ---------------------------------------------------------------------------


def timm_state_dict(module, seed=0):
  """A timm-named state dict built from our own parameters (the inverse
  mapping), so that the converter round-trips."""
  params = flax.traverse_util.flatten_dict(
      init(module, module.pos_grid * module.patch_size)["params"])
  rng = np.random.RandomState(seed)
  sd = {}
  for path, value in params.items():
    key, perm = vit_weights._timm_name(path)  # pylint: disable=protected-access
    value = rng.randn(*value.shape).astype(np.float32)
    params[path] = value
    if perm is not None:
      value = value.transpose(np.argsort(perm))
    sd[key] = np.ascontiguousarray(value)  # safetensors writes raw buffers
  return sd, flax.traverse_util.unflatten_dict(params)


@pytest.mark.parametrize("family", ["augreg", "dinov2_reg", "clip", "siglip"])
def test_converter_round_trips_and_ignores_the_classifier(family):
  m = tiny(family)
  sd, params = timm_state_dict(m)
  sd["head.weight"] = np.zeros((10, 16), np.float32)
  got = vit_weights.convert_timm_vit(sd, m)["params"]
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, params)


def test_misfits_are_one_line_errors_naming_the_first_mismatch():
  m = tiny("dinov2")
  sd, _ = timm_state_dict(m)
  with pytest.raises(convert.ConversionError) as e:
    vit_weights.convert_timm_vit(sd, tiny("augreg", width=32))
  assert "\n" not in str(e.value)
  assert ("'blocks.0.attn.proj.bias' has shape (16,), the model expects "
          "(32,)") in str(e.value)
  with pytest.raises(convert.ConversionError, match=r"'blocks.0.ls1.gamma'"):
    vit_weights.convert_timm_vit({k: v for k, v in sd.items()
                                  if "ls1" not in k}, m)
  with pytest.raises(convert.ConversionError, match="ls1.gamma.*family"):
    vit_weights.convert_timm_vit(sd, tiny("augreg"))  # unused layer scale
  extra = dict(sd, **{"blocks.2.norm1.weight": np.ones(16, np.float32)})
  with pytest.raises(convert.ConversionError, match="blocks.2.norm1.weight"):
    vit_weights.convert_timm_vit(extra, m)
  vit_weights.convert_timm_vit(extra, m, strict=False)


def test_position_embedding_of_another_grid_is_resampled_at_load():
  src = tiny("augreg", image_size=16)     # 4 x 4 grid
  sd, _ = timm_state_dict(src)
  dst = tiny("augreg", image_size=24)     # 6 x 6 grid
  got = vit_weights.convert_timm_vit(sd, dst)["params"]["pos_embed"]
  np.testing.assert_array_equal(got[:, :1], sd["pos_embed"][:, :1])
  want = vit_lib.resample_pos_embed(jnp.asarray(sd["pos_embed"][:, 1:]),
                                    (6, 6))
  np.testing.assert_allclose(got[:, 1:], want, rtol=1e-6)


def test_safetensors_and_npz_files(tmp_path):
  st = pytest.importorskip("safetensors.numpy")
  m = tiny("siglip")
  sd, params = timm_state_dict(m)
  st.save_file(sd, str(tmp_path / "w.safetensors"))
  np.savez(tmp_path / "w.npz", **sd)
  for name in ("w.safetensors", "w.npz"):
    got = vit_weights.load_timm_vit(tmp_path / name, m)["params"]
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, params)
  # A real file cut short (an interrupted download), a foreign file and a
  # missing one: one line naming the file and what was expected.
  whole = (tmp_path / "w.safetensors").read_bytes()
  (tmp_path / "cut.safetensors").write_bytes(whole[:len(whole) // 2])
  (tmp_path / "foreign.safetensors").write_bytes(b"not a safetensors file")
  for name in ("cut.safetensors", "foreign.safetensors", "none.safetensors"):
    path = str(tmp_path / name)
    with pytest.raises(errors.WeightsFileError) as e:
      vit_weights.load_timm_vit(path, m)
    message = str(e.value)
    assert "\n" not in message and repr(path) in message, message
    assert "(.safetensors)" in message and "--config.model.pretrained" in message


class _Evil:
  def __reduce__(self):
    return (os.system, ("touch pwned_by_vit_checkpoint",))


def test_malicious_bin_checkpoint_never_runs(tmp_path, monkeypatch):
  import zipfile  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  path = tmp_path / "pytorch_model.bin"
  with zipfile.ZipFile(path, "w") as zf:
    zf.writestr("archive/data.pkl",
                pickle.dumps({"pos_embed": _Evil()}, protocol=2))
  with pytest.raises(errors.WeightsFileError) as e:
    vit_weights.load_timm_vit(path, tiny())
  assert isinstance(e.value.__cause__, pickle.UnpicklingError)
  assert "Refusing to unpickle `posix.system`" in str(e.value)
  assert str(path) in str(e.value) and "\n" not in str(e.value)
  assert not (tmp_path / "pwned_by_vit_checkpoint").exists()


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
