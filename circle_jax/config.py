"""The fields of every training config, with their defaults (written once).

Config files start from :func:`base_config` and override what they need;
every field can also be overridden on the command line (``--config.x.y=v``,
:func:`DEFINE_config_file`). The config is locked: setting a field that does
not exist (``config.optim.learing_rate = 1e-3`` in a config file, or
``--config.optim.learing_rate=1e-3``) is an error naming the field and the
close matches. The free-form sections ``dataset.preprocess`` (preset
overrides) and ``model.kwargs`` (model constructor arguments) accept new
keys in config files.

``config.loss`` is :func:`loss_config`: the loss ``name`` and *every*
hyperparameter of that loss, at its paper default unless the config sets it
(the keyword arguments of ``circle_jax.losses.get_loss(name).apply``). On the
command line, ``--config.loss.name=NAME`` swaps in the whole section of loss
``NAME`` (its own defaults), and ``--config.loss.<hyper>=v`` then sets any of
them, in whatever order the flags come (:func:`switch_loss`). Likewise
``--config.model.name=NAME`` replaces the file's options of its own model
(``model.kwargs``, ``model.pretrained``) by the new model's defaults
(:func:`switch_model`).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import sys
import typing
from typing import Any, Callable, Dict, List, Optional, Sequence

from absl import flags
import ml_collections
from ml_collections.config_dict import placeholder
from ml_collections.config_flags import config_flags

from circle_jax import losses as losses_lib
from circle_jax import models as models_lib
from circle_jax import parallel
from circle_jax.errors import UserError

# The class-matrix layout of the proxy and classifier losses is
# circle_jax.losses.class_shard.Layout; a loss's config holds the fields of it
# that the loss takes (loss_config), but these, which the trainer sets itself:
# the class count (dataset.num_classes, or the dataset's) and the step's key.
LAYOUT_SET_BY_TRAINER = ("num_classes", "key")

# Sections whose keys are free (constructor / preset keyword arguments).
OPEN_SECTIONS = ("dataset.preprocess", "model.kwargs")

PARALLELISM = parallel.MODES


class ConfigFieldError(UserError, ValueError):
  """A config file or override names a field the schema does not have."""


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
      raise AttributeError(self._unknown(name)) from None

  def __setattr__(self, name, value):
    value = self._as_section(name, value)
    try:
      super().__setattr__(name, value)
    except AttributeError:
      if not self.is_locked or name in self._fields:
        raise
      raise AttributeError(self._unknown(name)) from None

  def __setitem__(self, key, value):
    if self.is_locked and key not in self._fields:
      raise KeyError(self._unknown(key))
    super().__setitem__(key, self._as_section(key, value))

  def _as_section(self, name, value):
    """A plain ConfigDict given for one of our sections (the command line's
    ``--config.model.kwargs='{}'``) becomes a section of the same kind."""
    current = self._fields.get(name) if "_fields" in self.__dict__ else None
    if (isinstance(current, Config) and not isinstance(value, Config)
        and isinstance(value, (dict, ml_collections.ConfigDict))):
      section = Config(dict(value))
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
  takes, but :data:`LAYOUT_SET_BY_TRAINER` (empty for a loss without a class
  matrix)."""
  takes = inspect.signature(entry.fn).parameters
  return {f.name: f.default
          for f in dataclasses.fields(losses_lib.class_shard.Layout)
          if f.name in takes and f.name not in LAYOUT_SET_BY_TRAINER}


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
  fields = {**entry.defaults, **entry.geometry_defaults(),
            **class_layout_defaults(entry)}
  unknown = sorted(set(hyper) - set(fields) - set(options))
  if unknown:
    raise ValueError(
        f"loss {name!r} has no hyperparameter(s) {unknown}; it accepts "
        f"{sorted(fields) + list(options)}.")
  c = Config()
  c.name = name
  for k, v in fields.items():
    c[k] = hyper.get(k, v)
  for o, kind in options.items():
    c[o] = hyper.get(o, placeholder(kind))
  _set_paths(c, "config.loss")
  return c.lock()


def base_config() -> ml_collections.ConfigDict:
  """Every field of a training config with its default (locked)."""
  c = Config()
  c.seed = 0                       # init, batches and loss keys

  c.dataset = Config()
  c.dataset.name = "digits"        # a circle_jax.data.DATASETS name
  c.dataset.data_dir = ""          # prepared ArrayRecords; "" -> $TFDS_DATA_DIR
  c.dataset.manual_dir = ""        # folder with the official archives
  c.dataset.num_classes = placeholder(int)  # loss param. rows; None: dataset's
  c.dataset.preprocess = Config()  # preset overrides
  # Side of the (square) images the model sees; None: the dataset's. Here so
  # that the command line can set it (--config.dataset.preprocess.image_size).
  c.dataset.preprocess.image_size = placeholder(int)
  c.dataset.num_workers = 0        # grain worker processes (0: in process)
  # Model selection: hold out this fraction of the *train* classes as a
  # class-disjoint validation split; `best_metric` then picks the step on it
  # and the test numbers of that step are the result. 0: no validation split
  # (best_metric then selects on the test split, and the results say so).
  c.dataset.validation_fraction = 0.0
  c.dataset.validation_seed = 0    # which classes are held out
  # "class": hold out classes of every train superclass; "superclass": hold
  # out whole superclasses (Omniglot: alphabets), so that validation, like the
  # test, is on superclasses never trained on (circle_jax.data.splits).
  c.dataset.validation_by = "class"
  c.dataset.num_threads = 4        # decoding threads of the data pipeline
  # Rotation classes (circle_jax.data.RotatedClasses): each *trained* class
  # becomes this many classes, rotated by multiples of 360/rotations degrees
  # (1, 2 or 4; 1: off). Validation and test classes stay upright.
  c.dataset.rotations = 1
  # Mirror classes: each trained class's left-right mirror image (and that of
  # each rotation) is a new class too, doubling the trained classes.
  c.dataset.mirror_classes = False

  c.model = Config()
  c.model.name = "conv4"           # a circle_jax.models.MODELS name
  c.model.embedding_dim = 64       # D
  c.model.pooling = "avg"          # backbone pooling: "avg", "max", "avg+max", "flatten"
  c.model.freeze_bn = False        # BatchNorm in inference mode while training
  c.model.sync_bn = False          # BatchNorm statistics over the global batch
  c.model.dtype = "float32"        # or "bfloat16" (compute dtype)
  c.model.pretrained = ""          # .h5/.keras (resnet), .pth/.npz (bn_inception)
  c.model.kwargs = Config()  # more model arguments

  c.loss = loss_config("circle")   # name + every hyperparameter (see above)

  c.batch = Config()
  c.batch.sampler = "pk"           # "pk": P classes x K images; "random";
  # "views": P images x K augmented views, each image its own label
  c.batch.classes_per_batch = 8    # P (the global batch is P x K) ...
  c.batch.images_per_class = 4     # ... K
  c.batch.size = 0                 # global batch of the random sampler
  c.batch.eval_batch_size = 256    # global batch of the evaluation
  # GradCache (circle_jax.train.gradcache): embed each device's slice of the
  # batch this many images at a time, keeping no activations, and re-run each
  # chunk's forward pass in the backward pass. 0: off (the whole slice).
  c.batch.embed_chunk_size = 0
  # BatchNorm in training mode with chunks: "exact" refuses it (use
  # model.freeze_bn); "per_chunk" normalises each chunk with its own
  # statistics and averages the chunks' running-statistics updates.
  c.batch.embed_chunk_bn = "exact"

  c.optim = optim_config()         # the optimiser (its defaults below)

  # Cross-batch memory (XBM; Wang et al., CVPR 2020; circle_jax.train.xbm):
  # a FIFO of the last `size` train embeddings that every anchor also meets,
  # loss = L(batch, batch) + weight * L(batch, memory). Pair losses only.
  c.xbm = Config()
  c.xbm.size = 0                   # M rows, a multiple of the global batch (0: off)
  c.xbm.start_step = 0             # first step that enqueues (warm-up before)
  c.xbm.weight = 1.0               # weight of the memory term
  c.xbm.dtype = "float32"          # storage of the rows: float32 or bfloat16

  c.num_train_steps = 1000         # optimiser updates
  c.log_every_steps = 50           # train scalars (0: 50)
  c.eval_every_steps = 500         # periodic evaluations (0: at the end only)
  c.checkpoint_every_steps = 500   # latest checkpoints (0: at the end only)
  c.eval_at_init = True            # evaluate the untrained model (step 0)
  c.eval_ks = placeholder(tuple)   # Recall@K's K; None: the dataset's
  c.eval_clustering = True         # NMI / AMI of k-means
  # Test-time augmentation: every evaluation image is also embedded shifted
  # by this many pixels up, down, left and right, and the 5 unit embeddings
  # averaged (circle_jax.evaluation.embedding.model_apply). 0: off.
  c.eval_shift = 0
  # Episodic few-shot classification at every evaluation, next to retrieval
  # (circle_jax.evaluation.fewshot; metrics fewshot_{N}way_{K}shot and
  # fewshot_{N}way_{K}shot_ci95 for each N of `ways` and K of `shots`).
  c.fewshot = Config()
  c.fewshot.ways = ()              # N of each setting, e.g. (5, 20); (): off
  c.fewshot.shots = (1, 5)         # K of each setting
  c.fewshot.queries = 15           # most query images per class (Q)
  c.fewshot.episodes = 1000        # E, episodes per setting
  c.fewshot.seed = 0               # the episodes drawn
  c.fewshot.classifier = "prototype"  # "prototype" (Snell et al.) or "nn"
  c.best_metric = "recall@1"       # selects the best step ("" : none)
  c.best_mode = "max"              # or "min"
  c.async_checkpoints = True       # write checkpoints in the background
  c.parallelism = "shard_map"      # one of PARALLELISM ("none": one device)
  # JAX's persistent compilation cache of the command-line jobs (a second
  # run loads its compiled steps): None: $XDG_CACHE_HOME/circle_jax/...
  # (circle_jax.hostenv.enable_compilation_cache); "" or "off": off.
  c.compilation_cache_dir = placeholder(str)
  return lock(c)


def optim_config() -> ml_collections.ConfigDict:
  """``config.optim``: the keyword arguments of
  :func:`circle_jax.train.optim.make_optimizer` (but ``num_train_steps``,
  from ``config.num_train_steps``), whose signature defaults are read from
  here."""
  c = Config()
  c.name = "adam"            # adam, adamw, sgd, rmsprop
  c.learning_rate = 1e-3     # base learning rate
  c.weight_decay = 0.0       # L2 (sgd/adam/rmsprop) or decoupled (adamw)
  c.lr_multipliers = Config(    # per parameter group
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
  try:
    c.loss = loss_config(**loss)
    c.update(saved)
  except (KeyError, AttributeError, TypeError, ValueError) as e:
    first = str(e).strip("'\"").splitlines()[0]
    raise SavedConfigError(
        f"{source} does not fit this version's config fields ({first[:200]});"
        " it was written by another version of circle_jax: start fresh with "
        "another --workdir.") from None
  return c


# ----------------------------------------------------------------------------
# The --config flag, with loss switching.
# ----------------------------------------------------------------------------


def _flag_values(argv: Sequence[str], name: str) -> List[str]:
  """Values of ``--name=v`` / ``--name v`` in ``argv``, in order."""
  out = []
  for i, arg in enumerate(argv):
    m = re.fullmatch(rf"--?{re.escape(name)}(=(.*))?", arg)
    if not m:
      continue
    if m.group(1) is not None:
      out.append(m.group(2))
    elif i + 1 < len(argv):
      out.append(argv[i + 1])
  return out


def _overridden_fields(argv: Sequence[str], prefix: str) -> List[str]:
  """Field names ``f`` of ``--prefix.f[=...]`` flags in ``argv``."""
  out = []
  for arg in argv:
    m = re.match(rf"--?(?:no)?{re.escape(prefix)}\.([^=.]+)(=|$)", arg)
    if m and m.group(1) not in out:
      out.append(m.group(1))
  return out


def _switched_name(config, argv: Sequence[str], flag_name: str, section: str,
                   registry) -> Optional[str]:
  """The ``--<flag>.<section>.name`` of ``argv`` if it names another entry
  of ``registry`` than the config file (else None).

  Raises:
    ValueError: the name is not in ``registry`` (the message lists it).
  """
  plural = {"loss": "losses"}.get(section, section + "s")
  names = _flag_values(argv, f"{flag_name}.{section}.name")
  if not names or names[-1] == config[section].get("name"):
    return None
  if names[-1] not in registry:
    raise ValueError(
        f"config.{section}.name: unknown {section} {names[-1]!r}; known "
        f"{plural}: {', '.join(sorted(registry))}.")
  return names[-1]


def switch_loss(config: ml_collections.ConfigDict, argv: Sequence[str],
                flag_name: str = "config") -> ml_collections.ConfigDict:
  """Applies ``--<flag>.loss.name`` of ``argv`` to ``config`` (in place).

  When the command line names another loss, the whole ``config.loss``
  section is replaced by that loss's own (:func:`loss_config`, its paper
  defaults) *before* the overrides are applied, so
  ``--config.loss.name=multi_similarity --config.loss.beta=40`` trains
  Multi-Similarity with ``alpha=2, beta=40, base=0.5, epsilon=0.1`` in
  either flag order. Without ``--config.loss.name`` (or with the file's own
  loss name) the file's loss values are kept.

  Args:
    config: the config returned by the config file's ``get_config``.
    argv: the command line.
    flag_name: the config flag's name.

  Returns:
    ``config``.

  Raises:
    ValueError: an unknown loss name, or a ``--<flag>.loss.<field>``
      override that the selected loss does not have (the message lists the
      ones it has).
  """
  if not isinstance(config, ml_collections.ConfigDict) or "loss" not in config:
    return config
  name = _switched_name(config, argv, flag_name, "loss", losses_lib.LOSSES)
  if name is not None:
    with config.unlocked():
      config.loss = loss_config(name)
  fields = [f for f in config.loss.keys() if f != "name"]
  for field in _overridden_fields(argv, f"{flag_name}.loss"):
    if field != "name" and field not in config.loss:
      raise ValueError(
          f"config.loss.{field}: loss {config.loss.get('name')!r} has no "
          f"hyperparameter {field!r}; it accepts {sorted(fields)} "
          f"(--{flag_name}.loss.name=NAME selects another loss).")
  return config


# The model fields that belong to one model: switching the model on the
# command line drops the config file's values (the new model's defaults).
MODEL_OWN_FIELDS = ("kwargs", "pretrained")


def switch_model(config: ml_collections.ConfigDict, argv: Sequence[str],
                 flag_name: str = "config") -> ml_collections.ConfigDict:
  """Applies ``--<flag>.model.name`` of ``argv`` to ``config`` (in place).

  As for the loss (:func:`switch_loss`): when the command line names another
  model than the config file, the file's options of its own model
  (``model.kwargs``, e.g. conv4's ``width``, and ``model.pretrained``) are
  replaced by the new model's (its backbone's options at their defaults,
  :func:`circle_jax.models.backbone_defaults`; no weights file) before the
  overrides are applied, and ``--config.model.kwargs.<option>=v`` or
  ``--config.model.pretrained=FILE`` then set them, in any flag order. The
  fields every model has (``embedding_dim``, ``pooling``, ``dtype``, ...)
  are kept.

  Returns:
    ``config``.
  """
  if not isinstance(config, ml_collections.ConfigDict) or "model" not in config:
    return config
  name = _switched_name(config, argv, flag_name, "model", models_lib.MODELS)
  if name is not None:
    with config.unlocked():
      config.model.kwargs = Config(models_lib.backbone_defaults(name))
      config.model.pretrained = ""
    lock(config)
  return config


# pylint: disable=protected-access
class _Flag(config_flags._ConfigFlag):
  """Reports an unknown field (in the file or an override) in one line.

  On the command line it is a flag error; in the default config file, parsed
  when the flag is defined, it is raised as a :class:`ConfigFieldError` when
  the value is read (a tool's main prints it as one line).
  """

  _error = None

  def _parse(self, argument):
    try:
      return super()._parse(argument)
    except AttributeError as e:
      raise flags.IllegalFlagValueError(str(e).splitlines()[0]) from None

  def _set_default(self, value):
    try:
      super()._set_default(value)
    except flags.IllegalFlagValueError as e:
      self._error = ConfigFieldError(str(e).splitlines()[0])
      self.default = None
      self.default_as_str = repr(value)

  @property
  def value(self):
    if self._value is None and self._error is not None:
      raise self._error
    return self._value

  @value.setter
  def value(self, value):
    self._value = value
# pylint: enable=protected-access


class _Parser(config_flags.ConfigFileFlagParser):
  """Loads the config file, then switches the loss section."""

  def __init__(self, name: str, argv: Callable[[], Sequence[str]]):
    super().__init__(name=name, lock_config=True)
    self._argv = argv

  def parse(self, path):
    config = super().parse(path)
    config = switch_loss(config, self._argv(), self.name)
    return switch_model(config, self._argv(), self.name)


def DEFINE_config_file(  # pylint: disable=invalid-name
    name: str, default: Optional[str] = None, help_string: str = "",
    flag_values: flags.FlagValues = flags.FLAGS,
    sys_argv: Optional[Sequence[str]] = None) -> flags.FlagHolder:
  """``config_flags.DEFINE_config_file`` with :func:`switch_loss` and
  :func:`switch_model`.

  ``--config=FILE`` or ``FILE:ARG``, then ``--config.a.b=value`` overrides.

  Args:
    name: the flag's name (``config``).
    default: default config file.
    help_string: the flag's help.
    flag_values: where to define it.
    sys_argv: the command line to read overrides from (default: sys.argv, as
      ml_collections does).

  Returns:
    The flag holder; ``.value`` is the locked ConfigDict.
  """
  def argv():
    args = sys.argv if sys_argv is None else sys_argv
    return flags.FLAGS.read_flags_from_files(list(args), force_gnu=False)

  flag = _Flag(
      parser=_Parser(name, argv), serializer=flags.ArgumentSerializer(),
      name=name, default=default,
      help_string=help_string or "Training config file (FILE or FILE:ARG).",
      flag_values=flag_values, sys_argv=sys_argv)
  return flags.DEFINE_flag(flag, flag_values)
