"""Facts derived from a config: read here, never recomputed elsewhere.

The schema (:mod:`circle_jax.config`) says which fields a run has; this
module says what they imply: how many classes the loss learns a row for, the
loss's keyword arguments, the global batch, the metrics an evaluation
computes. The config checker (:mod:`circle_jax.train.config_checks`), the
trainer and the experiment scripts all ask these functions.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from circle_jax import data as data_lib
from circle_jax.evaluation import fewshot as fewshot_lib
from circle_jax.evaluation import retrieval as retrieval_lib
from circle_jax import losses as losses_lib

RETRIEVAL_METRICS = retrieval_lib.DEFAULT_METRICS
CLUSTERING_METRICS = ("nmi", "ami")
VALIDATION_BY = ("class", "superclass")


def eval_preprocess(config, info):
  """The evaluation preprocessing of ``config.dataset`` on the dataset of
  ``info`` (the preset's deterministic variant)."""
  return info.get_preprocess(train=False, **dict(config.dataset.preprocess))


def train_preprocess(config, info):
  """The training preprocessing (augmentation included) of
  ``config.dataset`` on the dataset of ``info``."""
  return info.get_preprocess(train=True, **dict(config.dataset.preprocess))


def validation_superclasses(config, info) -> Optional[Tuple[int, ...]]:
  """The class counts of the train superclasses that the validation split
  holds out whole (``dataset.validation_by='superclass'``), else None."""
  if config.dataset.validation_by == "superclass":
    return tuple(info.train_superclasses)
  return None


def train_label_superclasses(config, info) -> np.ndarray:
  """The super-class (index into ``info.train_superclasses``) of each label
  the model trains on (``0 .. data_classes - 1``): the classes kept after
  the validation hold-out, renumbered in order, then their rotated (and
  mirrored) copies, each in its class's super-class."""
  counts = tuple(info.train_superclasses)
  of_class = np.repeat(np.arange(len(counts)), counts)
  kept = np.arange(of_class.size)
  if config.dataset.validation_fraction:
    kept = np.setdiff1d(kept, data_lib.holdout_classes(
        of_class.size, config.dataset.validation_fraction,
        config.dataset.validation_seed,
        superclasses=validation_superclasses(config, info)))
  return np.tile(of_class[kept], class_copies(config))


def class_copies(config) -> int:
  """How many classes each trained class becomes: ``dataset.rotations``,
  twice that with ``dataset.mirror_classes``."""
  return data_lib.class_copies(config.dataset.rotations,
                               config.dataset.mirror_classes)


def num_holdout_classes(config, info) -> int:
  """How many train classes the validation split holds out."""
  return data_lib.num_holdout_classes(
      info.num_train_classes, config.dataset.validation_fraction,
      config.dataset.validation_seed,
      superclasses=validation_superclasses(config, info))


def data_classes(config, info) -> int:
  """The classes the model trains on: the dataset's train classes minus
  those held out for validation, times :func:`class_copies`."""
  return (info.num_train_classes - num_holdout_classes(config, info)
          ) * class_copies(config)


def num_classes(config, info) -> Optional[int]:
  """The class count for loss parameters: ``dataset.num_classes``, or
  :func:`data_classes`."""
  n = config.dataset.num_classes
  if n is None and info is not None:
    n = data_classes(config, info)
  return n


def loss_hyper(config) -> dict:
  """The loss's keyword arguments: every ``config.loss`` field but ``name``.

  Unset execution options (``block_size=None``) are left out, so the loss
  uses its own default.
  """
  return {k: v for k, v in config.loss.items()
          if k != "name" and v is not None}


def more_losses(config) -> list:
  """The terms of ``config.more_losses`` (:func:`circle_jax.config.more_loss`)
  as ``[(key, entry, weight, hyper)]``, ``hyper`` as :func:`loss_hyper`."""
  out = []
  for key, section in config.get("more_losses", {}).items():
    hyper = {k: v for k, v in section.items()
             if k not in ("name", "weight", "miner") and v is not None}
    out.append((key, losses_lib.get_loss(section.name), section.weight,
                hyper))
  return out


def more_loss_miners(config) -> dict:
  """``{key: miner}``: each term of ``config.more_losses`` with its own
  miner (its ``miner`` section, :func:`circle_jax.config.miner_config`, as a
  dict; terms mining nothing are left out)."""
  return {key: section.miner.to_dict()
          for key, section in config.get("more_losses", {}).items()
          if section.get("miner") is not None and section.miner.name}


def head_normalizes(config) -> bool:
  """Whether the embedding head L2-normalises: as the loss's geometry says
  (``Geometry.head_normalizes``; the Poincaré ball's exponential map takes
  the raw features); yes for a loss without the geometry option; no where
  a loss of the config maps the raw features itself (``LossEntry.
  raw_features``: HIER in ``config.more_losses``)."""
  if any(e.raw_features for _, e, _, _ in more_losses(config)) or (
      losses_lib.get_loss(config.loss.name).raw_features):
    return False
  name = config.loss.get("geometry", None)
  if name is None:
    return True
  return losses_lib.engine.build_geometry(name, **{
      k: config.loss[k] for k in losses_lib.engine.geometry_fields()
      if config.loss.get(k) is not None}).head_normalizes


def global_batch_size(config) -> int:
  """``P x K`` for the PK sampler, ``batch.size`` for the random sampler."""
  if config.batch.sampler == "random":
    return config.batch.size
  return config.batch.classes_per_batch * config.batch.images_per_class


def retrieval_metrics(config) -> Tuple[str, ...]:
  """The retrieval metrics besides Recall@K: ``config.eval_metrics``, or
  :data:`RETRIEVAL_METRICS`."""
  return tuple(config.get("eval_metrics", None) or RETRIEVAL_METRICS)


def metric_names(ks, clustering: bool, fewshot=None, retrieval=None):
  """The metrics an evaluation computes (``fewshot``: ``config.fewshot``;
  ``retrieval``: :func:`retrieval_metrics`, default
  :data:`RETRIEVAL_METRICS`)."""
  names = [f"recall@{k}" for k in ks] + list(retrieval or RETRIEVAL_METRICS)
  if clustering:
    names += list(CLUSTERING_METRICS)
  if fewshot is not None and fewshot.ways:
    names += list(fewshot_lib.metric_names(fewshot.ways, fewshot.shots))
  return names
