"""digits.py with a classifier next to the metric loss (PML's
TrainWithClassifier, as ``config.more_losses``: PML's MultipleLosses).

The Circle loss of the batch plus half the NormFace loss of its
class matrix (its own hyperparameters and learnable rows)::

  python -m experiments.main \
      --config experiments/configs/digits_with_classifier.py \
      --workdir /tmp/digits_classifier

Each term's fields are overridable, e.g.
``--config.more_losses.classifier.weight=0.25``.
"""

from circle_jax import config as config_lib
from experiments.configs import digits


def get_config():
  c = digits.get_config()
  c.more_losses.classifier = config_lib.more_loss(
      "normface", weight=0.5)
  return c
