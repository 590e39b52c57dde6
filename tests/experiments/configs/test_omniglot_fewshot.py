"""experiments/configs/omniglot_fewshot.py: what the recipe trains and reports."""

import pytest

from circle_jax import data
from circle_jax import config as config_lib
from circle_jax import config_facts
from circle_jax.train import config_checks
from experiments.configs import omniglot_fewshot

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


def test_recipe_is_valid_and_trains_rotation_and_mirror_classes():
  c = omniglot_fewshot.get_config()
  config_checks.check_config(c, device_count=1)
  info = data.get_dataset_info(c.dataset.name)
  assert c.dataset.name == "omniglot_small"
  # All 136 characters (the recipe was chosen on a held-out alphabet
  # before), each in 4 rotations x 2 mirror images.
  assert c.dataset.validation_fraction == 0.0 and c.best_metric == ""
  assert config_facts.num_classes(c, info) == 136 * 8
  assert c.model.pooling == "flatten"
  assert config_facts.train_preprocess(c, info).preset == "grayscale_affine"
  assert config_facts.train_preprocess(c, info).affine_shift > 0
  # Evaluation images are not distorted: the plain grayscale output.
  ev = config_facts.eval_preprocess(c, info)
  assert not ev.train and ev.output_shape == (28, 28, 1)
  assert tuple(c.fewshot.ways) == (5, 20) and tuple(c.fewshot.shots) == (1, 5)
  assert "python -m experiments.main --config experiments/configs/" \
      "omniglot_fewshot.py" in omniglot_fewshot.__doc__


def test_the_selection_variant_holds_out_one_whole_alphabet():
  c = omniglot_fewshot.get_config("selection")
  config_checks.check_config(c, device_count=1)
  info = data.get_dataset_info(c.dataset.name)
  assert c.dataset.validation_by == "superclass"
  assert c.best_metric == "fewshot_20way_1shot"
  held = config_facts.num_holdout_classes(c, info)
  assert held == 22 == info.train_superclasses[1]   # Early_Aramaic
  assert config_facts.num_classes(c, info) == (136 - held) * 8
  # The recipe itself is unchanged by the variant but for the selection.
  base = omniglot_fewshot.get_config()
  for field in ("optim", "batch", "loss"):
    assert c[field].to_dict() == base[field].to_dict()
  assert c.model.kwargs.num_blocks == 4  # conv4's default, made settable
  del c.model.kwargs["num_blocks"]
  assert c.model.to_dict() == base.model.to_dict()
  assert c.num_train_steps == base.num_train_steps
  assert c.eval_shift == base.eval_shift == 1
  with pytest.raises(ValueError, match="unknown variant 'x'"):
    omniglot_fewshot.get_config("x")


def test_round3_is_the_previous_recipe():
  """The committed table's runs: 3,300 steps, no evaluation shift, all else
  the recipe's."""
  old, base = omniglot_fewshot.get_config("round3"), omniglot_fewshot.get_config()
  config_checks.check_config(old, device_count=1)
  assert (old.num_train_steps, old.eval_shift) == (3300, 0)
  assert (base.num_train_steps, base.eval_shift) == (8000, 1)
  old.num_train_steps, old.eval_shift = base.num_train_steps, base.eval_shift
  assert old.to_dict() == base.to_dict()


def test_hier_variant_adds_only_hier_to_the_loss():
  """':hier' is the recipe plus HIER as a more_losses term at the paper's
  weight (the comparison's "HIER on Proxy-Anchor" row), nothing else."""
  with_hier = omniglot_fewshot.get_config("hier")
  with_hier.loss = config_lib.loss_config("proxy_anchor")
  config_checks.check_config(with_hier, device_count=1)
  assert set(with_hier.more_losses.keys()) == {"hier"}
  assert with_hier.more_losses.hier.name == "hier"
  assert with_hier.more_losses.hier.weight == 0.5
  base = omniglot_fewshot.get_config()
  base.loss = config_lib.loss_config("proxy_anchor")
  without = with_hier.to_dict()
  without.pop("more_losses")
  expected = base.to_dict()
  assert expected.pop("more_losses") == {}
  assert without == expected


def test_long_variant_changes_only_steps_and_eval_shift():
  """':long' (the official one-shot runs' attempt) is the recipe with
  16,000 steps and a 3 px test-time shift, nothing else, and its command is
  in the docstring."""
  long, base = omniglot_fewshot.get_config("long"), omniglot_fewshot.get_config()
  config_checks.check_config(long, device_count=1)
  assert (long.num_train_steps, long.eval_shift) == (16000, 3)
  long.num_train_steps, long.eval_shift = base.num_train_steps, base.eval_shift
  assert long.to_dict() == base.to_dict()
  assert "omniglot_fewshot.py:long" in omniglot_fewshot.__doc__


def test_aligned_variant_is_long_scored_by_alignment():
  """':aligned' trains exactly as ':long' (its runs resume a finished
  ':long' workdir without training) and sets only config.oneshot.align."""
  aligned = omniglot_fewshot.get_config("aligned")
  long = omniglot_fewshot.get_config("long")
  config_checks.check_config(aligned, device_count=1)
  assert aligned.oneshot.align and not long.oneshot.align
  aligned.oneshot.align = False
  assert aligned.to_dict() == long.to_dict()
  assert "omniglot_fewshot.py:aligned" in omniglot_fewshot.__doc__
