"""experiments/configs/omniglot_fewshot.py: what the recipe trains and reports."""

from circle_jax import data
from circle_jax.train import config_checks
from circle_jax.train import run as run_lib
from experiments.configs import omniglot_fewshot


def test_recipe_is_valid_and_trains_rotation_classes():
  c = omniglot_fewshot.get_config()
  config_checks.check_config(c, device_count=1)
  info = data.get_dataset_info(c.dataset.name)
  assert c.dataset.name == "omniglot_small"
  # 136 characters, 27 held out for selection, 109 x 4 rotations trained.
  assert config_checks.num_classes(c, info) == 436
  assert run_lib.train_preprocess(c, info).preset == "grayscale_affine"
  assert run_lib.train_preprocess(c, info).affine_shift > 0
  # Evaluation images are not distorted: the plain grayscale output.
  ev = run_lib.eval_preprocess(c, info)
  assert not ev.train and ev.output_shape == (28, 28, 1)
  assert tuple(c.fewshot.ways) == (5, 20) and tuple(c.fewshot.shots) == (1, 5)
  assert c.best_metric == "fewshot_20way_1shot"
  assert "python -m experiments.main --config experiments/configs/" \
      "omniglot_fewshot.py" in omniglot_fewshot.__doc__
