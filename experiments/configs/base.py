"""The fields of every training config, with their defaults.

Config files build on :func:`base_config` and override what they need; every
field can also be overridden on the command line (``--config.x.y=value``).
Loss hyperparameters live in ``config.loss`` next to its ``name`` (they are
the keyword arguments of ``circle_jax.losses.get_loss(name).apply``).
"""

import ml_collections


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

  c.loss = ml_collections.ConfigDict()
  c.loss.name = "circle"

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
