"""Tests of circle_jax/models/vit_weights.py: RGB ViT weights on grayscale
images (the rest of the converter is tested in test_vit.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.models import convert
from circle_jax.models import vit_weights
from tests.models import test_vit


@pytest.mark.parametrize("remat", [False, True])
def test_rgb_weights_load_into_a_grayscale_vit_as_timm_adapts_them(remat):
  m = test_vit.tiny("augreg", remat=remat)
  sd, _ = test_vit.timm_state_dict(test_vit.tiny("augreg"))
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
  m = test_vit.tiny("augreg")
  sd, _ = test_vit.timm_state_dict(m)
  gray = dict(sd)
  gray["patch_embed.proj.weight"] = sd["patch_embed.proj.weight"][:, :1]
  k = vit_weights.convert_timm_vit(gray, m)["params"]["patch_embed"]["kernel"]
  assert k.shape == (4, 4, 3, 16)
  np.testing.assert_allclose(
      k, np.repeat(gray["patch_embed.proj.weight"].transpose(2, 3, 1, 0), 3,
                   axis=2) / 3, rtol=1e-6)


def test_weights_that_cannot_adapt_are_one_line():
  m = test_vit.tiny("augreg")
  sd, _ = test_vit.timm_state_dict(m)
  sd["patch_embed.proj.weight"] = np.zeros((16, 2, 4, 4), np.float32)
  with pytest.raises(convert.ConversionError) as e:
    vit_weights.convert_timm_vit(sd, m)
  assert "\n" not in str(e.value)
  assert str(e.value).startswith(
      "The ViT checkpoint: 'patch_embed.proj.weight' takes 2-channel images "
      "and the model's have 3; only 1- or 3-channel weights adapt")
