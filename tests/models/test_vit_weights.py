"""Tests of circle_jax/models/vit_weights.py: timm ViT checkpoints -> ViT.

The converter round-trips a timm-named state dict built from our own
parameters (no torch needed); the comparison with timm's own model is in
test_vit_timm.py. RGB weights load into grayscale models and the reverse by
timm's adapt_input_conv rule.
"""

import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import errors
from circle_jax.models import convert
from circle_jax.models import vit as vit_lib
from circle_jax.models import vit_weights
from tests.models import helpers

tiny = helpers.tiny_vit
timm_state_dict = helpers.timm_state_dict


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


@pytest.mark.parametrize("path, name, perm", [
    (("patch_embed", "kernel"), "patch_embed.proj.weight", (2, 3, 1, 0)),
    (("patch_embed", "bias"), "patch_embed.proj.bias", None),
    (("blocks_3", "attn", "qkv", "kernel"), "blocks.3.attn.qkv.weight",
     (1, 0)),
    (("blocks_0", "norm1", "ln", "scale"), "blocks.0.norm1.weight", None),
    (("blocks_0", "norm1", "ln", "bias"), "blocks.0.norm1.bias", None),
    (("blocks_11", "ls2"), "blocks.11.ls2.gamma", None),
    (("norm_pre", "ln", "scale"), "norm_pre.weight", None),
    (("cls_token",), "cls_token", None),
    (("pos_embed",), "pos_embed", None),
])
def test_timm_names_by_hand(path, name, perm):
  assert vit_weights._timm_name(path) == (name, perm)  # pylint: disable=protected-access


def test_stack_blocks_stacks_each_leaf_over_the_depth():
  params = {"cls_token": np.zeros((1, 1, 2)),
            "blocks_0": {"w": np.full((2,), 1.0)},
            "blocks_1": {"w": np.full((2,), 2.0)}}
  out = vit_weights.stack_blocks(params, 2)
  assert set(out) == {"cls_token", "blocks"}
  np.testing.assert_array_equal(out["blocks"]["block"]["w"],
                                [[1.0, 1.0], [2.0, 2.0]])


@pytest.mark.parametrize("remat", [False, True])
def test_rgb_weights_load_into_a_grayscale_vit_as_timm_adapts_them(remat):
  m = tiny("augreg", remat=remat)
  sd, _ = timm_state_dict(tiny("augreg"))
  got = vit_weights.convert_timm_vit(sd, m, in_channels=1)["params"]
  w = sd["patch_embed.proj.weight"]                       # [D, 3, p, p]
  k = got["patch_embed"]["kernel"]
  assert k.shape == (4, 4, 1, 16)
  np.testing.assert_allclose(k[:, :, 0], w.sum(1).transpose(1, 2, 0),
                             rtol=1e-6)
  # A gray image through the adapted model = the tiled image through RGB.
  rgb = vit_weights.convert_timm_vit(sd, m)["params"]
  gray = jax.random.uniform(jax.random.PRNGKey(1), (2, 16, 16, 1))
  a = m.apply({"params": got}, gray, train=False)
  b = m.apply({"params": rgb}, jnp.repeat(gray, 3, -1), train=False)
  np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_grayscale_vit_weights_load_into_an_rgb_model():
  m = tiny("augreg")
  sd, _ = timm_state_dict(m)
  gray = dict(sd)
  gray["patch_embed.proj.weight"] = sd["patch_embed.proj.weight"][:, :1]
  k = vit_weights.convert_timm_vit(gray, m)["params"]["patch_embed"]["kernel"]
  assert k.shape == (4, 4, 3, 16)
  np.testing.assert_allclose(
      k, np.repeat(gray["patch_embed.proj.weight"].transpose(2, 3, 1, 0), 3,
                   axis=2) / 3, rtol=1e-6)


def test_weights_that_cannot_adapt_are_one_line():
  m = tiny("augreg")
  sd, _ = timm_state_dict(m)
  sd["patch_embed.proj.weight"] = np.zeros((16, 2, 4, 4), np.float32)
  with pytest.raises(convert.ConversionError) as e:
    vit_weights.convert_timm_vit(sd, m)
  assert "\n" not in str(e.value)
  assert str(e.value).startswith(
      "The ViT checkpoint: 'patch_embed.proj.weight' takes 2-channel images "
      "and the model's have 3; only 1- or 3-channel weights adapt")
