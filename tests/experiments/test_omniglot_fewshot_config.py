"""experiments/configs/omniglot_fewshot.py: what the recipe trains and reports."""

from circle_jax import data
from circle_jax.train import config_checks
from circle_jax.train import run as run_lib
from experiments.configs import omniglot_fewshot


def test_recipe_is_valid_and_trains_rotation_and_mirror_classes():
  c = omniglot_fewshot.get_config()
  config_checks.check_config(c, device_count=1)
  info = data.get_dataset_info(c.dataset.name)
  assert c.dataset.name == "omniglot_small"
  # All 136 characters (the recipe was chosen on a held-out alphabet
  # before), each in 4 rotations x 2 mirror images.
  assert c.dataset.validation_fraction == 0.0 and c.best_metric == ""
  assert config_checks.num_classes(c, info) == 136 * 8
  assert c.model.pooling == "flatten"
  assert run_lib.train_preprocess(c, info).preset == "grayscale_affine"
  assert run_lib.train_preprocess(c, info).affine_shift > 0
  # Evaluation images are not distorted: the plain grayscale output.
  ev = run_lib.eval_preprocess(c, info)
  assert not ev.train and ev.output_shape == (28, 28, 1)
  assert tuple(c.fewshot.ways) == (5, 20) and tuple(c.fewshot.shots) == (1, 5)
  assert "python -m experiments.main --config experiments/configs/" \
      "omniglot_fewshot.py" in omniglot_fewshot.__doc__


def test_the_selection_protocol_in_the_docstring_is_a_valid_config():
  """The docstring's validation overrides hold out one whole alphabet."""
  c = omniglot_fewshot.get_config()
  for flag in ("validation_fraction=0.2", "validation_by=superclass",
               "best_metric=fewshot_20way_1shot"):
    assert flag in omniglot_fewshot.__doc__.replace("\n", " ")
  c.dataset.validation_fraction = 0.2
  c.dataset.validation_by = "superclass"
  c.best_metric = "fewshot_20way_1shot"
  config_checks.check_config(c, device_count=1)
  info = data.get_dataset_info(c.dataset.name)
  held = config_checks.num_holdout_classes(c, info)
  assert held in info.train_superclasses
  assert config_checks.num_classes(c, info) == (136 - held) * 8
