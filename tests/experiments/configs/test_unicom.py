"""The Unicom fine-tuning config (unicom.py): the official scripts' recipe
values, the docstring and results-table rows, and two training steps of the
recipe (its loss, optimiser and sampler) on a tiny copy of SOP with a tiny
ViT. The tiny-copy helpers and fixtures are test_paper_configs.py's."""

import re

import numpy as np
import pytest

from circle_jax.train import config_checks
from circle_jax.train import loop
from experiments.configs import unicom
from tests.experiments.configs import recipe_checks
from tests.experiments.configs.test_paper_configs import TABLES
from tests.experiments.configs.test_paper_configs import _shrink  # pylint: disable=protected-access
from tests.experiments.configs.test_paper_configs import _words  # pylint: disable=protected-access
from tests.experiments.configs.test_paper_configs import tiny_datasets  # noqa: F401  pylint: disable=unused-import

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = [pytest.mark.slow,
              pytest.mark.usefixtures("module_compilation_cache")]

# The scripts: (global batch, epochs) and epochs * (images // batch + 1).
EXPECTED = {"sop": (64, 64 * (59551 // 64 + 1)),
            "inshop": (64, 128 * (25882 // 64 + 1))}


@pytest.mark.parametrize("dataset", unicom.DATASETS)
def test_config_has_the_official_scripts_recipe(dataset):
  c = unicom.get_config(dataset)
  c.dataset.manual_dir = "/data"
  config_checks.check_config(c, device_count=1, process_count=1)
  assert (c.model.name, c.model.embedding_dim) == ("vit_b16", 768)
  assert c.model.kwargs.family == "clip"
  assert c.dataset.preprocess.preset == "clip"
  batch, steps = EXPECTED[dataset]
  assert (c.batch.sampler, c.batch.size) == ("random", batch)
  assert c.num_train_steps == steps
  o = c.optim
  assert (o.name, o.learning_rate, o.weight_decay, o.schedule) == (
      "adamw", 1e-5, 0.0, "cosine")
  assert o.lr_multipliers.loss == 10.0 and o.lr_warmup_steps == steps // 10
  assert (c.dataset.validation_fraction, c.best_metric) == (0.0, "")
  recipe_checks.assert_loss_recipe(c.loss, {
      "name": "subspace_arcface", "scale": 32.0, "margin": 0.25,
      "num_features": 512, "straight_through": True, "sample_rate": 1.0})


@pytest.mark.parametrize("dataset", unicom.DATASETS)
def test_docstring_and_table_give_the_command_and_number(dataset):
  command = unicom.launch_command(dataset)
  assert _words(command) in _words(unicom.__doc__)
  assert f"create_model('{unicom.TIMM_MODEL}', pretrained=True" in (
      unicom.__doc__)
  rows = [line for line in TABLES.read_text().splitlines()
          if f"`{command}`" in line]
  assert len(rows) == 1
  r1 = unicom.PUBLISHED[dataset]["recall@1"]
  assert f"R@1: {r1:.1f}" in rows[0] and f"{r1:.1f}" in unicom.__doc__
  assert "not on this machine" in rows[0]


def test_unknown_dataset():
  with pytest.raises(ValueError, match=re.escape("unicom.py")):
    unicom.get_config("cub200")


def test_two_training_steps_of_the_recipe(tiny_datasets, tmp_path):  # noqa: F811
  c = recipe_checks.tiny_vit(_shrink(
      unicom.get_config("sop"), *tiny_datasets["sop"], backbone="config"), 12)
  c.loss.num_features = 8  # 8 of 12 dimensions per step
  c.optim.lr_warmup_steps = 1
  result = loop.train_and_evaluate(c, str(tmp_path / "run"))
  assert result["step"] == 2 and result["result"]["selection"] == "last"
  assert np.isfinite(result["result"]["test"]["map@r"])
