r"""Histogram loss (Ustinova & Lempitsky, NeurIPS 2016), dense.

The cosine similarities of the positive pairs and of the negative pairs are
each spread over ``R + 1`` evenly spaced nodes ``t_r = -1 + r \Delta``
(``\Delta = 2 / R``) by linear interpolation, giving two histograms
``h^+`` and ``h^-``; the loss is the probability that a negative pair is
more similar than a positive one, estimated from them:

.. math::

  L = \sum_{r=0}^{R} h^-_r \, \Phi^+_r, \qquad
  \Phi^+_r = \sum_{q \le r} h^+_q.

It is not a rule: the loss is a product of two histograms over *all* pairs
of the batch, not a sum of per-anchor terms, so no tile or device can finish
its share alone. The histograms themselves are sums and are summed over the
devices (``axis_name``), but the blockwise engine and the ring are refused.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses.engine import reductions

Array = jax.Array

DEFAULT_BINS = 100
_NOT_TILED = ("its value multiplies two histograms over every pair of the "
              "batch, no sum of per-anchor terms")


def bin_width(n_bins: Optional[int], delta: Optional[float]) -> float:
  """PML's ``delta``: ``2 / n_bins`` (``n_bins`` 100 if neither is given);
  ValueError if both are given and disagree, or out of range."""
  if n_bins is not None and (int(n_bins) != n_bins or n_bins < 1):
    raise ValueError(f"`n_bins` must be a positive integer; got {n_bins!r}.")
  if delta is not None and not 0.0 < delta <= 2.0:
    raise ValueError(f"`delta` must be in (0, 2]; got {delta!r}.")
  if delta is not None and n_bins is not None and delta != 2 / n_bins:
    raise ValueError(
        f"`delta` and `n_bins` must satisfy delta = 2 / n_bins; got "
        f"delta={delta} and n_bins={n_bins}: give one of them.")
  if delta is None:
    return 2.0 / (DEFAULT_BINS if n_bins is None else n_bins)
  return float(delta)


def _density(s, weight, delta, nodes, axis_name):
  """The linear-interpolation histogram of the similarities ``s`` (each with
  ``weight`` 0 or 1) on ``nodes`` nodes, divided by the (global) number of
  weighted pairs."""
  r = jnp.clip(jnp.floor(jax.lax.stop_gradient(s + 1.0) / delta),
               0, nodes - 2).astype(jnp.int32)
  upper = (s + 1.0 - r * delta) / delta * weight
  lower = ((r + 1) * delta - 1.0 - s) / delta * weight
  hist = (jax.ops.segment_sum(upper.ravel(), (r + 1).ravel(), nodes)
          + jax.ops.segment_sum(lower.ravel(), r.ravel(), nodes))
  hist = ops.maybe_global_sum(hist, axis_name)
  count = jax.lax.stop_gradient(
      ops.maybe_global_sum(jnp.sum(weight), axis_name))
  return hist / jnp.maximum(count, 1.0)


def _either_way(pairs, axis_name):
  """``pairs | pairs.T`` for a ``[M, N]`` block of the global ``[N, N]``
  (the local rows' slice of the transpose)."""
  if axis_name is None:
    return pairs | pairs.T
  full = jax.lax.all_gather(pairs, axis_name, tiled=True)
  offset = reductions.local_row_offset(pairs.shape[0], axis_name)
  return pairs | jax.lax.dynamic_slice_in_dim(full, offset, pairs.shape[0],
                                              axis=1).T


def histogram_loss(
    embeddings: Array,
    labels: Array,
    *,
    n_bins: Optional[int] = None,
    delta: Optional[float] = None,
    **options,
) -> Array:
  r"""Histogram loss (Ustinova & Lempitsky, NeurIPS 2016).

  .. math::

    L = \sum_{r=0}^{R} h^-_r \sum_{q \le r} h^+_q,

  ``h^\pm_r = \frac{1}{|S^\pm|} \sum_{(i, j) \in S^\pm} \delta_{ij, r}``,
  ``\delta_{ij, r}`` the linear-interpolation weight of the cosine
  similarity ``s_{ij}`` on node ``t_r = -1 + r \Delta``
  (``(s_{ij} - t_{r-1}) / \Delta`` if ``s_{ij} \in [t_{r-1}, t_r]``,
  ``(t_{r+1} - s_{ij}) / \Delta`` if ``s_{ij} \in [t_r, t_{r+1}]``, else 0),
  ``S^+`` and ``S^-`` the positive and negative pairs, each unordered pair
  once. As in pytorch-metric-learning, a pair is in ``S^+`` (``S^-``) when
  one of its two samples, as an anchor, has both a positive and a negative:
  the pairs of PML's ``"all"`` triplets (with miner masks: the masked
  pairs, and the anchors' sets read from the masks).

  Reduction: none (the loss is already one number for the batch, as PML's
  ``"already_reduced"``); 0 with zero gradient without a triplet.

  Differences from pytorch-metric-learning 2.9 (``HistogramLoss(n_bins,
  delta)``, same names and defaults: 100 bins unless one is given,
  ``delta = 2 / n_bins``): equal value and gradient (tested in float64). A
  similarity of exactly 1 falls on the last node here; PML indexes past its
  histogram there and raises. PML refuses ``ref_emb``; here references
  are the candidates and each (anchor, reference) pair counts once (tested
  against a float64 loop reference). The cosine geometry only (the nodes
  span [-1, 1]).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    n_bins: ``R``, the number of bins (PML's name); ``None``: 100, or
      ``2 / delta``.
    delta: ``\Delta``, the bin width (the paper's symbol), ``2 / n_bins``.
    **options: the pair losses' shared keywords (``axis_name``: the
      histograms are summed over the devices; ``pos_mask``, ``neg_mask``;
      ``ref``), documented once at
      :func:`circle_jax.losses.engine.embedding_loss`; dense engine only
      (``block_size`` and ``collective="ring"`` are refused, see the module
      docstring), the cosine geometry only.

  Returns:
    float32 scalar.

  References:
    Ustinova, Lempitsky, "Learning Deep Embeddings with Histogram Loss",
    NeurIPS 2016.
  """
  delta = bin_width(n_bins, delta)
  nodes = round(1 + 2 / delta)
  engine.require_cosine(options.get("geometry"), "histogram loss",
                        "bins cosine similarities in [-1, 1]")
  _, _, s, pos, neg = engine.dense_block(
      embeddings, labels, loss="histogram loss", reason=_NOT_TILED,
      **options)
  s = s.astype(jnp.float32) if s.dtype == jnp.bfloat16 else s
  # PML's pairs of the "all" triplets: an anchor's pairs count when it has
  # both a positive and a negative, each unordered pair once (both ordered
  # pairs of it here: the two histograms' ratios are the same). With
  # references, each (anchor, reference) pair once.
  triplets = pos.any(1, keepdims=True) & neg.any(1, keepdims=True)
  axis_name = options.get("axis_name")
  pairs_p, pairs_n = pos & triplets, neg & triplets
  if options.get("ref") is None:
    pairs_p = _either_way(pairs_p, axis_name)
    pairs_n = _either_way(pairs_n, axis_name)
  p_pos = _density(s, pairs_p.astype(s.dtype), delta, nodes, axis_name)
  p_neg = _density(s, pairs_n.astype(s.dtype), delta, nodes, axis_name)
  return reductions.to_float32_scalar(jnp.sum(p_neg * jnp.cumsum(p_pos)))


# The registry's facts of this module's losses (circle_jax.losses.registry
# collects them).
REGISTRY = (
    entries.entry("histogram", histogram_loss, "pair", tiled=False,
        paper="Ustinova & Lempitsky, \"Learning Deep Embeddings with "
              "Histogram Loss\", NeurIPS 2016",
        reduction="none: one number per batch (PML's already_reduced)"),
)
