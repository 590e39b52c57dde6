"""Circle loss with conv4 on Omniglot "background small" (CPU scale).

Reads the official archives images_background_small{1,2}.zip, shipped with
the package (circle_jax/data/archives/omniglot_small/; MIT licence)::

  python -m experiments.main --config experiments/configs/omniglot_small.py \
      --workdir /tmp/omniglot_run

Train on the alphabets of the train split, retrieve characters of the unseen
alphabets of the test split (splits: circle_jax.data, docs/data.md).
"""

from circle_jax import config as config_lib


def get_config():
  c = config_lib.base_config()
  c.dataset.name = "omniglot_small"
  # Decode and warp in the loop's own thread: for 28-pixel images the work
  # holds Python's GIL, and decoding threads halve the input's throughput
  # (the omniglot_small rows of `python -m experiments.bench.data`); the
  # batches are the same either way. Worker processes
  # (--config.dataset.num_workers) are what scales it, e.g. on a GPU.
  c.dataset.num_threads = 0
  c.model.name = "conv4"
  c.model.embedding_dim = 64
  c.model.sync_bn = True
  c.loss = config_lib.loss_config("circle", gamma=80.0, margin=0.4)
  c.batch.classes_per_batch = 16
  c.batch.images_per_class = 4
  c.optim.name = "adam"
  c.optim.learning_rate = 1e-3
  c.num_train_steps = 2000
  c.eval_every_steps = 500
  c.checkpoint_every_steps = 500
  return c
