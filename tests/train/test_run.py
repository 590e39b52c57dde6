"""Tests of circle_jax/train/run.py: pretrained RGB weights on grayscale data
(the rest of run.py is exercised by the trainer's tests)."""

import flax
import jax
import numpy as np

from circle_jax import data
from circle_jax.models import vit_weights
from circle_jax.train import run as run_lib
from tests.train import test_vit_train


def test_rgb_vit_weights_start_a_grayscale_run(tmp_path):
  """digits is grayscale and every ViT checkpoint is RGB: the patch
  projection is summed over its channels (timm's adapt_input_conv)."""
  c = test_vit_train.vit_config(str(tmp_path / "tfds"))
  module = run_lib.build_model(c).backbone
  rgb = module.init(jax.random.PRNGKey(1), np.zeros((1, 28, 28, 3)),
                    train=False)["params"]
  sd = {}
  for path, value in flax.traverse_util.flatten_dict(rgb).items():
    key, perm = vit_weights._timm_name(path)  # pylint: disable=protected-access
    value = np.asarray(value)
    if perm is not None:
      value = value.transpose(np.argsort(perm))
    sd[key] = np.ascontiguousarray(value)
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  save_file(sd, str(tmp_path / "w.safetensors"))
  c.model.pretrained = str(tmp_path / "w.safetensors")
  info = data.get_dataset_info("digits")
  state, *_ = run_lib.init_state(c, run_lib.build_model(c), info,
                                 (28, 28, 1))
  kernel = state.params["model"]["backbone"]["patch_embed"]["kernel"]
  assert kernel.shape == (4, 4, 1, 32)
  np.testing.assert_allclose(
      kernel, np.asarray(rgb["patch_embed"]["kernel"]).sum(2, keepdims=True),
      rtol=1e-6)
  np.testing.assert_array_equal(
      state.params["model"]["backbone"]["pos_embed"], rgb["pos_embed"])


def test_a_partial_copy_too_small_for_the_hold_out_is_one_line(tmp_path):
  """A two-class copy of CUB with the paper configs' 20 % hold-out: the
  classes the copy really has are checked once it is read (the spec's 100
  passed the config check), in one line naming the numbers and fields."""
  import pytest  # pylint: disable=g-import-not-at-top
  from circle_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  from tests.data import fixtures  # pylint: disable=g-import-not-at-top
  from tests.train import helpers  # pylint: disable=g-import-not-at-top
  m = tmp_path / "m"
  fixtures.write_tree(fixtures.cub_files({1: 2, 2: 2, 101: 2, 102: 2}), m)
  c = helpers.digits_config(**{
      "dataset.name": "cub200", "dataset.manual_dir": str(m),
      "dataset.data_dir": str(tmp_path / "d"),
      "dataset.validation_fraction": 0.2, "batch.classes_per_batch": 2})
  config_checks.check_config(c, device_count=1, process_count=1)
  with pytest.raises(config_checks.ConfigError) as e:
    run_lib.load_sources(c, data.get_dataset_info("cub200"))
  assert str(e.value) == (
      "config.dataset.validation_fraction: 0.2 holds out 2 of the 2 train "
      f"classes of 'cub200' (as read from manual_dir '{m}') and leaves 0 to "
      "train on; both sides need at least 2 classes: set "
      "dataset.validation_fraction=0 (no hold-out).")
  c.dataset.validation_fraction = 0.0
  train, validation = run_lib.load_sources(c, data.get_dataset_info("cub200"))
  assert len(train) == 4 and validation is None
