"""The fields of every training config, with their defaults.

Config files build on :func:`base_config` and override what they need; every
field can also be overridden on the command line (``--config.x.y=value``).

``config.loss`` is :func:`loss_config`: the loss ``name`` and *every*
hyperparameter of that loss, at its paper default unless the config file sets
it (they are the keyword arguments of
``circle_jax.losses.get_loss(name).apply``). On the command line,
``--config.loss.name=NAME`` swaps in the whole section of loss ``NAME`` (its
own defaults), and ``--config.loss.<hyper>=v`` then sets any of them, in
whatever order the flags come (``experiments/config_flag.py``).
"""

import ml_collections

from circle_jax import losses as losses_lib

# Execution options a loss may accept besides its hyperparameters: they change
# how the loss is computed (memory), not its value. None = the loss's default.
EXECUTION_OPTIONS = ("block_size",)


def loss_config(name: str = "circle", **hyper) -> ml_collections.ConfigDict:
  """``config.loss`` for the registered loss ``name``.

  Args:
    name: a ``circle_jax.losses.LOSSES`` name.
    **hyper: hyperparameters that differ from the loss's defaults.

  Returns:
    A ConfigDict with ``name``, every hyperparameter of the loss (its
    registry default, i.e. the paper's, unless given in ``hyper``) and, for
    losses that can be computed blockwise, ``block_size`` (None: the dense
    ``[B, B]`` computation).

  Raises:
    ValueError: unknown loss or hyperparameter, naming the accepted ones.
  """
  entry = losses_lib.get_loss(name)
  options = [o for o in EXECUTION_OPTIONS if o in entry.execution_options]
  unknown = sorted(set(hyper) - set(entry.defaults) - set(options))
  if unknown:
    raise ValueError(
        f"loss {name!r} has no hyperparameter(s) {unknown}; it accepts "
        f"{sorted(entry.defaults) + options}.")
  c = ml_collections.ConfigDict()
  c.name = name
  for k, v in entry.defaults.items():
    c[k] = hyper.get(k, v)
  for o in options:
    c[o] = hyper.get(o, ml_collections.config_dict.placeholder(int))
  return c


def base_config() -> ml_collections.ConfigDict:
  """Every field of a training config with its default."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.dataset = ml_collections.ConfigDict()
  c.dataset.name = "digits"
  c.dataset.data_dir = ""          # prepared ArrayRecords; "" -> $TFDS_DATA_DIR
  c.dataset.manual_dir = ""        # folder with the official archives
  c.dataset.num_classes = ml_collections.config_dict.placeholder(int)
  c.dataset.preprocess = ml_collections.ConfigDict()  # preset overrides
  c.dataset.num_workers = 0
  # Model selection: hold out this fraction of the *train* classes as a
  # class-disjoint validation split; `best_metric` then picks the step on it
  # and the test numbers of that step are the result. 0: no validation split
  # (best_metric then selects on the test split, and the results say so).
  c.dataset.validation_fraction = 0.0
  c.dataset.validation_seed = 0    # which classes are held out
  c.dataset.num_threads = 4

  c.model = ml_collections.ConfigDict()
  c.model.name = "conv4"
  c.model.embedding_dim = 64
  c.model.pooling = "avg"
  c.model.freeze_bn = False
  c.model.sync_bn = False          # BatchNorm statistics over the global batch
  c.model.dtype = "float32"
  c.model.pretrained = ""          # .h5/.keras (resnet) or .pth/.npz (bn_inception)
  c.model.kwargs = ml_collections.ConfigDict()

  c.loss = loss_config("circle")

  c.batch = ml_collections.ConfigDict()
  c.batch.sampler = "pk"           # "pk": P classes x K images; "random"
  c.batch.classes_per_batch = 8    # P (the global batch is P x K) ...
  c.batch.images_per_class = 4     # ... K
  c.batch.size = 0                 # global batch of the random sampler
  c.batch.eval_batch_size = 256

  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adam"
  c.optim.learning_rate = 1e-3
  c.optim.weight_decay = 0.0
  c.optim.lr_multipliers = ml_collections.ConfigDict(
      {"backbone": 1.0, "head": 1.0, "loss": 1.0})
  c.optim.freeze_backbone_steps = 0
  c.optim.schedule = "constant"
  c.optim.lr_warmup_steps = 0
  c.optim.decay_every_steps = 0
  c.optim.decay_factor = 0.1
  c.optim.cosine_final_fraction = 0.0
  c.optim.grad_clip_norm = 0.0
  c.optim.grad_clip_value = 0.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8
  c.optim.momentum = 0.0
  c.optim.nesterov = False
  c.optim.rms_decay = 0.99

  c.num_train_steps = 1000
  c.log_every_steps = 50
  c.eval_every_steps = 500
  c.checkpoint_every_steps = 500
  c.eval_at_init = True
  c.eval_ks = ml_collections.config_dict.placeholder(tuple)  # None: dataset's
  c.eval_clustering = True
  c.best_metric = "recall@1"
  c.best_mode = "max"
  c.async_checkpoints = True
  c.parallelism = "shard_map"      # or "pmap", "none" (one device)
  return c
