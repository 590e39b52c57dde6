r"""Dynamic soft margin loss (Zhang & Rusinkiewicz, ICCV 2019), dense.

Every triplet ``(a, p, n)`` of the batch gives ``\delta = d_{ap} - d_{an}``
(Euclidean distances of unit vectors); a histogram of the ``\delta``, ``K``
bins of width ``\Delta = 2 |v_{min}| / K`` from ``v_{min}``, linearly
interpolated and kept as a running average, gives their CDF, and each
triplet is weighted by it:

.. math::

  L = \operatorname*{mean}_{(a, p, n)} \mathrm{CDF}(\delta_{apn})
      \, \delta_{apn}.

It is not a rule: the weight of a triplet is a function of every triplet's
``\delta`` in the batch (the histogram), and a triplet couples a positive
with a negative (see :mod:`circle_jax.losses.triplet`), so it runs on the
dense block: ``B^3`` triplets in memory, for moderate batches.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses import ranges
from circle_jax.losses.engine import reductions

Array = jax.Array

_NOT_TILED = ("each triplet's weight reads the histogram of every triplet "
              "of the batch")


@dataclasses.dataclass(frozen=True)
class DynamicSoftMargin:
  """The defaults of the dynamic soft margin loss (PML's)."""

  min_val: float = -2.0
  num_bins: int = 10
  momentum: float = 0.01


def _checked(min_val, num_bins, momentum):
  if int(num_bins) != num_bins or num_bins < 2:
    raise ValueError(
        f"`num_bins` must be an integer >= 2; got {num_bins!r}.")
  ranges.check_range(momentum, "momentum", ranges.HyperRange(0.0, 1.0))
  if not min_val < 0:
    raise ValueError(f"`min_val` must be negative (the bins span "
                     f"[min_val, -min_val]); got {min_val!r}.")
  return int(num_bins), 2 * abs(min_val) / num_bins


def _triplets(embeddings, labels, options):
  """``(delta, mask)``: ``d_ap - d_an`` ``[M, N, N]`` and the triplets."""
  engine.require_cosine(options.get("geometry"), "dynamic soft margin loss",
                        "bins distances of unit vectors")
  _, _, d, pos, neg = engine.dense_block(
      embeddings, labels, loss="dynamic soft margin loss", reason=_NOT_TILED,
      distance=True, **options)
  d = d.astype(jnp.float32) if d.dtype == jnp.bfloat16 else d
  return d[:, :, None] - d[:, None, :], pos[:, :, None] & neg[:, None, :]


def _loss_and_histogram(delta, mask, hist, *, min_val, num_bins, width,
                        momentum, axis_name):
  """PML's ``update_histogram`` then ``weigh_loss`` on the masked triplets
  (the old histogram constant, the new one differentiated, as PML)."""
  hist = jax.lax.stop_gradient(jnp.asarray(hist, delta.dtype))
  pos = (delta - min_val) / width
  low = jnp.floor(jax.lax.stop_gradient(pos))
  idx = jnp.clip(low, 0, num_bins - 2).astype(jnp.int32)
  alpha = jnp.clip(pos - idx, 0.0, 1.0)  # PML's frac inside its range
  weight = mask.astype(delta.dtype)
  count = jax.lax.stop_gradient(
      ops.maybe_global_sum(jnp.sum(weight), axis_name))
  momentum = jnp.where(jnp.sum(hist) != 0, momentum, 1.0)
  added = (jax.ops.segment_sum((weight * (1 - alpha)).ravel(), idx.ravel(),
                               num_bins)
           + jax.ops.segment_sum((weight * alpha).ravel(), (idx + 1).ravel(),
                                 num_bins))
  new = (1 - momentum) * hist + momentum * ops.maybe_global_sum(added,
                                                                axis_name)
  new = new / jnp.where(count > 0, jnp.sum(new), 1.0)
  cdf = jnp.cumsum(new)[jnp.clip(low, 0, num_bins - 1).astype(jnp.int32)]
  loss = reductions.ratio_of_sums(weight * cdf * delta, weight, axis_name)
  return loss, jnp.where(count > 0, new, hist)


def dynamic_soft_margin_loss(
    embeddings: Array,
    labels: Array,
    *,
    min_val: float = DynamicSoftMargin.min_val,
    num_bins: int = DynamicSoftMargin.num_bins,
    momentum: float = DynamicSoftMargin.momentum,
    **options,
) -> Array:
  r"""Dynamic soft margin loss (Zhang & Rusinkiewicz, ICCV 2019).

  .. math::

    L = \operatorname*{mean}_{(a, p, n)} \Phi(\delta_{apn}) \, \delta_{apn},
    \qquad \delta_{apn} = d_{ap} - d_{an},

  over every triplet (``p`` a positive and ``n`` a negative of anchor
  ``a``; with miner masks, the masked pairs; with references, ``p`` and
  ``n`` among them), ``d`` the Euclidean distance of the L2-normalised
  embeddings, and ``\Phi(\delta) = \sum_{k \le \lfloor (\delta - v_{min})
  / \Delta \rfloor} h_k`` the CDF of the histogram ``h`` of the batch's
  ``\delta``: ``K = `` ``num_bins`` bins of width
  ``\Delta = 2 |v_{min}| / K`` from ``v_{min} = `` ``min_val``, each
  ``\delta`` split between its bin and the next in proportion to its
  position (linear interpolation), then normalised. This is the loss of a
  fresh histogram (a new PML loss object's first call, where ``momentum``
  has no effect); :func:`dynamic_soft_margin_step` carries the running
  histogram from step to step.

  Reduction: mean over the triplets (PML's ``"already_reduced"``); 0 with
  zero gradient without a triplet.

  Differences from pytorch-metric-learning 2.9
  (``DynamicSoftMarginLoss(min_val, num_bins, momentum)``, same names and
  defaults): equal value and gradient, the gradient through the histogram's
  interpolation weights as PML's (tested in float64). PML keeps the running
  histogram in the loss object; in JAX it is explicit state
  (:func:`dynamic_soft_margin_step`). PML bug: its running histogram keeps
  the autograd graph of the step that made it, so the next step's backward
  fails ("Trying to backward through the graph a second time"); here the
  previous histogram is a constant, as the paper's running statistic.
  PML indexes past its histogram for ``delta >= v_min + (K - 1) \Delta``
  (1.6 at the defaults) or below ``v_min`` and raises; here those fall in
  the first or last bins. PML's labels-free form (``ref_emb[i]`` the
  positive of ``embeddings[i]``) is not offered: the registry's losses take
  labels. The cosine geometry only.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    min_val: ``v_min`` < 0, the lowest ``delta`` binned (PML's name).
    num_bins: ``K`` >= 2, the number of bins.
    momentum: the running histogram's weight of a new batch, in [0, 1]
      (:func:`dynamic_soft_margin_step`).
    **options: ``axis_name``, ``pos_mask``, ``neg_mask`` and ``ref``, as
      every pair loss (:func:`circle_jax.losses.engine.embedding_loss`);
      the dense engine only: ``block_size`` and the ring are refused.

  Returns:
    float32 scalar.

  References:
    Zhang, Rusinkiewicz, "Learning Local Descriptors with a CDF-Based
    Dynamic Soft Margin", ICCV 2019.
  """
  return dynamic_soft_margin_step(
      embeddings, labels, None, min_val=min_val, num_bins=num_bins,
      momentum=momentum, **options)[0]


def dynamic_soft_margin_step(
    embeddings: Array,
    labels: Array,
    histogram: Optional[Array],
    *,
    min_val: float = DynamicSoftMargin.min_val,
    num_bins: int = DynamicSoftMargin.num_bins,
    momentum: float = DynamicSoftMargin.momentum,
    **options,
) -> Tuple[Array, Array]:
  """:func:`dynamic_soft_margin_loss` with the running histogram.

  Args:
    embeddings, labels, min_val, num_bins, momentum, **options: as
      :func:`dynamic_soft_margin_loss`.
    histogram: ``[num_bins]``, the previous step's histogram (constant in
      backprop), or ``None`` / zeros for a fresh one.

  Returns:
    ``(loss, histogram)``: the float32 loss and the new ``[num_bins]``
    histogram, ``(1 - momentum) h + momentum c`` normalised, ``c`` the
    batch's interpolated counts (``momentum`` 1 for a zero histogram, as
    PML); unchanged without a triplet. Pass it to the next step.
  """
  num_bins, width = _checked(min_val, num_bins, momentum)
  delta, mask = _triplets(embeddings, labels, options)
  if histogram is None:
    histogram = jnp.zeros((num_bins,), delta.dtype)
  elif jnp.shape(histogram) != (num_bins,):
    raise ValueError(f"`histogram` must have shape ({num_bins},) "
                     f"(num_bins); got {jnp.shape(histogram)}.")
  loss, hist = _loss_and_histogram(
      delta, mask, histogram, min_val=min_val, num_bins=num_bins,
      width=width, momentum=momentum, axis_name=options.get("axis_name"))
  return reductions.to_float32_scalar(loss), hist


# The registry's facts of this module's losses (circle_jax.losses.registry
# collects them).
REGISTRY = (
    entries.entry("dynamic_soft_margin", dynamic_soft_margin_loss, "pair",
        tiled=False,
        paper="Zhang & Rusinkiewicz, \"Learning Local Descriptors with a "
              "CDF-Based Dynamic Soft Margin\", ICCV 2019",
        reduction="mean over triplets"),
)
