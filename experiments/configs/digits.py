"""Default config: Circle loss, conv4, digits 0-4 -> retrieval on digits 5-9.

Needs no files (scikit-learn's bundled 8x8 digits). The README's main job::

  python -m experiments.main --config experiments/configs/digits.py \
      --workdir /tmp/digits_run

Override any field on the command line, e.g. ``--config.loss.gamma=64
--config.num_train_steps=500`` (loss hyperparameters live in ``config.loss``
next to its name; see experiments/configs/base.py for every field).
"""

from experiments.configs import base


def get_config():
  c = base.base_config()
  c.model.embedding_dim = 32
  c.model.sync_bn = True           # same result on any number of devices
  c.model.kwargs.width = 32
  c.loss.gamma = 80.0
  c.loss.margin = 0.4
  c.batch.classes_per_batch = 5    # every train class (digits 0-4)
  c.batch.images_per_class = 8
  c.optim.learning_rate = 3e-3
  c.num_train_steps = 300
  c.eval_every_steps = 100
  c.checkpoint_every_steps = 100
  return c
