"""A model that cannot run a config, and a damaged weights file: one line.

``models.check_input`` (called by the config check) names the field and the
fix before anything is built; ``errors.reading_weights`` (around every
weights reader) names the file and what it should have been.
"""

import numpy as np
import pytest

from circle_jax import models
from circle_jax.errors import WeightsFileError
from circle_jax.train import config_checks
from experiments.configs import omniglot_small


def test_check_input_names_an_option_the_model_does_not_have():
  field, message = models.check_input("bn_inception", {"width": 32},
                                      (224, 224))
  assert field == "model.kwargs.width"
  assert message == (
      "model 'bn_inception' has no option 'width'; its options are "
      "['bn_momentum'] (give them as --config.model.kwargs.OPTION=VALUE).")
  assert models.check_input("conv4", {"width": 32}, (28, 28)) is None
  assert models.backbone_defaults("conv4") == {
      "width": 64, "num_blocks": 4, "pool_padding": "SAME",
      "bn_momentum": 0.9}


def test_check_input_names_images_the_model_cannot_take():
  field, message = models.check_input("bn_inception", {}, (105, 105))
  assert field == "model.name"
  assert message.startswith(
      "model 'bn_inception' cannot take the 105x105 images of this config: "
      "in block 3c")
  assert "--config.dataset.preprocess.image_size" in message
  assert models.check_input("bn_inception", {}, (227, 227)) is None
  assert models.check_input("resnet50", {}, (28, 28)) is None


def test_check_input_names_a_vit_patch_size_that_does_not_divide_the_images():
  field, message = models.check_input("vit_ti16", {}, (28, 28))
  assert field == "model.name"
  assert message.startswith(
      "model 'vit_ti16' cannot take the 28x28 images of this config: input "
      "28x28 is not a multiple of the patch size 16")
  assert models.check_input("vit_ti16", {"patch_size": 4}, (28, 28)) is None
  assert models.check_input("vit_ti16", {}, (32, 48)) is None


def test_the_config_check_refuses_bn_inception_on_omniglot_small():
  c = omniglot_small.get_config()
  c.model.name = "bn_inception"
  with pytest.raises(config_checks.ConfigError) as e:
    config_checks.check_config(c)
  assert str(e.value).startswith(
      "config.model.name: model 'bn_inception' cannot take the 28x28 images")
  c.dataset.preprocess.image_size = 64    # the fix the message gives
  config_checks.check_config(c)


@pytest.mark.parametrize("kind", ["random", "truncated", "empty"])
def test_a_damaged_keras_file_is_one_line_naming_it(tmp_path, kind):
  path = tmp_path / "resnet50.h5"
  data = {"random": np.random.default_rng(0).bytes(4000),
          "truncated": b"\x89HDF\r\n\x1a\n" + b"\0" * 100, "empty": b""}[kind]
  path.write_bytes(data)
  with pytest.raises(WeightsFileError) as e:
    models.load_keras_resnet50(path)
  msg = str(e.value)
  assert "\n" not in msg
  assert msg.startswith(f"Cannot read the pretrained weights {str(path)!r}")
  assert "expected Keras ResNet-50 weights (.h5, .weights.h5 or .keras)" in msg


@pytest.mark.parametrize("data", [b"\x80\x02)R", b"garbage" * 50, b""])
def test_a_damaged_pth_file_is_one_line_naming_it(tmp_path, data):
  path = tmp_path / "bn_inception.pth"
  path.write_bytes(data)
  with pytest.raises(WeightsFileError) as e:
    models.load_bn_inception(path)
  msg = str(e.value)
  assert "\n" not in msg and str(path) in msg
  assert "expected a PyTorch state dict (.pth/.pt" in msg


def test_a_missing_file_or_a_folder_is_one_line(tmp_path):
  with pytest.raises(WeightsFileError, match="not found; expected Keras"):
    models.load_keras_resnet50(tmp_path / "nope.h5")
  with pytest.raises(WeightsFileError, match="is a folder; give the file"):
    models.load_bn_inception(tmp_path)
