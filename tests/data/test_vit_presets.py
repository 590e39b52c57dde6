"""The ViT families' normalisation presets (clip, inception) of augment.py."""

import numpy as np
import pytest

from circle_jax import data
from circle_jax import models
from tests.data.test_augment import SOLID


@pytest.mark.parametrize("preset, mean, std", [
    ("clip", (0.48145466, 0.4578275, 0.40821073),
     (0.26862954, 0.26130258, 0.27577711)),
    ("inception", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
def test_family_presets_normalise_with_their_mean_and_std(preset, mean, std):
  for train in (False, True):
    x = data.get_preprocess(preset, train=train)(SOLID,
                                                 np.random.default_rng(0))
    want = (np.array([10, 20, 30]) / 255 - np.array(mean)) / np.array(std)
    np.testing.assert_allclose(x, np.broadcast_to(want, x.shape), atol=1e-5)


def test_every_vit_family_names_a_preset_its_input_spec_matches():
  rgb = np.full((1, 4, 4, 3), [10.0, 20.0, 30.0], np.float32)
  for family, spec in models.VIT_FAMILIES.items():
    x = data.get_preprocess(spec.preprocess, train=False, image_size=4,
                            resize_size=4)(SOLID, None)
    np.testing.assert_allclose(
        x, np.asarray(models.input_spec("vit_s16", family).apply(rgb))[0],
        atol=1e-5)
