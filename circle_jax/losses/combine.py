"""Combinations of losses: pytorch-metric-learning's ``MultipleLosses`` and
``SelfSupervisedLoss`` (PML 2.9), as plain functions.

:func:`multiple_losses` is the weighted sum of losses, each with its own
hyperparameters (bound in its :class:`Term`), miner and learnable parameters
(its class matrix); a metric loss plus a classifier loss is PML's
``TrainWithClassifier``. A config's loss becomes such a sum with
``config.more_losses`` (:mod:`circle_jax.train.step` adds the terms).

:func:`self_supervised_loss` runs any pair loss on the pairs
``(embeddings[i], ref_emb[i])``: the pair index is the label.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from circle_jax.losses import checks
from circle_jax.losses.engine import reductions
from circle_jax.losses.engine import sides

Array = jax.Array

# The key of the trainer's loss parameters under which the class matrices of
# ``config.more_losses`` lie (``params["loss"][MORE_LOSSES][key]``).
MORE_LOSSES = "more_losses"


@dataclasses.dataclass(frozen=True)
class Term:
  """One loss of :func:`multiple_losses`.

  Attributes:
    loss: ``loss(embeddings, labels[, params], **kwargs) -> scalar``, its
      hyperparameters already set (e.g. ``functools.partial`` or
      ``get_loss(name).bind(**hyper)``).
    weight: its weight in the sum (PML's ``weights``).
    miner: optional ``miner(embeddings, labels, axis_name=...) ->
      (pos_mask, neg_mask)`` (:mod:`circle_jax.losses.miners`), handed to
      the loss as its ``pos_mask`` / ``neg_mask`` (PML's ``miners``).
    takes_params: whether the loss takes learnable parameters (the entry of
      ``params`` with the term's index).
  """

  loss: Callable[..., Array]
  weight: float = 1.0
  miner: Optional[Callable[..., Any]] = None
  takes_params: bool = False


def multiple_losses(embeddings: Array, labels: Array,
                    params: Optional[Sequence[Any]] = None, *,
                    terms: Sequence[Term], axis_name=None) -> Array:
  r"""``L = sum_k w_k L_k(embeddings, labels)`` (PML's ``MultipleLosses``).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    params: one entry per term: the learnable parameters of a term with
      ``takes_params`` (its class matrix), ignored for the others; ``None``
      when no term has any.
    terms: the :class:`Term` of each loss.
    axis_name: optional mapped axis, handed to every loss and miner (each
      then sees the global batch).

  Returns:
    float32 scalar.
  """
  if not terms:
    raise ValueError("`terms` must name at least one loss.")
  params = [None] * len(terms) if params is None else list(params)
  if len(params) != len(terms):
    raise ValueError(f"`params` must have one entry per term ({len(terms)});"
                     f" got {len(params)}.")
  routed = {} if axis_name is None else {"axis_name": axis_name}
  total = jnp.zeros((), jnp.float32)
  for term, p in zip(terms, params):
    kwargs = dict(routed)
    if term.miner is not None:
      pos, neg = term.miner(embeddings, labels, **routed)
      kwargs.update(pos_mask=pos, neg_mask=neg)
    args = (p,) if term.takes_params else ()
    total += term.weight * term.loss(embeddings, labels, *args, **kwargs)
  return total


def self_supervised_loss(loss: Callable[..., Array], embeddings: Array,
                         ref_emb: Array, *, symmetric: bool = True,
                         axis_name=None, **kwargs) -> Array:
  r"""A pair loss on the pairs ``(embeddings[i], ref_emb[i])`` (PML's
  ``SelfSupervisedLoss``): row ``i`` of both is sample ``i``'s two views,
  its label ``i``.

  With ``symmetric`` (PML's default) the loss runs on the ``2B`` rows
  ``[embeddings; ref_emb]``, every row an anchor; otherwise the rows of
  ``embeddings`` are the anchors and ``ref_emb`` their references (the
  loss's ``ref``, PML's ``ref_emb``). With ``axis_name`` the labels are the
  global row indices, so the pairs are those of the global batch.

  Args:
    loss: a pair loss ``loss(embeddings, labels, **options)`` (e.g.
      ``functools.partial(losses.nt_xent_loss, tau=0.1)``); without
      ``symmetric`` it must take ``ref``.
    embeddings: ``[B, D]`` float32 or bfloat16, the first views.
    ref_emb: ``[B, D]``, the second views.
    symmetric: both views as anchors (``True``) or only ``embeddings``.
    axis_name: optional mapped axis (``B`` rows on each device).
    **kwargs: more options of ``loss``.

  Returns:
    float32 scalar.
  """
  embeddings = checks.check_embeddings(embeddings)
  ref_emb = checks.check_embeddings(ref_emb, "ref_emb")
  if ref_emb.shape != embeddings.shape:
    raise ValueError(f"`ref_emb` must have the shape of `embeddings`, "
                     f"{embeddings.shape}; got {ref_emb.shape}.")
  b = embeddings.shape[0]
  labels = (jnp.arange(b, dtype=jnp.int32)
            + jnp.asarray(reductions.local_row_offset(b, axis_name),
                          jnp.int32))
  routed = {} if axis_name is None else {"axis_name": axis_name}
  if symmetric:
    return loss(jnp.concatenate([embeddings, ref_emb]),
                jnp.concatenate([labels, labels]), **routed, **kwargs)
  return loss(embeddings, labels, ref=sides.Candidates(ref_emb, labels),
              **routed, **kwargs)
