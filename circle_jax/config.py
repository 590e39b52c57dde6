"""The fields of every training config, with their defaults (written once).

Config files start from :func:`base_config` and override what they need;
every field can also be overridden on the command line (``--config.x.y=v``,
:func:`circle_jax.config_flag.DEFINE_config_file`). The config is locked:
setting a field that does not exist (``config.optim.learing_rate = 1e-3`` in
a config file, or ``--config.optim.learing_rate=1e-3``) is an error naming
the field and the close matches. The free-form sections
``dataset.preprocess`` (preset overrides) and ``model.kwargs`` (model
constructor arguments) accept new keys, in config files and on the command
line.

``config.loss`` is :func:`loss_config`: the loss ``name`` and *every*
hyperparameter of that loss, at its paper default unless the config sets it
(the keyword arguments of ``circle_jax.losses.get_loss(name).apply``). On the
command line, ``--config.loss.name=NAME`` swaps in the whole section of loss
``NAME`` (its own defaults), and ``--config.loss.<hyper>=v`` then sets any of
them, in whatever order the flags come
(:func:`circle_jax.config_flag.switch_loss`). Likewise
``--config.model.name=NAME`` replaces the file's options of its own model
(``model.kwargs``, ``model.pretrained``) by the new model's defaults
(:func:`circle_jax.config_flag.switch_model`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, Dict, Optional

from absl import flags
import ml_collections
from ml_collections.config_dict import FieldReference
from ml_collections.config_dict import placeholder

from circle_jax import losses as losses_lib
from circle_jax import parallel
from circle_jax.errors import UserError

# The class-matrix layout of the proxy and classifier losses is
# circle_jax.losses.class_shard.Layout; a loss's config holds the fields of it
# that the loss takes (loss_config), but these, which the trainer sets itself:
# the class count (dataset.num_classes, or the dataset's) and the step's key.
LAYOUT_SET_BY_TRAINER = ("num_classes", "key")

# Sections whose keys are free (constructor / preset keyword arguments).
OPEN_SECTIONS = ("dataset.preprocess", "model.kwargs", "more_losses")

PARALLELISM = parallel.MODES


class ConfigFieldError(UserError, flags.IllegalFlagValueError,
                       AttributeError):
  """A config file or override names a field the schema does not have (on
  the command line, an absl flag error)."""


class ConfigValueError(UserError, flags.IllegalFlagValueError, ValueError):
  """A ``--config`` override names a loss or model that does not exist, or a
  hyperparameter the selected loss does not have."""


class SavedConfigError(UserError):
  """A saved ``config.json`` does not fit this version's schema."""


class Config(ml_collections.ConfigDict):
  """A ConfigDict whose unknown-field errors are one line naming the field
  (with its path) and the close matches."""

  def __getattr__(self, name):
    try:
      return super().__getattr__(name)
    except AttributeError:
      if name.startswith("__"):
        raise
      raise ConfigFieldError(self._unknown(name)) from None

  def __setattr__(self, name, value):
    if self.is_locked and name not in self._fields:
      raise ConfigFieldError(self._unknown(name))
    super().__setattr__(name, self._as_section(name, value))

  def __setitem__(self, key, value):
    if self.is_locked and key not in self._fields:
      raise ConfigFieldError(self._unknown(key))
    super().__setitem__(key, self._as_section(key, value))

  def _as_section(self, name, value):
    """A plain ConfigDict given for one of our sections (the command line's
    ``--config.model.kwargs='{}'``) becomes a section of the same kind."""
    current = self._fields.get(name) if "_fields" in self.__dict__ else None
    if (isinstance(current, Config) and not isinstance(value, type(current))
        and isinstance(value, (dict, ml_collections.ConfigDict))):
      section = type(current)(dict(value))
      object.__setattr__(section, "_path", current.__dict__.get("_path"))
      if current.is_locked:
        section.lock()
      return section
    return value

  def _unknown(self, name) -> str:
    path = self.__dict__.get("_path", "config")
    fields = sorted(self._fields)
    close = difflib.get_close_matches(name, fields, n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(f'{path}.{c}' for c in close)}?"
            if close else f"the fields are {', '.join(fields)}.")
    return f"{path}.{name}: the config does not have this field; {hint}"


class LossSection(Config):
  """``config.loss`` (:func:`loss_config`): the fields of one loss.

  An item assignment ``section[k] = v`` (what ml_collections does with a
  ``--config.loss.k=v`` override) of a field that this loss lacks but
  another registered loss has is held, not made a field, so that the
  command line may name the loss after its hyperparameters;
  :func:`circle_jax.config_flag.switch_loss` then applies it to the
  selected loss, or refuses it (:attr:`held`). Attribute assignment (a
  config file's ``c.loss.beta = 40``) of a field the loss lacks is an error at
  once.
  """

  def __setitem__(self, key, value):
    if (self.is_locked and key not in self._fields
        and key in _fields_of_every_loss()):
      object.__setattr__(self, "_held", {**self.held, key: value})
      return
    super().__setitem__(key, value)

  @property
  def held(self) -> Dict[str, Any]:
    """The assigned fields of other losses, in order (field -> value)."""
    return dict(self.__dict__.get("_held", {}))


class MultiplierSection(Config):
  """``config.optim.lr_multipliers``: a multiplier per parameter group
  (``backbone``, ``head``, ``loss``) and, added by item, per parameter-path
  prefix: ``c.optim.lr_multipliers["loss/hier"] = 50.0`` in a config file,
  the whole section on the command line (ml_collections cannot parse a
  slash in a field path): ``--config.optim.lr_multipliers="{'loss': 10.0,
  'loss/hier': 50.0}"`` (groups left out get 1). A
  prefix is the slash-joined keys of the ``{'model': ..., 'loss': ...}``
  parameter tree; :func:`circle_jax.train.optim.make_optimizer` gives each
  leaf the multiplier of its longest matching prefix, else its group's.
  Any other unknown name is refused as in every section.
  """

  def __setitem__(self, key, value):
    if self.is_locked and key not in self._fields and "/" in str(key):
      with self.unlocked():
        super().__setitem__(key, value)
      return
    super().__setitem__(key, value)


@functools.lru_cache(maxsize=None)
def _fields_of_every_loss() -> frozenset:
  return frozenset(k for name in losses_lib.LOSSES
                   for k in loss_config(name).keys())


def _set_paths(config, path: str = "config"):
  """Records each section's path for :class:`Config`'s error messages."""
  object.__setattr__(config, "_path", path)
  for key in config.keys():
    value = config[key]
    if isinstance(value, ml_collections.ConfigDict):
      _set_paths(value, f"{path}.{key}")


def class_layout_defaults(entry) -> Dict[str, Any]:
  """The class-matrix options of a loss's config with their defaults: the
  fields of :class:`circle_jax.losses.class_shard.Layout` that the loss
  takes (``entry.layout_options``), but :data:`LAYOUT_SET_BY_TRAINER`
  (empty for a loss without a class matrix)."""
  return {f.name: f.default
          for f in dataclasses.fields(losses_lib.class_shard.Layout)
          if f.name in entry.layout_options
          and f.name not in LAYOUT_SET_BY_TRAINER}


def loss_fields(entry) -> Dict[str, Any]:
  """The fields of a loss's config section with their defaults, but
  ``name`` and the execution options: its hyperparameters (the registry's
  defaults), its geometry option's (``LossEntry.geometry_defaults``),
  its class matrix's (:func:`class_layout_defaults`), its ``reduction``
  option's (unset: the loss's own) and its regularizers'
  (:func:`regularizer_fields`)."""
  return {**entry.defaults, **entry.geometry_defaults(),
          **class_layout_defaults(entry),
          **{k: placeholder(t) for k, t in entry.reduction_fields().items()},
          **regularizer_fields(entry)}


def execution_option_types(entry) -> Dict[str, type]:
  """The execution options of a loss (``entry.execution_options``: they
  change how the loss is computed, not its value) with the type of each,
  read from the engine's signature
  (:func:`circle_jax.losses.engine.embedding_loss`)."""
  hints = typing.get_type_hints(losses_lib.engine.embedding_loss)
  out = {}
  for name in entry.execution_options:
    hint = hints[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    out[name] = args[0] if args else hint
  return out


def _several_types(entry):
  """The hyperparameters annotated with several types (e.g. triplet's
  ``triplets_per_anchor``: ``"all"`` or a number), which a config field
  takes any of."""
  hints = typing.get_type_hints(entry.fn)
  return {k for k, h in hints.items() if typing.get_origin(h) is typing.Union
          and len([a for a in typing.get_args(h) if a is not type(None)]) > 1}


def regularizer_fields(entry) -> Dict[str, Any]:
  """:data:`circle_jax.losses.regularizers.FIELDS` of a loss's config (the
  ``weight_*`` ones only for a loss with a learnable parameter)."""
  return {k: v for k, v in losses_lib.regularizers.FIELDS.items()
          if entry.param_name is not None or not k.startswith("weight_")}


def loss_config(name: str = "circle", **hyper) -> ml_collections.ConfigDict:
  """``config.loss`` for the registered loss ``name`` (locked).

  Args:
    name: a ``circle_jax.losses.LOSSES`` name.
    **hyper: hyperparameters that differ from the loss's defaults.

  Returns:
    A ConfigDict with ``name``, every hyperparameter of the loss (its
    registry default, i.e. the paper's, unless given in ``hyper``) and, for
    losses that can be computed blockwise, ``block_size`` (None: the dense
    ``[B, B]`` computation) and ``collective`` (None: the loss's default,
    an all-gather of the global batch; ``"ring"``: the device ring); for
    pair losses the geometry: ``geometry`` (``"cosine"``, ``"poincare"``;
    ``"dot"`` for N-pair), and the Poincaré ball's curvature ``c`` and
    clipping radius ``r`` (Hyp-ViT's 0.1 and 2.3). With ``"poincare"`` the
    embedding head does not L2-normalise: the ball's exponential map takes
    the raw features. Losses with a class matrix also have
    ``shard_classes`` (the matrix and its optimiser state split by rows over
    the devices, :mod:`circle_jax.train.class_rows`) and ``sample_rate``
    (PartialFC's negative-class sampling rate in (0, 1]; 1: every class),
    with :class:`circle_jax.losses.class_shard.Layout`'s defaults.

  Raises:
    ValueError: unknown loss or hyperparameter, naming the accepted ones.
  """
  entry = losses_lib.get_loss(name)
  options = execution_option_types(entry)
  fields = loss_fields(entry)
  unknown = sorted(set(hyper) - set(fields) - set(options))
  if unknown:
    raise ValueError(
        f"loss {name!r} has no hyperparameter(s) {unknown}; it accepts "
        f"{sorted(fields) + list(options)}.")
  c = LossSection()
  c.name = name
  several = _several_types(entry)
  for k, v in fields.items():
    v = hyper.get(k, v)
    c[k] = FieldReference(v, field_type=object) if k in several else v
  for o, kind in options.items():
    c[o] = hyper.get(o, placeholder(kind))
  _set_paths(c, "config.loss")
  return c.lock()


def more_loss(name: str, weight: float = 1.0, miner: Optional[dict] = None,
              **hyper) -> ml_collections.ConfigDict:
  """A section of ``config.more_losses`` (PML's ``MultipleLosses``):
  :func:`loss_config` of ``name``, its ``weight`` and its own ``miner``
  (:func:`miner_config`; ``name=""``, the default, mines nothing, whatever
  ``config.miner`` is); the step adds ``weight * L`` of the batch
  (docs/training.md)."""
  c = loss_config(name, **hyper).unlock()
  c.weight = float(weight)
  c.miner = miner_config()
  c.miner.update(dict(miner or {}))
  return c.lock()


def miner_config() -> ml_collections.ConfigDict:
  """``config.miner``: ``name``, a ``circle_jax.losses.MINERS`` name (``""``:
  no miner), and every miner's hyperparameters, ``None`` for the selected
  miner's default (``--config.miner.name=hdc
  --config.miner.filter_percentage=0.3``); setting one the miner lacks is an
  error when the step is built."""
  c = Config()
  c.name = ""
  for entry in losses_lib.MINERS.values():
    for field, default in entry.defaults.items():
      kind = tuple if default is None else type(default)
      c[field] = placeholder(kind)
  return c


def base_config() -> ml_collections.ConfigDict:
  """Every field of a training config with its default (locked)."""
  c = Config()
  c.seed = 0                       # init, batches and loss keys

  c.dataset = _dataset_section()   # the data (below)
  c.model = _model_section()       # backbone and head (below)
  c.loss = loss_config("circle")   # name + every hyperparameter (see above)
  c.more_losses = Config()  # key -> more_loss(name, weight, **hyper)
  # A miner's pos_mask / neg_mask for the pair loss (circle_jax.losses.MINERS).
  c.miner = miner_config()

  c.batch = _batch_section()       # sampler and batch sizes (below)

  c.optim = optim_config()         # the optimiser (its defaults below)

  c.xbm = _xbm_section()           # cross-batch memory (below)
  # VPTSP-G's semantic proxies (loss vptsp_proxy_anchor only).
  c.semantic_proxies = semantic_proxies_config()

  c.num_train_steps = 1000         # optimiser updates
  c.log_every_steps = 50           # train scalars (0: 50)
  c.eval_every_steps = 500         # periodic evaluations (0: at the end only)
  c.checkpoint_every_steps = 500   # latest checkpoints (0: at the end only)
  c.eval_at_init = True            # evaluate the untrained model (step 0)
  c.eval_ks = placeholder(tuple)   # Recall@K's K; None: the dataset's
  c.eval_clustering = True         # NMI / AMI of k-means
  # Retrieval metrics besides Recall@K, among circle_jax.evaluation.retrieval
  # .METRICS (e.g. add "mean_reciprocal_rank", "mean_average_precision");
  # None: its DEFAULT_METRICS.
  c.eval_metrics = placeholder(tuple)
  c.eval_avg_of_avgs = False       # per query class first (PML avg_of_avgs)
  # Test-time augmentation: every evaluation image is also embedded shifted
  # by this many pixels up, down, left and right, and the 5 unit embeddings
  # averaged (circle_jax.evaluation.embedding.model_apply). 0: off.
  c.eval_shift = 0
  c.fewshot = _fewshot_section()   # few-shot evaluation (below)
  c.oneshot = _oneshot_section()   # scoring on Omniglot's one-shot runs
  c.best_metric = "recall@1"       # selects the best step ("" : none)
  c.best_mode = "max"              # or "min"
  c.async_checkpoints = True       # write checkpoints in the background
  c.parallelism = "shard_map"      # one of PARALLELISM ("none": one device)
  # JAX's persistent compilation cache of the command-line jobs (a second
  # run loads its compiled steps): None: $XDG_CACHE_HOME/circle_jax/...
  # (circle_jax.hostenv.enable_compilation_cache); "" or "off": off.
  c.compilation_cache_dir = placeholder(str)
  return lock(c)


def _dataset_section() -> ml_collections.ConfigDict:
  """``config.dataset``: which data, its splits and its pipeline."""
  c = Config()
  c.name = "digits"        # a circle_jax.data.DATASETS name
  c.data_dir = ""          # prepared ArrayRecords; "" -> $TFDS_DATA_DIR
  c.manual_dir = ""        # folder with the official archives
  c.num_classes = placeholder(int)  # loss param. rows; None: dataset's
  c.preprocess = Config()  # preset overrides
  # Side of the (square) images the model sees; None: the dataset's. Here so
  # that the command line can set it (--config.dataset.preprocess.image_size).
  c.preprocess.image_size = placeholder(int)
  c.num_workers = 0        # grain worker processes (0: in process)
  # Model selection: hold out this fraction of the *train* classes as a
  # class-disjoint validation split; `best_metric` then picks the step on it
  # and the test numbers of that step are the result. 0: no validation split
  # (best_metric then selects on the test split, and the results say so).
  c.validation_fraction = 0.0
  c.validation_seed = 0    # which classes are held out
  # "class": hold out classes of every train superclass; "superclass": hold
  # out whole superclasses (Omniglot: alphabets), so that validation, like the
  # test, is on superclasses never trained on (circle_jax.data.splits).
  c.validation_by = "class"
  c.num_threads = 4        # decoding threads of the data pipeline
  # Rotation classes (circle_jax.data.RotatedClasses): each *trained* class
  # becomes this many classes, rotated by multiples of 360/rotations degrees
  # (1, 2 or 4; 1: off). Validation and test classes stay upright.
  c.rotations = 1
  # Mirror classes: each trained class's left-right mirror image (and that of
  # each rotation) is a new class too, doubling the trained classes.
  c.mirror_classes = False
  return c


def _model_section() -> ml_collections.ConfigDict:
  """``config.model``: the backbone and the embedding head."""
  c = Config()
  c.name = "conv4"           # a circle_jax.models.MODELS name
  c.embedding_dim = 64       # D
  c.pooling = "avg"          # "avg", "max", "avg+max", "flatten"
  c.freeze_bn = False        # BatchNorm in inference mode while training
  c.sync_bn = False          # BatchNorm statistics over the global batch
  c.dtype = "float32"        # or "bfloat16" (compute dtype)
  c.pretrained = ""          # .h5/.keras (resnet), .pth/.npz (bn_inception)
  c.kwargs = Config()  # more model arguments
  return c


def _batch_section() -> ml_collections.ConfigDict:
  """``config.batch``: the sampler and the batch sizes."""
  c = Config()
  c.sampler = "pk"           # "pk": P classes x K images; "random";
  # "views": P images x K augmented views, each image its own label;
  # "hierarchical": the P classes from S super-classes (PML's
  # HierarchicalSampler; datasets that declare super-classes)
  c.classes_per_batch = 8    # P (the global batch is P x K) ...
  c.images_per_class = 4     # ... K
  c.size = 0                 # global batch of the random sampler
  c.super_classes_per_batch = 2  # S, hierarchical sampler (P/S each)
  c.batches_per_super_tuple = 4  # per S-tuple and epoch, hierarchical
  c.eval_batch_size = 256    # global batch of the evaluation
  # GradCache (circle_jax.train.gradcache): embed each device's slice of the
  # batch this many images at a time, keeping no activations, and re-run each
  # chunk's forward pass in the backward pass. 0: off (the whole slice).
  c.embed_chunk_size = 0
  # BatchNorm in training mode with chunks: "exact" refuses it (use
  # model.freeze_bn); "per_chunk" normalises each chunk with its own
  # statistics and averages the chunks' running-statistics updates.
  c.embed_chunk_bn = "exact"
  return c


def _xbm_section() -> ml_collections.ConfigDict:
  """``config.xbm``: the cross-batch memory (XBM; Wang et al., CVPR 2020;
  :mod:`circle_jax.train.xbm`), a FIFO of the last ``size`` train embeddings
  that every anchor also meets: ``loss = L(batch, batch) + weight *
  L(batch, memory)``. Pair losses only."""
  c = Config()
  c.size = 0                   # M rows, a multiple of the global batch (0: off)
  c.start_step = 0             # first step that enqueues (warm-up before)
  c.weight = 1.0               # weight of the memory term
  c.dtype = "float32"          # storage of the rows: float32 or bfloat16
  return c


def _fewshot_section() -> ml_collections.ConfigDict:
  """``config.fewshot``: episodic few-shot classification at every
  evaluation, next to retrieval (:mod:`circle_jax.evaluation.fewshot`;
  metrics ``fewshot_{N}way_{K}shot`` and ``fewshot_{N}way_{K}shot_ci95`` for
  each N of ``ways`` and K of ``shots``)."""
  c = Config()
  c.ways = ()              # N of each setting, e.g. (5, 20); (): off
  c.shots = (1, 5)         # K of each setting
  c.queries = 15           # most query images per class (Q)
  c.episodes = 1000        # E, episodes per setting
  c.seed = 0               # the episodes drawn
  c.classifier = "prototype"  # "prototype" (Snell et al.) or "nn"
  return c


def _oneshot_section() -> ml_collections.ConfigDict:
  """``config.oneshot``: how the one-shot tools (the official Omniglot runs,
  :mod:`circle_jax.evaluation.omniglot_oneshot`) compare two images with this
  run's model. The trainer does not read it.

  With ``align``, two images are compared by alignment
  (:func:`circle_jax.evaluation.omniglot_oneshot.aligned_similarity`): each
  image's embedding against the best-matching of the other's views rotated
  by ``align_angles`` (degrees) and shifted by up to ``align_shift`` pixels
  (:func:`circle_jax.evaluation.embedding.affine_views`), both ways, averaged.
  Without it: the cosine of the two embeddings."""
  c = Config()
  c.align = False                         # True: compare by alignment
  c.align_shift = 3                       # views: every (dy, dx) in [-3, 3]^2
  c.align_angles = (-10.0, 0.0, 10.0)     # ... under each of these rotations
  return c


def optim_config() -> ml_collections.ConfigDict:
  """``config.optim``: the keyword arguments of
  :func:`circle_jax.train.optim.make_schedule` (but ``num_train_steps``,
  from ``config.num_train_steps``) and of
  :func:`circle_jax.train.optim.make_optimizer`, whose signature defaults
  are read from here (:func:`circle_jax.train.optim.optimizer_from_config`
  passes the schedule to the optimiser)."""
  c = Config()
  c.name = "adam"            # adam, adamw, sgd, rmsprop
  c.learning_rate = 1e-3     # base learning rate
  c.weight_decay = 0.0       # L2 (sgd/adam/rmsprop) or decoupled (adamw)
  c.lr_multipliers = MultiplierSection(  # per group or path prefix
      {"backbone": 1.0, "head": 1.0, "loss": 1.0})
  c.freeze_backbone_steps = 0  # train only head and loss this long
  c.schedule = "constant"    # constant, step, cosine
  c.lr_warmup_steps = 0      # linear warm-up
  c.decay_every_steps = 0    # step schedule: period ...
  c.decay_factor = 0.1       # ... and factor
  c.cosine_final_fraction = 0.0  # cosine: final lr / base lr
  c.grad_clip_norm = 0.0     # clip the global gradient norm (0: off)
  c.grad_clip_value = 0.0    # clip each gradient value (0: off)
  c.b1 = 0.9                 # Adam beta1
  c.b2 = 0.999               # Adam beta2
  c.eps = 1e-8               # Adam / RMSprop epsilon
  c.momentum = 0.0           # SGD / RMSprop momentum
  c.nesterov = False         # SGD Nesterov momentum
  c.rms_decay = 0.99         # RMSprop decay
  return c


def semantic_proxies_config() -> ml_collections.ConfigDict:
  """``config.semantic_proxies``: VPTSP-G's semantic branch (Ren et al.,
  ICLR 2024; :mod:`circle_jax.train.semantic`), used by loss
  ``vptsp_proxy_anchor`` only: class prompts through the ViT, a GRU mix of
  a ``[C, E]`` memory. Defaults: the official CUB config's."""
  c = Config()
  c.num_prompts = 3          # class prompt tokens of the first block
  c.prompt_depth = 12        # blocks that get class prompts
  c.prompt_step = 0          # each next block gets this many fewer
  c.gru = "gru_relu"         # the GRU's candidate: gru_relu or gru (tanh)
  c.dropout = 0.0            # the GRU's dropout (the code's rnn_dropout)
  return c


def lock(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Locks ``config`` except its :data:`OPEN_SECTIONS`; returns it."""
  _set_paths(config)
  config.lock()
  for path in OPEN_SECTIONS:
    node = config
    for part in path.split("."):
      node = node.get(part) if node is not None else None
    if isinstance(node, ml_collections.ConfigDict):
      node.unlock()
  return config


def from_dict(saved: Dict[str, Any], *, source: str = "the saved config"
              ) -> ml_collections.ConfigDict:
  """A config saved as JSON (``config.json``) as a locked ConfigDict.

  Args:
    saved: the JSON structure (``circle_jax.train.workdir.config_to_dict``).
    source: where it comes from, for the error message.

  Raises:
    SavedConfigError: a field this version does not have (one line naming
      it and the fix).
  """
  c = base_config()
  saved = dict(saved)
  loss = dict(saved.pop("loss", {}) or {})
  more = dict(saved.pop("more_losses", {}) or {})
  try:
    c.loss = loss_config(**loss)
    for key, section in more.items():
      c.more_losses[key] = more_loss(**section)
    c.update(saved)
  except (KeyError, AttributeError, TypeError, ValueError) as e:
    first = str(e).strip("'\"").splitlines()[0]
    raise SavedConfigError(
        f"{source} does not fit this version's config fields ({first[:200]});"
        " it was written by another version of circle_jax: start fresh with "
        "another --workdir.") from None
  return c
