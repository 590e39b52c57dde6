"""The ViT port and its weight import against timm (test-only dependency).

One small random-weight timm model per checkpoint family (depth 2, width 64),
saved as ``.safetensors`` and as a ``torch.save`` ``.pth``, is loaded into
:class:`circle_jax.models.ViT` without torch and must give timm's features
in float32 within 1e-4 relative: at the checkpoint's image size, at a larger
and a smaller one (the position embedding resampled at run time, as timm's
``dynamic_img_size``), and for a model built at another size (the embedding
resampled at load time, as timm's ``checkpoint_filter_fn``).
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from circle_jax import models
from circle_jax.models import vit as vit_lib
from circle_jax.models import vit_weights
from tests.models.timm_reference import import_timm

# Slow (compared with the reference framework): not in the fast tier.
pytestmark = pytest.mark.slow

timm, torch = import_timm()
safetensors_torch = pytest.importorskip("safetensors.torch")

# family -> (timm model, patch size, extra timm arguments).
CASES = {
    "augreg": ("vit_small_patch16_224", 16, {}),
    "dinov2": ("vit_small_patch14_dinov2", 14, {}),
    "dinov2_reg": ("vit_small_patch14_reg4_dinov2", 14, {}),
    "clip": ("vit_base_patch16_clip_224", 16, {}),
    "siglip": ("vit_base_patch16_siglip_224", 16, {}),
    "mean_fc_norm": ("vit_small_patch16_224", 16, {"global_pool": "avg"}),
}
SMALL = dict(depth=2, embed_dim=64, num_heads=2, num_classes=0)


def _timm_model(name, grid, patch, extra):
  torch.manual_seed(0)
  m = timm.create_model(name, pretrained=False, img_size=grid * patch,
                        dynamic_img_size=True, **SMALL, **extra).eval()
  with torch.no_grad():  # Off timm's init (zero biases, unit LayerNorms).
    for p in m.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return m


def _ours(family, patch, grid):
  if family == "mean_fc_norm":
    return vit_lib.ViT(**vit_lib.vit_options(
        "s", patch, "augreg", image_size=grid * patch, depth=2, width=64,
        num_heads=2, pool="mean", fc_norm=True))
  return vit_lib.ViT(**vit_lib.vit_options(
      "s", patch, family, image_size=grid * patch, depth=2, width=64,
      num_heads=2))


def _features(module, variables, x):
  y = module.apply(variables, jnp.asarray(x.transpose(0, 2, 3, 1)),
                   train=False)
  return np.asarray(y)[:, 0, 0]


def _reference(m, x):
  with torch.no_grad():
    return m(torch.from_numpy(x)).numpy()


def _close(ours, ref):
  rel = np.abs(ours - ref).max() / np.abs(ref).max()
  assert rel < 1e-4, rel


@pytest.mark.parametrize("family,fmt", [(f, "safetensors") for f in CASES]
                         + [("dinov2_reg", "pth"), ("siglip", "bin")])
def test_features_match_timm(family, fmt, tmp_path):
  name, patch, extra = CASES[family]
  grid = 3
  m = _timm_model(name, grid, patch, extra)
  path = tmp_path / f"w.{fmt}"
  sd = {k: v.contiguous() for k, v in m.state_dict().items()}
  if fmt == "safetensors":
    safetensors_torch.save_file(sd, str(path))
  else:
    torch.save(sd, path)
  module = _ours(family, patch, grid)
  variables = vit_weights.load_timm_vit(path, module)
  rng = np.random.RandomState(0)
  for side in (grid, grid + 2, grid - 1):  # checkpoint, larger, smaller grid.
    x = rng.randn(2, 3, side * patch, side * patch).astype(np.float32)
    _close(_features(module, variables, x), _reference(m, x))


@pytest.mark.parametrize("family", ["augreg", "dinov2_reg"])
def test_load_time_resampling_matches_timm_checkpoint_filter(family):
  name, patch, extra = CASES[family]
  src = _timm_model(name, 3, patch, extra)
  sd = {k: v for k, v in src.state_dict().items()}
  dst = timm.create_model(name, pretrained=False, img_size=5 * patch,
                          **SMALL, **extra).eval()
  from timm.models import vision_transformer as tv  # pylint: disable=g-import-not-at-top
  dst.load_state_dict(tv.checkpoint_filter_fn(sd, dst))
  module = _ours(family, patch, 5)
  variables = vit_weights.convert_timm_vit(
      {k: v.numpy() for k, v in sd.items()}, module)
  x = np.random.RandomState(1).randn(2, 3, 5 * patch, 5 * patch).astype(
      np.float32)
  _close(_features(module, variables, x), _reference(dst, x))


def test_embedding_model_loads_the_backbone():
  name, patch, extra = CASES["clip"]
  m = _timm_model(name, 2, patch, extra)
  model = models.get_model("vit_b16", embedding_dim=8, family="clip",
                           image_size=32, depth=2, width=64, num_heads=2)
  variables = model.init(jax.random.PRNGKey(0),
                         jnp.zeros((1, 32, 32, 3)), train=False)
  backbone = vit_weights.convert_timm_vit(
      {k: v.numpy() for k, v in m.state_dict().items()}, model.backbone)
  variables = models.replace_backbone(variables, backbone)
  x = np.random.RandomState(2).randn(2, 3, 32, 32).astype(np.float32)
  feats = model.apply(variables, jnp.asarray(x.transpose(0, 2, 3, 1)),
                      train=False, method=model.features)
  _close(np.asarray(feats)[:, 0, 0], _reference(m, x))
