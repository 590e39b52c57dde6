"""The checks of a config's loss sections (``config.loss``,
``config.more_losses`` and the class matrix's layout), each failure one
:class:`circle_jax.errors.ConfigError` line naming the field; called by
:func:`circle_jax.train.config_checks.check_config`, which checks the other
sections.
"""

from __future__ import annotations

import re
from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import config as config_lib
from circle_jax import config_facts as facts
from circle_jax.errors import ConfigError
from circle_jax import losses as losses_lib
from circle_jax.losses.engine import COLLECTIVES

# A loss without a class matrix: the layout's defaults (whole, no sampling).
_NO_LAYOUT = losses_lib.class_shard.Layout()


def _fail(field: str, message: str):
  raise ConfigError(f"config.{field}: {message}")


def _check_hyper(entry, hyper: dict, embedding_dim: int,
                      num_classes_: Optional[int],
                      references: bool = False) -> None:
  """Checks the loss's hyperparameters against their documented ranges
  (:func:`circle_jax.losses.hyper_ranges`), then traces the loss once on a
  tiny abstract batch (no compilation, no data), so any other trace-time
  check of the loss becomes a ConfigError naming ``config.loss.<field>``.
  With ``references`` (a cross-batch memory) it traces the loss against
  reference embeddings too."""
  for field, valid in entry.field_ranges().items():
    value = hyper.get(field, {**entry.defaults,
                              **entry.geometry_defaults()}.get(field))
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (
        not valid.contains(value)):
      _fail(f"loss.{field}", f"must be in {valid} for loss {entry.name!r} "
            f"(see its docstring); got {value!r}.")
  x = jax.ShapeDtypeStruct((4, embedding_dim), jnp.float32)
  y = jnp.asarray([0, 0, 1, 1], jnp.int32)
  params = None
  try:
    if entry.param_name is not None:
      params = jax.eval_shape(
          lambda: entry.init_params(jax.random.PRNGKey(0),
                                    max(num_classes_ or 2, 2),
                                    embedding_dim, **hyper))
    jax.eval_shape(lambda e, p: entry.apply(e, y, p,
                                            key=jax.random.PRNGKey(0),
                                            **hyper), x, params)
    if references:
      jax.eval_shape(lambda e, p: entry.apply(
          e, y, p, key=jax.random.PRNGKey(0), ref=losses_lib.Candidates(
              e, y, valid=jnp.ones(4, bool), ids=jnp.arange(4, 8),
              anchor_ids=jnp.arange(4)), **hyper), x, params)
  except (ValueError, TypeError) as e:
    message = str(e).splitlines()[0]
    named = re.search(r"`(\w+)`", message)
    field = named.group(1) if named and named.group(1) in hyper else None
    _fail(f"loss.{field}" if field else "loss",
          re.sub(r"^`\w+` ", "", message) if field else message)


def check_loss(config, info):
  """``config.loss``: a known loss, only its fields, valid execution options,
  a class count for a loss with per-class parameters, and hyperparameters
  the loss accepts (:func:`_check_hyper`). Returns the loss's entry."""
  loss_name = config.loss.name
  if loss_name not in losses_lib.LOSSES:
    _fail("loss.name", f"unknown loss {loss_name!r}; known losses: "
          f"{', '.join(sorted(losses_lib.LOSSES))}.")
  entry = losses_lib.get_loss(loss_name)
  hyper = facts.loss_hyper(config)
  accepted = (sorted(config_lib.loss_fields(entry))
              + list(entry.execution_options))
  # (and a field of another loss that the section holds: LossSection)
  unknown = sorted(set(hyper) - set(accepted)) or sorted(
      getattr(config.loss, "held", {}))
  if unknown:
    _fail(f"loss.{unknown[0]}", f"loss {loss_name!r} has no hyperparameter(s) "
          f"{unknown}; it accepts {accepted}.")
  block = config.loss.get("block_size", None)
  if block is not None and (isinstance(block, bool)
                            or not isinstance(block, int) or block < 1):
    _fail("loss.block_size", f"must be a positive int (or unset for the dense "
          f"loss); got {block!r}.")
  # Only the losses with a device ring have the field.
  if ("collective" in config.loss
      and config.loss.collective not in (None,) + COLLECTIVES):
    _fail("loss.collective", f"must be one of {COLLECTIVES} (or unset for "
          f"'all_gather'); got {config.loss.collective!r}.")
  n = facts.num_classes(config, info)
  if entry.param_name is not None and (not isinstance(n, int) or n <= 0):
    _fail("dataset.num_classes", f"loss {loss_name!r} ({entry.kind}) learns "
          f"one {entry.param_name} row per class and needs the number of "
          f"train classes; got {n!r}.")
  rate = config.loss.get("sample_rate", _NO_LAYOUT.sample_rate)
  if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (
      0 < rate <= 1):
    _fail("loss.sample_rate", "must be a number in (0, 1] (the fraction of "
          f"the negative classes each step keeps; 1: all); got {rate!r}.")
  if config.loss.get("reduction", None) == "none":
    _fail("loss.reduction", "'none' returns the loss's terms, not a loss to "
          "train on; pick a reduction such as 'mean' (or unset it).")
  weights = config.loss.get("reduction_weights", None)
  if (config.loss.get("reduction", None) == "class_weighted"
      and (weights is None or len(weights) != n)):
    _fail("loss.reduction_weights", f"reduction 'class_weighted' needs one "
          f"weight per class ({n}); got {weights!r}.")
  regs = {k: hyper.pop(k) for k in losses_lib.regularizers.FIELDS
          if k in hyper}
  for target, kind in (("embedding", "embeddings"), ("weight", "weights")):
    try:
      losses_lib.regularizers.check_regularizer(
          regs.get(f"{target}_regularizer", ""), kind)
    except ValueError as e:
      _fail(f"loss.{target}_regularizer", str(e))
  if regs.get("weight_regularizer") and config.loss.get("shard_classes"):
    _fail("loss.weight_regularizer", "a class matrix sharded over the "
          "devices cannot be regularized whole; unset loss.shard_classes.")
  hyper.pop("shard_classes", None)  # traced whole: no device axis here
  _check_hyper(entry, hyper, config.model.embedding_dim, n,
                    references=bool(config.xbm.size) and entry.supports_ref)
  return entry


def check_more_losses(config, info) -> None:
  """``config.more_losses``: each term with a numeric weight and
  hyperparameters its loss accepts; no sharded class matrix."""
  n = facts.num_classes(config, info)
  for key, entry, weight, hyper in facts.more_losses(config):
    path = f"more_losses.{key}"
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
      _fail(f"{path}.weight", f"must be a number; got {weight!r}.")
    if hyper.get("shard_classes") or config.loss.get("shard_classes"):
      _fail(path, "more losses take no class matrix sharded over the "
            "devices; unset loss.shard_classes.")
    for k in (*losses_lib.regularizers.FIELDS, "shard_classes"):
      hyper.pop(k, None)
    try:
      _check_hyper(entry, hyper, config.model.embedding_dim, n)
    except ConfigError as e:
      raise ConfigError(str(e).replace("config.loss", f"config.{path}")
                        ) from None


def check_class_layout(config, placement) -> None:
  """``loss.shard_classes`` and ``loss.sample_rate`` (the class matrix's
  layout, :mod:`circle_jax.train.class_rows`)."""
  shard = config.loss.get("shard_classes", _NO_LAYOUT.shard_classes)
  if not isinstance(shard, bool):
    _fail("loss.shard_classes", f"must be true or false; got {shard!r}.")
  if not shard:
    return
  if placement.axis_name is None:
    _fail("loss.shard_classes", "shards the class matrix over the devices: "
          f"use parallelism 'shard_map' or 'pmap', not "
          f"{config.parallelism!r}.")
  if config.optim.grad_clip_norm:
    _fail("optim.grad_clip_norm", "clips by the norm of every gradient, "
          "which a class matrix sharded over the devices splits; use "
          "optim.grad_clip_value or loss.shard_classes=False.")
