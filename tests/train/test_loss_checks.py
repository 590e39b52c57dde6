"""circle_jax.train.loss_checks: a bad loss section (config.loss,
config.more_losses, the class matrix's layout) fails before training in one
ConfigError line naming the field; good ones pass. Checked through
check_config, as the trainer calls it."""

import pytest

from circle_jax import config as config_lib
from circle_jax.train import config_checks
from tests.train import helpers

_config = helpers.digits_config


def test_proxy_loss_needs_a_class_count():
  c = _config()
  c.loss = config_lib.loss_config("proxy_anchor")
  config_checks.check_config(c, device_count=8, process_count=1)
  c.dataset.num_classes = 0
  with pytest.raises(config_checks.ConfigError,
                     match="config.dataset.num_classes.*proxies"):
    config_checks.check_config(c, device_count=8, process_count=1)


def test_loss_hyperparameters_are_checked_by_the_loss_itself():
  # Any registered loss's own trace-time range check becomes a ConfigError
  # naming the field: here a proxy loss, whose parameters are built too.
  c = _config()
  c.loss = config_lib.loss_config("proxy_anchor", alpha=-3.0)
  c.dataset.num_classes = 5
  with pytest.raises(config_checks.ConfigError,
                     match=r"^config\.loss\.alpha: must be > 0; got -3\.0\.$"):
    config_checks.check_config(c, device_count=8, process_count=1)


@pytest.mark.parametrize("hyper, message", [
    (dict(geometry="sphere"), "config.loss.geometry: must be one of "
     "('cosine', 'dot', 'lp', 'poincare', 'snr'); got 'sphere'."),
    (dict(geometry="poincare", c=0.0), "config.loss.c: must be in [0.0001, "
     "100] for loss 'supcon' (see its docstring); got 0.0."),
    (dict(tau=1e-4), "config.loss.tau: must be in [0.001, 10000] for loss "
     "'supcon' (see its docstring); got 0.0001."),
])
def test_the_geometry_of_a_pair_loss_is_checked_in_one_line(hyper, message):
  c = _config()
  c.loss = config_lib.loss_config("supcon", **hyper)
  with pytest.raises(config_checks.ConfigError) as e:
    config_checks.check_config(c, device_count=8, process_count=1)
  assert str(e.value) == message
  c.loss = config_lib.loss_config("supcon", geometry="poincare")
  config_checks.check_config(c, device_count=8, process_count=1)


def test_reduction_regularizers_and_more_losses_are_checked_in_one_line():
  """Issue 40's loss options: a bad value is one ConfigError line naming
  the field; good ones pass."""
  bad = [
      (dict(reduction="median"), "config.loss.reduction: must be one of"),
      (dict(reduction="class_weighted", reduction_weights=(1.0,)),
       "config.loss.reduction_weights: reduction 'class_weighted' needs one "
       "weight per class"),
      (dict(reduction="sum", block_size=4), "needs the dense engine"),
      (dict(reduction="none"), "config.loss.reduction: 'none' returns"),
      (dict(embedding_regularizer="regular_face"),
       "config.loss.embedding_regularizer: the embeddings regularizer must "
       "be one of ['lp']"),
  ]
  for hyper, message in bad:
    c = _config()
    c.loss = config_lib.loss_config("contrastive", **hyper)
    with pytest.raises(config_checks.ConfigError, match=message[:30]):
      config_checks.check_config(c, device_count=8, process_count=1)
  c = _config()
  c.loss = config_lib.loss_config("contrastive", reduction="threshold",
                                  reduction_low=0.1,
                                  embedding_regularizer="lp")
  c.more_losses.cls = config_lib.more_loss(
      "normface", weight=0.5, weight_regularizer="center_invariant")
  config_checks.check_config(c, device_count=8, process_count=1)
  c.more_losses.cls.scale = -1.0
  with pytest.raises(config_checks.ConfigError,
                     match=r"^config\.more_losses\.cls\.scale"):
    config_checks.check_config(c, device_count=8, process_count=1)
