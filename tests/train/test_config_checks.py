"""Bad config values fail before training, naming the field."""

import pytest

from circle_jax import config as config_lib
from circle_jax.train import config_checks
from tests.train import helpers

_config = helpers.digits_config


def test_default_configs_pass():
  config_checks.check_config(helpers.digits_config(), device_count=8,
                             process_count=1)
  config_checks.check_config(helpers.digits_config(), device_count=1,
                             process_count=1)


@pytest.mark.parametrize("overrides, field", [
    ({"loss.name": "circel"}, "config.loss.name: unknown loss 'circel'"),
    ({"dataset.name": "mnist"}, "config.dataset.name: unknown dataset 'mnist'"),
    ({"model.name": "vgg"}, "config.model.name"),
    ({"model.embedding_dim": 0}, "config.model.embedding_dim"),
    ({"batch.images_per_class": 3}, "not divisible by the 8 devices"),
    ({"batch.classes_per_batch": 6}, "config.batch.classes_per_batch"),
    ({"batch.images_per_class": 1, "batch.classes_per_batch": 4,
      "batch.eval_batch_size": 8}, "config.batch.images_per_class"),
    ({"batch.eval_batch_size": 100}, "config.batch.eval_batch_size"),
    ({"parallelism": "ddp"}, "config.parallelism"),
    ({"num_train_steps": 0}, "config.num_train_steps"),
    ({"eval_every_steps": -1}, "config.eval_every_steps"),
    ({"best_metric": "recall@3"}, "config.best_metric"),
    ({"optim.name": "lamb"}, "config.optim.name"),
    ({"dataset.name": "cub200"}, "config.dataset.manual_dir"),
    ({"eval_shift": -1}, "config.eval_shift: must be an int in"),
    ({"eval_shift": 8}, "of the 16 px evaluation image; 0: off); got 8."),
    ({"eval_shift": True}, "config.eval_shift"),
    ({"oneshot.align_shift": 8}, "config.oneshot.align_shift: must be an int "
     "in"),
    ({"oneshot.align_angles": ()}, "config.oneshot.align_angles: must be a "
     "non-empty tuple of degrees in"),
    ({"oneshot.align_angles": (0.0, 90.0)}, "config.oneshot.align_angles"),
    ({"eval_metrics": ("mAP",)}, "config.eval_metrics: must be a tuple of"),
    ({"best_metric": "mean_average_precision"}, "config.best_metric"),
    ({"loss.collective": "rign"}, "config.loss.collective: must be one of "
     "('all_gather', 'ring')"),
])
def test_bad_values_name_the_field(overrides, field):
  c = _config(**overrides)
  with pytest.raises(config_checks.ConfigError, match=field.replace(
      "(", r"\(").replace(")", r"\)")):
    config_checks.check_config(c, device_count=8, process_count=1)


@pytest.mark.parametrize("size, good, bad", [
    (16, (0, 1, 7), (-1, 8, True, 1.0)), (28, (13,), (14,)), (3, (0, 1), (2,)),
    (2, (0,), (1,))])
def test_eval_shift_keeps_more_than_half_the_image(size, good, bad):
  """The one rule of the test-time shift, shared by the config check and
  the one-shot tool's --eval_shift: 2 * shift < size."""
  for shift in good:
    config_checks.check_eval_shift(shift, size)
  for shift in bad:
    with pytest.raises(config_checks.ConfigError, match=(
        rf"^--flag: must be an int in \[0, {(size - 1) // 2}\] \(pixels of "
        rf"the {size} px evaluation image; 0: off\); got {shift!r}\.$")):
      config_checks.check_eval_shift(shift, size, name="--flag")


@pytest.mark.parametrize("path, close", [
    ("loss.gama", "config.loss.gamma"),
    ("optim.lr_multipliers.proxy", "the fields are backbone, head, loss"),
])
def test_unknown_fields_are_refused_when_set(path, close):
  """The schema is locked: a misspelt field fails where it is set."""
  with pytest.raises(AttributeError, match=f"config.{path}: the config does "
                     f"not have this field; .*{close}"):
    section, leaf = path.rsplit(".", 1)
    node = _config()
    for part in section.split("."):
      node = getattr(node, part)
    setattr(node, leaf, 1.0)


def test_batch_must_split_over_processes():
  with pytest.raises(config_checks.ConfigError, match="3 processes"):
    config_checks.check_config(helpers.digits_config(), device_count=1,
                               process_count=3)


# The paper configs (one file per paper) are checked in
# tests/experiments/configs/test_paper_configs.py.


def test_omniglot_small_config_is_valid():
  c = helpers.omniglot_small_config()
  c.dataset.manual_dir = "/data"
  config_checks.check_config(c, device_count=8, process_count=1)


def test_hierarchical_sampler_checks_in_one_line():
  c = helpers.omniglot_small_config(**{
      "batch.sampler": "hierarchical", "batch.classes_per_batch": 8,
      "batch.images_per_class": 2, "dataset.manual_dir": "/data"})
  config_checks.check_config(c, device_count=8, process_count=1)
  for overrides, message in (
      ({"batch.super_classes_per_batch": 3}, "config.batch.classes_per_batch:"
       " 8 classes per batch do not split over"),
      ({"batch.batches_per_super_tuple": 0}, "config.batch.batches_per_super"
       "_tuple: must be a positive int"),
  ):
    with pytest.raises(config_checks.ConfigError, match=message) as e:
      config_checks.check_config(helpers.override(c.copy_and_resolve_references(
      ), **overrides), device_count=8, process_count=1)
    assert "\n" not in str(e.value)
  # digits declares no super-classes.
  with pytest.raises(config_checks.ConfigError, match="config.batch.sampler: "
                     "'hierarchical' draws .* 'digits' does not declare"):
    config_checks.check_config(_config(**{"batch.sampler": "hierarchical"}),
                               device_count=1, process_count=1)


def test_random_sampler_batch_checks():
  c = _config(**{"batch.sampler": "random", "batch.size": 36})
  with pytest.raises(config_checks.ConfigError, match="size = 36"):
    config_checks.check_config(c, device_count=8, process_count=1)
  c.batch.size = 40
  config_checks.check_config(c, device_count=8, process_count=1)


def test_views_sampler_checks():
  """P images x K views: K >= 2 and a pair loss without a class matrix."""
  c = _config(**{"batch.sampler": "views"})
  config_checks.check_config(c, device_count=8, process_count=1)
  c.batch.images_per_class = 1
  c.batch.classes_per_batch = 8
  with pytest.raises(config_checks.ConfigError,
                     match="config.batch.images_per_class: the 'views' "
                     "sampler needs at least 2 views"):
    config_checks.check_config(c, device_count=8, process_count=1)
  c = _config(**{"batch.sampler": "views"})
  c.loss = config_lib.loss_config("proxy_anchor")
  with pytest.raises(config_checks.ConfigError,
                     match="config.batch.sampler: 'views' .*'proxy_anchor' "
                     "is a proxy loss: use sampler 'pk'"):
    config_checks.check_config(c, device_count=8, process_count=1)


@pytest.mark.parametrize("overrides, message", [
    ({"loss.gamma": float("nan")},
     "config.loss.gamma: must be a finite number; got nan."),
    ({"loss.gamma": float("inf")},
     "config.loss.gamma: must be a finite number; got inf."),
    ({"optim.learning_rate": float("nan")},
     "config.optim.learning_rate: must be a finite number; got nan."),
    ({"optim.weight_decay": float("-inf")},
     "config.optim.weight_decay: must be a finite number; got -inf."),
    ({"loss.gamma": -1.0}, "config.loss.gamma: must be in [1e-06, 10000] for "
     "loss 'circle' (see its docstring); got -1.0."),
    ({"loss.gamma": 1e10}, "config.loss.gamma: must be in [1e-06, 10000] for "
     "loss 'circle' (see its docstring); got 10000000000.0."),
    ({"loss.margin": 1.5}, "config.loss.margin: must be in [-1, 1] for loss "
     "'circle' (see its docstring); got 1.5."),
])
def test_float_fields_must_be_finite_and_in_range(overrides, message):
  with pytest.raises(config_checks.ConfigError) as e:
    config_checks.check_config(_config(**overrides), device_count=8,
                               process_count=1)
  assert str(e.value) == message


def test_a_hold_out_that_leaves_a_batch_too_few_classes_is_one_line():
  # digits: 5 train classes, 2 held out at 20 %; a batch of 5 classes.
  c = _config(**{"dataset.validation_fraction": 0.2})
  with pytest.raises(config_checks.ConfigError) as e:
    config_checks.check_config(c, device_count=1, process_count=1)
  assert str(e.value) == (
      "config.batch.classes_per_batch: 5 classes per batch, but 'digits' has "
      "5 train classes, 2 of them held out for validation "
      "(dataset.validation_fraction=0.2), leaving 3 to train on: lower "
      "batch.classes_per_batch to at most 3 or dataset.validation_fraction "
      "(0: no hold-out).")
  c.batch.classes_per_batch = 3
  config_checks.check_config(c, device_count=1, process_count=1)


def test_the_classes_a_partial_copy_really_has_are_checked():
  from circle_jax import data  # pylint: disable=g-import-not-at-top
  info = data.get_dataset_info("cub200")
  c = _config(**{"dataset.name": "cub200", "dataset.manual_dir": "/m",
                 "dataset.validation_fraction": 0.2,
                 "batch.classes_per_batch": 4})
  config_checks.check_config(c, device_count=1, process_count=1)  # 100
  where = " (as read from manual_dir '/m')"
  with pytest.raises(config_checks.ConfigError) as e:
    config_checks.check_train_classes(c, info, 2, where)
  assert str(e.value) == (
      "config.dataset.validation_fraction: 0.2 holds out 2 of the 2 train "
      "classes of 'cub200' (as read from manual_dir '/m') and leaves 0 to "
      "train on; both sides need at least 2 classes: set "
      "dataset.validation_fraction=0 (no hold-out).")
  with pytest.raises(config_checks.ConfigError) as e:
    config_checks.check_train_classes(c, info, 5, where)
  assert str(e.value) == (
      "config.batch.classes_per_batch: 4 classes per batch, but 'cub200' (as "
      "read from manual_dir '/m') has 5 train classes, 2 of them held out for "
      "validation (dataset.validation_fraction=0.2), leaving 3 to train on: "
      "lower batch.classes_per_batch to at most 3 or "
      "dataset.validation_fraction (0: no hold-out).")
  config_checks.check_train_classes(c, info, 6, where)
  c.dataset.validation_fraction = 0.0
  with pytest.raises(config_checks.ConfigError, match=(
      r"has 3 train classes, leaving 3 to train on: lower "
      r"batch.classes_per_batch to at most 3\.$")):
    config_checks.check_train_classes(c, info, 3, where)


def test_two_view_losses_need_rows_that_pair_up():
  for overrides in ({"batch.sampler": "views", "batch.images_per_class": 2,
                     "batch.classes_per_batch": 8},
                    {"batch.sampler": "pk"}):  # K = 8
    c = _config(**overrides)
    c.loss = config_lib.loss_config("vicreg")
    config_checks.check_config(c, device_count=8, process_count=1)
  for overrides in ({"batch.sampler": "random", "batch.size": 40},
                    {"batch.sampler": "views", "batch.images_per_class": 4},
                    {"batch.sampler": "pk", "batch.images_per_class": 3,
                     "batch.classes_per_batch": 8}):
    c = _config(**overrides)
    c.loss = config_lib.loss_config("vicreg")
    with pytest.raises(config_checks.ConfigError,
                       match="config.batch.sampler: 'vicreg' takes two views"):
      config_checks.check_config(c, device_count=8, process_count=1)
