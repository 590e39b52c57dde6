"""Checks a training config before anything is built, naming the bad field.

:func:`check_config` runs in :func:`circle_jax.train.loop.train_and_evaluate`
before any data is read or any model is compiled, so a typo fails in a second
with a message such as ``config.loss.name: unknown loss 'circel'; known
losses: ...``.
"""

from __future__ import annotations

import math
import re
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from circle_jax import config_facts as facts
from circle_jax import data as data_lib
from circle_jax.evaluation import fewshot as fewshot_lib
from circle_jax.evaluation import retrieval as eval_retrieval
from circle_jax.errors import ConfigError
from circle_jax import models as models_lib
from circle_jax.train import loss_checks
from circle_jax.train import optim as optim_lib
from circle_jax import parallel

def _fail(field: str, message: str):
  raise ConfigError(f"config.{field}: {message}")


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _check_fewshot(config, info, held_out: int) -> None:
  """``config.fewshot``: positive ints, a known classifier, and ``N`` ways
  that the test split (and the validation split) have classes for."""
  fs = config.fewshot
  for field, low in (("ways", 2), ("shots", 1)):
    values = fs[field]
    if not isinstance(values, (tuple, list)) or not all(
        _is_int(v) and v >= low for v in values):
      _fail(f"fewshot.{field}", f"must be a tuple of ints >= {low}, e.g. "
            f"(5, 20); got {values!r}.")
  if not fs.ways:
    return
  if not fs.shots:
    _fail("fewshot.shots", "is empty but fewshot.ways is set; give the K of "
          "each setting, e.g. (1, 5).")
  for field in ("queries", "episodes"):
    if not _is_int(fs[field]) or fs[field] < 1:
      _fail(f"fewshot.{field}", f"must be a positive int; got {fs[field]!r}.")
  if not _is_int(fs.seed):
    _fail("fewshot.seed", f"must be an int; got {fs.seed!r}.")
  if fs.classifier not in fewshot_lib.CLASSIFIERS:
    _fail("fewshot.classifier", f"must be one of {fewshot_lib.CLASSIFIERS}; "
          f"got {fs.classifier!r}.")
  splits = [("test", info.num_test_classes)]
  if held_out:
    splits.append(("validation", held_out))
  for split, classes in splits:
    if max(fs.ways) > classes:
      _fail("fewshot.ways", f"{max(fs.ways)}-way episodes but the {split} "
            f"split of {info.name!r} has {classes} classes; lower it.")


def _check_finite(config) -> None:
  """Every float field is a finite number (NaN and inf are never meant)."""
  def walk(tree, prefix):
    for key, value in tree.items():
      field = f"{prefix}{key}"
      if hasattr(value, "items"):
        walk(value, field + ".")
      elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
          if isinstance(v, float) and not math.isfinite(v):
            _fail(f"{field}[{i}]", f"must be a finite number; got {v}.")
      elif isinstance(value, float) and not math.isfinite(value):
        _fail(field, f"must be a finite number; got {value}.")
  walk(config, "")


def _check_xbm(config, entry, batch: int, device_count: int) -> None:
  """``config.xbm``: the cross-batch memory (:mod:`circle_jax.train.xbm`)."""
  size = config.xbm.size
  if isinstance(size, bool) or not isinstance(size, int) or size < 0:
    _fail("xbm.size", f"must be an int >= 0 (0: no memory); got {size!r}.")
  start = config.xbm.start_step
  if isinstance(start, bool) or not isinstance(start, int) or start < 0:
    _fail("xbm.start_step", f"must be an int >= 0; got {start!r}.")
  weight = config.xbm.weight
  if isinstance(weight, bool) or not isinstance(weight, (int, float)) or (
      weight < 0):
    _fail("xbm.weight", f"must be a number >= 0; got {weight!r}.")
  if config.xbm.dtype not in ("float32", "bfloat16"):
    _fail("xbm.dtype", "must be 'float32' or 'bfloat16'; got "
          f"{config.xbm.dtype!r}.")
  if not size:
    return
  if not entry.supports_ref:
    _fail("xbm.size", f"loss {entry.name!r} ({entry.kind}) does not compare "
          "embeddings with reference embeddings, so it cannot use a memory: "
          "set it to 0 or choose a pair loss.")
  if size % batch:
    _fail("xbm.size", f"must be a multiple of the global batch {batch} (each "
          f"of the {device_count} devices then holds a whole number of its "
          f"{batch // device_count}-row batch slices); got {size}.")


def _check_embed_chunks(config, local_batch: int) -> None:
  """``batch.embed_chunk_size`` divides the per-device batch, and BatchNorm in
  training mode is only chunked when ``batch.embed_chunk_bn`` opts in."""
  chunk = config.batch.embed_chunk_size
  mode = config.batch.embed_chunk_bn
  if mode not in ("exact", "per_chunk"):
    _fail("batch.embed_chunk_bn", f"must be 'exact' or 'per_chunk'; got "
          f"{mode!r}.")
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
    _fail("batch.embed_chunk_size", f"must be an int >= 0 (0: off); got "
          f"{chunk!r}.")
  if not chunk:
    return
  if local_batch % chunk:
    divisors = [d for d in range(1, local_batch + 1) if local_batch % d == 0]
    _fail("batch.embed_chunk_size", f"{chunk} does not divide the per-device "
          f"batch of {local_batch} images; use one of {divisors}.")
  if mode == "exact" and not config.model.freeze_bn and _has_batch_norm(
      config):
    _fail("batch.embed_chunk_size", f"chunks change BatchNorm's batch "
          f"statistics, so model {config.model.name!r} in training mode is "
          "not computed exactly; set --config.model.freeze_bn=True, or accept "
          "per-chunk statistics with --config.batch.embed_chunk_bn=per_chunk.")


def _has_batch_norm(config) -> bool:
  """Whether the config's model has BatchNorm statistics (its initialisation
  traced on one 224 x 224 RGB image, which every backbone accepts; not run)."""
  model = models_lib.get_model(
      config.model.name, embedding_dim=config.model.embedding_dim,
      pooling=config.model.pooling, **dict(config.model.kwargs))
  variables = jax.eval_shape(lambda: model.init(
      jax.random.PRNGKey(0), jnp.zeros((1, 224, 224, 3)), train=False))
  return bool(variables.get("batch_stats"))


def _check_dataset(config) -> Tuple[object, int]:
  """``config.dataset``: a known dataset, its files, the validation split,
  rotations and preprocessing. Returns ``(dataset info, held-out classes)``."""
  name = config.dataset.name
  if name not in data_lib.DATASETS:
    _fail("dataset.name", f"unknown dataset {name!r}; known datasets: "
          f"{', '.join(sorted(data_lib.DATASETS))}.")
  info = data_lib.get_dataset_info(name)
  if info.needs_files and not (config.dataset.manual_dir
                               or config.dataset.data_dir):
    _fail("dataset.manual_dir", f"dataset {name!r} is read from its official "
          "files; set --config.dataset.manual_dir to the folder holding them.")
  fraction = config.dataset.validation_fraction
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
    _fail("dataset.validation_fraction", f"must be a number in [0, 1); got "
          f"{fraction!r}.")
  by = config.dataset.validation_by
  if by not in facts.VALIDATION_BY:
    _fail("dataset.validation_by", f"must be one of {facts.VALIDATION_BY}; "
          f"got {by!r}.")
  if by == "superclass" and not info.train_superclasses:
    _fail("dataset.validation_by", f"dataset {name!r} declares no "
          "superclasses of its train classes (DatasetSpec.train_superclasses)"
          "; use 'class'.")
  try:
    held_out = facts.num_holdout_classes(config, info)
  except ValueError:  # one line naming the numbers and the fields
    check_train_classes(config, info, info.num_train_classes)
    raise
  rotations = config.dataset.rotations
  if isinstance(rotations, bool) or rotations not in data_lib.ROTATIONS:
    _fail("dataset.rotations", f"must be one of {data_lib.ROTATIONS} "
          f"(rotations by multiples of 90 degrees; 1: off); got {rotations!r}.")
  try:
    facts.train_preprocess(config, info)
  except (TypeError, ValueError) as e:
    _fail("dataset.preprocess", f"{str(e).rstrip('.')} (the arguments of "
          "circle_jax.data.get_preprocess).")
  return info, held_out


def _check_model(config, info) -> None:
  """``config.model``: a known model, its embedding size and dtype.

  ``info`` (the dataset's spec) is there for the checks that pair the model
  with the dataset's images."""
  if config.model.name not in models_lib.MODELS:
    _fail("model.name", f"unknown model {config.model.name!r}; known "
          f"models: {', '.join(sorted(models_lib.MODELS))}.")
  dim = config.model.embedding_dim
  if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
    _fail("model.embedding_dim", f"must be a positive int; got {dim!r}.")
  if config.model.dtype not in ("float32", "bfloat16"):
    _fail("model.dtype", "must be 'float32' or 'bfloat16'; got "
          f"{config.model.dtype!r}.")
  # the model's options, and the images it gets
  for preprocess in (facts.train_preprocess, facts.eval_preprocess):
    size = preprocess(config, info).image_size
    problem = models_lib.check_input(config.model.name,
                                     dict(config.model.kwargs), (size, size))
    if problem:
      _fail(*problem)


def _check_num_classes(config, info) -> None:
  """``dataset.num_classes`` is at most the classes the data has."""
  n = config.dataset.num_classes
  has = facts.data_classes(config, info)
  if _is_int(n) and n > has:
    _fail("dataset.num_classes", f"{n!r} classes, but {info.name!r} trains "
          f"on {has} (after the validation hold-out, rotations and mirror "
          "classes): unset it to use the data's count.")


def _check_placement(config) -> parallel.Placement:
  """``config.parallelism``: a known mode. Returns its placement."""
  try:
    return parallel.from_config(config)
  except ValueError:
    _fail("parallelism", f"unknown mode {config.parallelism!r}; use one of "
          f"{parallel.MODES}.")


# Losses of two views per image in consecutive rows
# (circle_jax.losses.vicreg): the 'views' sampler with two views, or P x K
# with an even K.
TWO_VIEW_LOSSES = ("vicreg",)


def _check_sampler(config, info, held_out: int, entry) -> None:
  """``config.batch``'s sampler: a random batch of at least 2, ``P``
  classes the train split has times ``K`` images (2 or more for a pair
  loss), or ``P`` images times ``K >= 2`` views for a pair loss."""
  name = config.dataset.name
  sampler = config.batch.sampler
  if sampler not in ("pk", "random", "views", "hierarchical"):
    _fail("batch.sampler", f"must be 'pk', 'random', 'views' or "
          f"'hierarchical'; got {sampler!r}.")
  if sampler == "hierarchical":
    _check_hierarchical(config, info)
  if sampler == "views" and (entry.kind != "pair"
                             or entry.param_name is not None):
    _fail("batch.sampler", f"'views' labels each image by its own index "
          f"(its views are its only positives), which only a pair loss can "
          f"train; {entry.name!r} is a {entry.kind} loss: use sampler 'pk'.")
  k = config.batch.images_per_class
  if entry.name in TWO_VIEW_LOSSES and not (
      (sampler == "views" and k == 2)
      or (sampler == "pk" and isinstance(k, int) and k % 2 == 0)):
    _fail("batch.sampler", f"{entry.name!r} takes two views of each image "
          f"in consecutive rows: use batch.sampler='views' with "
          f"batch.images_per_class=2 (two augmentations of an image), or "
          f"'pk' with an even images_per_class (two images of a class).")
  if sampler == "random":
    size = config.batch.size
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
      _fail("batch.size", f"the random sampler needs a global batch size >= 2;"
            f" got {size!r}.")
    return
  p = config.batch.classes_per_batch
  k = config.batch.images_per_class
  for field, v in (("classes_per_batch", p), ("images_per_class", k)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      _fail(f"batch.{field}", f"must be a positive int; got {v!r}.")
  if sampler == "views":
    if k < 2:
      _fail("batch.images_per_class", f"the 'views' sampler needs at least 2 "
            f"views per image (its positives); got {k}.")
    return
  del name
  _check_batch_classes(config, info, info.num_train_classes, held_out)
  if entry.kind == "pair" and k < 2:
    _fail("batch.images_per_class", f"pair loss {entry.name!r} needs "
          f"positive pairs: use at least 2 images per class; got {k}.")


def _check_hierarchical(config, info) -> None:
  """The hierarchical sampler needs declared super-classes, and ``P`` a
  multiple of ``S`` (what each super-class holds is checked when the
  sampler is built from the train split)."""
  if not info.train_superclasses and not info.super_labels:
    _fail("batch.sampler", f"'hierarchical' draws each batch's classes from "
          f"super-classes, which {info.name!r} does not declare "
          f"(DatasetSpec.train_superclasses or records' super_label); use "
          f"'pk'.")
  p, s = config.batch.classes_per_batch, config.batch.super_classes_per_batch
  for field, v in (("super_classes_per_batch", s),
                   ("batches_per_super_tuple",
                    config.batch.batches_per_super_tuple)):
    if not _is_int(v) or v < 1:
      _fail(f"batch.{field}", f"must be a positive int; got {v!r}.")
  if _is_int(p) and p % s:
    _fail("batch.classes_per_batch", f"{p} classes per batch do not split "
          f"over batch.super_classes_per_batch={s} super-classes; make it a "
          f"multiple of {s}.")


def _check_batch_classes(config, info, num_classes: int, held_out: int,
                         where: str = "") -> None:
  """The P x K sampler's ``P`` classes are at most those left to train on
  after the validation hold-out (times the rotated copies)."""
  if config.batch.sampler != "pk":
    return
  p = config.batch.classes_per_batch
  kept = (num_classes - held_out) * facts.class_copies(config)
  if p <= kept:
    return
  fraction = config.dataset.validation_fraction
  held = (f", {held_out} of them held out for validation "
          f"(dataset.validation_fraction={fraction})" if held_out else "")
  _fail("batch.classes_per_batch", f"{p} classes per batch, but "
        f"{info.name!r}{where} has {num_classes} train classes{held}, "
        f"leaving {kept} to train on: lower batch.classes_per_batch to at "
        f"most {kept}"
        + (" or dataset.validation_fraction (0: no hold-out)" if held_out
           else "") + ".")


def check_train_classes(config, info, num_classes: int,
                        where: str = "") -> None:
  """Checks the validation hold-out and the batch against the classes the
  train split really has (a partial copy of a dataset has fewer than
  :class:`circle_jax.data.DatasetSpec` says, which :func:`check_config`
  assumes). Called once the split is read
  (:func:`circle_jax.train.run.load_sources`), before anything is built.

  Args:
    config: the run's config.
    info: the dataset's spec.
    num_classes: the train split's classes.
    where: how messages name the copy (e.g. " (as read from manual_dir
      '...')").

  Raises:
    ConfigError: one line naming the numbers and the fields to change.
  """
  fraction = config.dataset.validation_fraction
  superclasses = facts.validation_superclasses(config, info)
  if superclasses and sum(superclasses) != num_classes:
    _fail("dataset.validation_by", f"{info.name!r}{where} has {num_classes} "
          f"train classes, not the {sum(superclasses)} of its declared "
          "superclasses (a partial copy): use --config.dataset.validation_by"
          "=class.")
  try:
    held_out = data_lib.num_holdout_classes(
        num_classes, fraction, config.dataset.validation_seed,
        superclasses=superclasses)
  except ValueError as e:
    if superclasses:
      _fail("dataset.validation_fraction", f"{str(e).rstrip('.')} "
            f"({info.name!r}{where}).")
    held = max(2, int(round(fraction * num_classes)))
    _fail("dataset.validation_fraction", f"{fraction} holds out {held} of the "
          f"{num_classes} train classes of {info.name!r}{where} and leaves "
          f"{max(num_classes - held, 0)} to train on; both sides need at "
          "least 2 classes: set dataset.validation_fraction=0 (no hold-out)"
          + (" or lower it" if num_classes >= 4 else "") + ".")
  _check_batch_classes(config, info, num_classes, held_out, where)


def _check_devices(config, device_count: int, process_count: int) -> int:
  """The global train and evaluation batches split evenly over the devices
  and processes. Returns the global train batch."""
  batch = facts.global_batch_size(config)
  if batch % device_count:
    what = (f"size = {batch}" if config.batch.sampler == "random" else
            f"classes_per_batch x images_per_class = "
            f"{config.batch.classes_per_batch} x "
            f"{config.batch.images_per_class} = {batch}")
    _fail("batch", f"the global batch {what} is not divisible by the "
          f"{device_count} devices; change it (or use fewer devices).")
  if batch % process_count:
    _fail("batch", f"the global batch {batch} is not divisible by the "
          f"{process_count} processes.")
  return batch


def _check_eval_batch(config, device_count: int, process_count: int) -> None:
  eval_batch = config.batch.eval_batch_size
  if (not isinstance(eval_batch, int) or eval_batch < 1
      or eval_batch % device_count or eval_batch % process_count):
    _fail("batch.eval_batch_size", f"must be a positive multiple of the "
          f"{device_count} devices; got {eval_batch!r}.")


def _check_steps(config) -> None:
  """The step count and the cadences (evaluation, checkpoints, logs)."""
  steps = config.num_train_steps
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    _fail("num_train_steps", f"must be a positive int; got {steps!r}.")
  for field in ("eval_every_steps", "checkpoint_every_steps",
                "log_every_steps"):
    v = config[field]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
      _fail(field, f"must be an int >= 0 (0 disables); got {v!r}.")


def check_eval_shift(shift, size: int, *, name: str = "config.eval_shift"
                     ) -> None:
  """Checks a test-time shift (``config.eval_shift``) for ``size`` px
  evaluation images: an int in ``[0, (size - 1) // 2]``, so that every
  shifted view keeps more than half the image.

  Args:
    shift: the shift in pixels (0: off).
    size: the evaluation image's side in pixels.
    name: what the message calls the value (a config field or a flag).

  Raises:
    ConfigError: one line naming ``name``, the allowed range and the value.
  """
  if (isinstance(shift, bool) or not isinstance(shift, int) or shift < 0
      or 2 * shift >= size):
    raise ConfigError(
        f"{name}: must be an int in [0, {(size - 1) // 2}] (pixels of the "
        f"{size} px evaluation image; 0: off); got {shift!r}.")


def check_oneshot(oneshot, size: int, *, name: str = "config.oneshot"
                  ) -> None:
  """Checks ``config.oneshot`` (alignment in the one-shot tools) for
  ``size`` px evaluation images: ``align`` a bool, ``align_shift`` as
  :func:`check_eval_shift`, ``align_angles`` a non-empty tuple of degrees in
  ``[-45, 45]`` (the views are small motions, not the rotation classes).

  Raises:
    ConfigError: one line naming the field, the allowed values and the value.
  """
  if not isinstance(oneshot.align, bool):
    raise ConfigError(f"{name}.align: must be True or False; got "
                      f"{oneshot.align!r}.")
  check_eval_shift(oneshot.align_shift, size, name=f"{name}.align_shift")
  angles = oneshot.align_angles
  if (not isinstance(angles, (tuple, list)) or not angles
      or not all(isinstance(a, (int, float)) and not isinstance(a, bool)
                 and -45 <= a <= 45 for a in angles)):
    raise ConfigError(
        f"{name}.align_angles: must be a non-empty tuple of degrees in "
        f"[-45, 45], e.g. (-10.0, 0.0, 10.0); got {angles!r}.")


def _check_evaluation(config, info, held_out: int) -> None:
  """The test-time shift, the one-shot alignment, the few-shot settings and
  the selection metric."""
  size = facts.eval_preprocess(config, info).image_size
  check_eval_shift(config.eval_shift, size)
  check_oneshot(config.oneshot, size)
  ks = tuple(config.eval_ks or info.ks)
  _check_fewshot(config, info, held_out)
  metrics = facts.retrieval_metrics(config)
  unknown = [m for m in metrics if m not in eval_retrieval.METRICS]
  if unknown:
    _fail("eval_metrics", f"must be a tuple of {list(eval_retrieval.METRICS)}"
          f" (Recall@K comes from eval_ks); got {config.eval_metrics!r}.")
  names = facts.metric_names(ks, config.eval_clustering, config.fewshot,
                             metrics)
  best = config.best_metric
  if best and best not in names:
    _fail("best_metric", f"{best!r} is not computed; choose one of {names}.")


def _check_optimiser(config) -> None:
  """``config.optim``: builds the optimiser once to validate every field."""
  try:
    optim_lib.optimizer_from_config(config.optim,
                                    num_train_steps=config.num_train_steps)
  except TypeError as e:
    _fail("optim", f"unknown or bad field: {e}.")
  except ValueError as e:
    raise ConfigError(re.sub(r"`optim\.(\w+)`", r"config.optim.\1", str(e))
                      ) from None


def check_config(config, *, device_count: Optional[int] = None,
                 process_count: Optional[int] = None) -> None:
  """Raises :class:`ConfigError` naming the first invalid field.

  The sections are checked in order: dataset, model, loss, placement,
  batch and devices, cross-batch memory, embedding chunks, steps,
  evaluation, optimiser.

  Args:
    config: the ``ml_collections.ConfigDict`` of a run.
    device_count: devices the step runs on (default: those of the config's
      placement, :mod:`circle_jax.parallel`).
    process_count: processes (default ``jax.process_count()``).
  """
  for field in ("dataset", "model", "loss", "batch", "optim"):
    if field not in config:
      _fail(field, "missing section.")
  _check_finite(config)
  info, held_out = _check_dataset(config)
  _check_num_classes(config, info)
  _check_model(config, info)
  entry = loss_checks.check_loss(config, info)
  loss_checks.check_more_losses(config, info)
  placement = _check_placement(config)
  loss_checks.check_class_layout(config, placement)
  _check_sampler(config, info, held_out, entry)
  if device_count is None:
    device_count = placement.num_devices
  if process_count is None:
    process_count = jax.process_count()
  batch = _check_devices(config, device_count, process_count)
  _check_xbm(config, entry, batch, device_count)
  _check_eval_batch(config, device_count, process_count)
  _check_embed_chunks(config, batch // device_count)
  _check_steps(config)
  _check_evaluation(config, info, held_out)
  _check_optimiser(config)
