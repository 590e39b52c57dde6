"""The Potential Field DML config (potential_field.py): the recipe values
(Hyp-ViT's ViT-S/16 recipe at 384-d with the PFML loss), the docstring and
results-table rows, and two training steps on a tiny copy of CUB with a
tiny ViT. The tiny-copy helpers and fixtures are test_paper_configs.py's."""

import re

import numpy as np
import pytest

from circle_jax.train import config_checks
from circle_jax.train import loop
from experiments.configs import hyp_vit
from experiments.configs import potential_field
from tests.experiments.configs import recipe_checks
from tests.experiments.configs.test_paper_configs import TABLES
from tests.experiments.configs.test_paper_configs import _shrink  # pylint: disable=protected-access
from tests.experiments.configs.test_paper_configs import _words  # pylint: disable=protected-access
from tests.experiments.configs.test_paper_configs import tiny_datasets  # noqa: F401  pylint: disable=unused-import

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = [pytest.mark.slow,
              pytest.mark.usefixtures("module_compilation_cache")]


@pytest.mark.parametrize("dataset", potential_field.DATASETS)
def test_config_is_hyp_vits_recipe_at_384_with_the_pfml_loss(dataset):
  c = potential_field.get_config(dataset)
  c.dataset.manual_dir = "/data"
  config_checks.check_config(c, device_count=2, process_count=1)
  assert (c.model.name, c.model.embedding_dim) == ("vit_s16", 384)
  assert c.model.kwargs.family == "augreg"
  assert (c.optim.name, c.optim.learning_rate) == ("adamw", 3e-5)
  assert c.optim.lr_multipliers.loss == 100.0
  assert c.batch.sampler == "pk"
  recipe_checks.assert_loss_recipe(c.loss, {
      "name": "potential_field", "alpha": 1.0, "delta": 0.5,
      "lambda_rep": 1.0, "lambda_proxy": 1.0})


@pytest.mark.parametrize("dataset", potential_field.DATASETS)
def test_docstring_and_table_give_the_command_and_number(dataset):
  command = hyp_vit.launch_command(potential_field.CONFIG_FILE, dataset,
                                   potential_field.TIMM_MODEL)
  assert _words(command) in _words(potential_field.__doc__)
  rows = [line for line in TABLES.read_text().splitlines()
          if f"`{command}`" in line]
  assert len(rows) == 1
  r1 = potential_field.PUBLISHED[dataset]["recall@1"]
  assert f"R@1: {r1:.1f}" in rows[0] and f"{r1:.1f}" in (
      potential_field.__doc__)
  assert "project page" in rows[0] and "not on this machine" in rows[0]


def test_unknown_dataset():
  with pytest.raises(ValueError, match=re.escape("potential_field.py")):
    potential_field.get_config("inshop")


def test_two_training_steps(tiny_datasets, tmp_path):  # noqa: F811
  c = recipe_checks.tiny_vit(_shrink(
      potential_field.get_config("cub200"), *tiny_datasets["cub200"],
      backbone="config"), 8)
  result = loop.train_and_evaluate(c, str(tmp_path / "run"))
  assert result["step"] == 2 and result["result"]["selection"] == "last"
  assert np.isfinite(result["result"]["test"]["map@r"])
