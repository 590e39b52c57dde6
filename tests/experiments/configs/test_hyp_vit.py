"""The Hyp-ViT configs (hyp_vit.py, hyp_vit_dino.py): recipe values, the
docstring and results-table rows, two training steps on a tiny copy of each
dataset with a tiny ViT loaded from an exported timm-named checkpoint, and
the launch command's weights placeholder. The tiny-copy helpers and fixtures
are test_paper_configs.py's."""

import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import models
from circle_jax.models import vit_weights
from circle_jax.train import config_checks
from circle_jax.train import loop
from experiments.configs import hyp_vit
from tests.experiments.configs import recipe_checks
from experiments.configs import hyp_vit_dino
from tests.experiments.configs.test_paper_configs import TABLES
from tests.experiments.configs.test_paper_configs import _shrink  # pylint: disable=protected-access
from tests.experiments.configs.test_paper_configs import _words  # pylint: disable=protected-access
from tests.experiments.configs.test_paper_configs import tiny_datasets  # noqa: F401  pylint: disable=unused-import

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = [pytest.mark.slow,
              pytest.mark.usefixtures("module_compilation_cache")]

MODULES = {"hyp_vit.py": hyp_vit, "hyp_vit_dino.py": hyp_vit_dino}
PAIRS = [(f, d) for f, m in MODULES.items() for d in m.DATASETS]
IDS = [f"{f[:-3]}:{d}" for f, d in PAIRS]
# The official code's README: (classes, per class, epochs) and steps.
EXPECTED = {"cub200": (100, 9, 50), "cars196": (98, 9, 300),
            "sop": (450, 2, 5000), "inshop": (450, 2, 3200)}


@pytest.mark.parametrize("config_file, dataset", PAIRS, ids=IDS)
def test_config_has_the_official_code_recipe(config_file, dataset):
  module = MODULES[config_file]
  c = module.get_config(dataset)
  c.dataset.manual_dir = "/data"
  config_checks.check_config(c, device_count=2, process_count=1)
  dino = config_file == "hyp_vit_dino.py"
  assert (c.model.name, c.model.embedding_dim, c.model.dtype) == (
      "vit_s16", 128, "bfloat16")
  k = c.model.kwargs
  assert (k.family, k.image_size, k.pool, k.frozen_patch_embed) == (
      "dino" if dino else "augreg", 224, "cls", True)
  # The family's normalisation, not the dataset's BN-Inception default.
  assert c.dataset.preprocess.preset == ("imagenet" if dino else "inception")
  assert tuple(c.dataset.preprocess.scale) == (0.2, 1.0)
  assert c.dataset.preprocess.resize_size == (256 if dataset == "cub200"
                                              else 224)
  o = c.optim
  assert (o.name, o.learning_rate, o.weight_decay, o.grad_clip_norm,
          o.schedule) == ("adamw", 1e-5 if dino else 3e-5, 0.01, 3.0,
                          "constant")
  classes, per_class, steps = EXPECTED[dataset]
  assert (c.batch.sampler, c.batch.classes_per_batch,
          c.batch.images_per_class) == ("pk", classes, per_class)
  if dataset in ("sop", "inshop"):
    assert c.num_train_steps == steps
  else:
    assert c.num_train_steps == steps  # one step per epoch
  assert (c.dataset.validation_fraction, c.best_metric) == (0.0, "")
  # The paper's loss: train.py's --t 0.2 --hyp_c 0.1 --clip_r 2.3.
  recipe_checks.assert_loss_recipe(c.loss, {
      "name": "pairwise_ce", "tau": 0.2, "geometry": "poincare", "c": 0.1,
      "r": 2.3, "block_size": None, "collective": None})


@pytest.mark.parametrize("config_file, dataset", PAIRS, ids=IDS)
def test_docstring_and_table_give_the_command_weights_and_number(
    config_file, dataset):
  module = MODULES[config_file]
  command = hyp_vit.launch_command(config_file, dataset, module.TIMM_MODEL)
  assert _words(command) in _words(module.__doc__)
  assert f"create_model('{module.TIMM_MODEL}', pretrained=True" in (
      module.__doc__)
  assert "pairwise_ce" in module.__doc__ and "hyperbolic" in module.__doc__
  rows = [line for line in TABLES.read_text().splitlines()
          if f"`{command}`" in line]
  assert len(rows) == 1
  r1 = module.PUBLISHED[dataset]["recall@1"]
  assert f"R@1: {r1:.1f}" in rows[0] and f"{r1:.1f}" in module.__doc__
  assert module.TIMM_MODEL in rows[0] and "not on this machine" in rows[0]


def test_unknown_dataset():
  with pytest.raises(ValueError, match=re.escape("hyp_vit_dino.py")):
    hyp_vit_dino.get_config("mnist")


def _export_tiny_vit(path, c):
  """A timm-named .npz checkpoint for the config's (shrunk) backbone."""
  backbone = models.get_model(c.model.name, embedding_dim=8,
                              **dict(c.model.kwargs)).backbone
  size = backbone.pos_grid * backbone.patch_size
  params = flax.traverse_util.flatten_dict(backbone.init(
      jax.random.PRNGKey(3), jnp.zeros((1, size, size, 3)),
      train=False)["params"])
  sd = {}
  for p, v in params.items():
    key, perm = vit_weights._timm_name(p)  # pylint: disable=protected-access
    v = np.asarray(v) + 0.01
    sd[key] = v.transpose(np.argsort(perm)) if perm else v
  np.savez(path, **sd)
  return sd


@pytest.mark.parametrize("config_file, dataset",
                         [("hyp_vit.py", "cub200"), ("hyp_vit_dino.py", "sop")])
def test_two_training_steps_from_exported_weights(config_file, dataset,
                                                  tiny_datasets, tmp_path):  # noqa: F811
  c = _shrink(MODULES[config_file].get_config(dataset),
              *tiny_datasets[dataset], backbone="config")
  c.model.kwargs.depth = 1
  c.model.kwargs.width = 32
  c.model.kwargs.num_heads = 2
  c.model.kwargs.image_size = 64
  c.model.dtype = "float32"
  sd = _export_tiny_vit(tmp_path / "vit.npz", c)
  c.model.pretrained = str(tmp_path / "vit.npz")
  c.checkpoint_every_steps = 2
  result = loop.train_and_evaluate(c, str(tmp_path / "run"))
  assert result["step"] == 2 and result["result"]["selection"] == "last"
  assert np.isfinite(result["result"]["test"]["map@r"])
  # The patch embedding is frozen: still the exported weights after 2 steps
  # (up to AdamW's decoupled decay, lr * wd = 3e-7 per step).
  from circle_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  ckpts = ckpt_lib.Checkpoints(str(tmp_path / "run" / "checkpoints"))
  state = ckpts.restore()[0]
  ckpts.close()
  kernel = np.asarray(
      state["params"]["model"]["backbone"]["patch_embed"]["kernel"])
  np.testing.assert_allclose(
      kernel, sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
      rtol=1e-5)
