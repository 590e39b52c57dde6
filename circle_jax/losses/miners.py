"""Fixed-shape pair miners: masks and weights for any pair-based loss.

A miner looks at the (stop-gradient) similarities of a batch and returns which
pairs a loss should use, as arrays with the shape of the loss's similarity
block: ``[B, B]`` on one device, ``[B_local, B_global]`` with ``axis_name``
(the local anchors against the gathered global batch, exactly the block the
pair losses build). Shapes never depend on the data, so miners are jit-able
and can be fused with the loss.

* :func:`multi_similarity_miner`, :func:`batch_hard_miner`,
  :func:`semi_hard_miner` and :func:`pair_margin_miner` return
  ``(pos_mask, neg_mask)``: boolean ``[M, N]`` masks for the ``pos_mask=`` /
  ``neg_mask=`` arguments of every pair-based loss (losses intersect them with
  their label masks, so a miner can only remove pairs).
* :func:`distance_weighted_miner` samples negatives and returns float32
  ``pair_weights`` ``[M, N]``: 1 on every positive pair, the number of times a
  negative was drawn on negative pairs, 0 elsewhere. Pass it as
  ``pair_weights=`` to :func:`~circle_jax.losses.margin_loss` (which counts
  multiplicities like the official sampler), or as
  ``pos_mask=w > 0, neg_mask=w > 0`` to a mask-taking loss.

Distances are Euclidean distances between L2-normalised embeddings,
``d = sqrt(2 - 2 cos)``; similarities are cosines.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import ranges
from circle_jax.losses.engine import reductions
from circle_jax.losses import engine
from circle_jax.losses.multi_similarity import MultiSimilarity

Array = jax.Array

# 1 - d^2/4 vanishes at antipodal points (d = 2); its log is clipped here.
_LOG_FLOOR = 1e-8


def mining_block(embeddings, labels, axis_name, ref=None):
  """Stop-gradient cosine block ``[M, N]`` and its label masks.

  ``axis_name``: a device axis; the block is then the local rows
  ``[B_local, B_global]`` of the global batch's (a miner's masks likewise).
  ``ref``: optional :class:`circle_jax.losses.Candidates`, the reference
  embeddings (a cross-batch memory; PML's ``ref_emb``, ``ref_labels``) the
  anchors meet instead of the batch, as the pair losses' ``ref``: the
  block, and a miner's masks, are then anchors x references, ``[M, K]``
  (pass the same ``ref`` to the loss).
  """
  rows, _, sim, pos, neg = engine.pair_block(embeddings, labels,
                                             axis_name=axis_name, ref=ref)
  offset = reductions.local_row_offset(rows.z.shape[0], axis_name)
  return jax.lax.stop_gradient(sim), pos, neg, offset


def sort_masked_rows(values: Array, mask: Array):
  """Each row's masked entries in ascending order, ``+inf`` after them.

  The sort is stable, so equal values keep their column order (the lowest
  column first), which the triplet selections below rely on for ties.

  Returns:
    ``(sorted, order, count)``: ``sorted [M, N]`` (gradients flow to
    ``values`` through the gather), ``order [M, N]`` the source column of
    each sorted entry, ``count [M]`` the number of masked entries per row.
  """
  keyed = jnp.where(mask, values, jnp.inf)
  order = jnp.argsort(jax.lax.stop_gradient(keyed), axis=-1, stable=True)
  return (jnp.take_along_axis(keyed, order, axis=-1), order,
          jnp.sum(mask, axis=-1, dtype=jnp.int32))


def row_searchsorted(sorted_rows: Array, queries: Array, side: str) -> Array:
  """``searchsorted`` of each row of ``queries`` in the same row of
  ``sorted_rows`` (int32 ``[M, Q]``), without gradient."""
  sorted_rows = jax.lax.stop_gradient(sorted_rows)
  queries = jax.lax.stop_gradient(queries)
  return jax.vmap(lambda a, v: jnp.searchsorted(a, v, side=side))(
      sorted_rows, queries).astype(jnp.int32)


def take_rows(x: Array, idx: Array) -> Array:
  """``x[i, idx[i, j]]`` with ``idx`` clipped into range."""
  return jnp.take_along_axis(x, jnp.clip(idx, 0, x.shape[-1] - 1), axis=-1)


# ----------------------------------------------------------------------------
# Mask cores on an [M, N] block (shared with the losses).
# ----------------------------------------------------------------------------


def batch_hard_masks(dist, pos, neg):
  """One-hot hardest positive / negative per anchor row."""
  n = dist.shape[1]
  hardest_pos = jnp.argmax(jnp.where(pos, dist, -jnp.inf), axis=1)
  hardest_neg = jnp.argmin(jnp.where(neg, dist, jnp.inf), axis=1)
  cols = jnp.arange(n)[None, :]
  keep_pos = (cols == hardest_pos[:, None]) & pos.any(1, keepdims=True)
  keep_neg = (cols == hardest_neg[:, None]) & neg.any(1, keepdims=True)
  return keep_pos, keep_neg


def semi_hard_masks(dist, pos, neg, *, margin):
  """Pairs of the semi-hard triplets ``d_ap < d_an < d_ap + margin``.

  Without the ``[M, N, N]`` triplet table: a positive is in a semi-hard
  triplet iff the closest negative farther than it is inside the margin, and
  a negative iff it is inside the margin of the farthest positive closer
  than it. Both come from binary searches in the row's sorted negative and
  positive distances: ``O(M N log N)`` time, ``O(M N)`` memory.
  """
  dist = jax.lax.stop_gradient(dist)
  neg_sorted, _, num_neg = sort_masked_rows(dist, neg)
  first = row_searchsorted(neg_sorted, dist, "right")  # first d_an > d_ap
  keep_pos = pos & (first < num_neg[:, None]) & (
      take_rows(neg_sorted, first) < dist + margin)
  pos_sorted, _, _ = sort_masked_rows(dist, pos)
  last = row_searchsorted(pos_sorted, dist, "left") - 1  # last d_ap < d_an
  keep_neg = neg & (last >= 0) & (dist < take_rows(pos_sorted, last) + margin)
  return keep_pos, keep_neg


def pair_margin_masks(dist, pos, neg, *, pos_margin, neg_margin):
  """Positives farther than ``pos_margin``, negatives closer than ``neg_margin``."""
  return pos & (dist > pos_margin), neg & (dist < neg_margin)


def distance_weighted_log_weights(dist, dim: int, *, cutoff):
  """``log q(d)^{-1}`` of Wu et al., up to a constant, with ``d`` clipped to
  ``cutoff``: ``(2 - n) log d - (n - 3)/2 log(1 - d^2/4)``."""
  d = jnp.maximum(dist, cutoff)
  return ((2.0 - dim) * jnp.log(d)
          - ((dim - 3.0) / 2.0)
          * jnp.log(jnp.maximum(1.0 - 0.25 * d * d, _LOG_FLOOR)))


def inverse_cdf_counts(probs: Array, uniforms: Array, valid: Array) -> Array:
  """Per-row categorical draws by inverse CDF, returned as counts.

  Draw ``j`` of row ``i`` (one per ``uniforms[i, j]``, counted only where
  ``valid[i, j]``) picks the first column ``n`` with
  ``cdf[i, n] > uniforms[i, j] * sum(probs[i])``: column ``n`` is drawn with
  probability ``probs[i, n] / sum(probs[i])`` and zero-probability columns
  never. A binary search per draw and a scatter-add of the counts: fixed
  shapes, ``O(M S log N)`` time and ``O(M (S + N))`` memory (no Gumbel
  tensor). Counts are sums of ones, exact in float32 on every backend.

  Args:
    probs: ``[M, N]`` non-negative unnormalised probabilities.
    uniforms: ``[M, S]`` numbers in ``[0, 1)``.
    valid: ``[M, S]`` bool, which draws to count.

  Returns:
    ``[M, N]`` float32 counts; each row sums to its number of valid draws
    (0 for rows whose probabilities are all 0).
  """
  cdf = jnp.cumsum(probs, axis=1)
  total = cdf[:, -1:]
  # u * total < total mathematically; keep it so after rounding, so that the
  # search never runs past the last column with mass.
  targets = jnp.minimum(uniforms * total,
                        jnp.nextafter(total, jnp.zeros_like(total)))
  idx = jax.vmap(lambda c, t: jnp.searchsorted(c, t, side="right"))(
      cdf, targets)
  idx = jnp.minimum(idx, probs.shape[1] - 1)
  m, s = uniforms.shape
  rows = jnp.broadcast_to(jnp.arange(m)[:, None], (m, s))
  weight = (valid & (total > 0)).astype(jnp.float32)
  return jnp.zeros(probs.shape, jnp.float32).at[rows, idx].add(weight)


def distance_weighted_weights(dist, pos, neg, row_start, key, dim: int, *,
                              cutoff, nonzero_loss_cutoff, num_rows=None):
  """Distance-weighted negative sampling on a distance block.

  Every positive pair ``(a, p)`` draws one negative for ``a`` (as the official
  sampler draws ``k - 1`` negatives for an anchor with ``k - 1`` positives),
  with probability proportional to ``q(max(d, cutoff))^{-1}`` restricted to
  negatives closer than ``nonzero_loss_cutoff``. Anchors with no such negative draw
  uniformly among their negatives. The uniforms are those of the whole
  ``[N, N]`` global block (rows from ``row_start``), so the result does not
  depend on how the global batch is split over devices. ``num_rows`` is the
  number of rows of the global block (default ``N``: the columns are the
  global batch; with references, the global number of anchors).

  Returns:
    ``[M, N]`` float32: 1 on positive pairs, draw counts on negative pairs.
  """
  dist = jax.lax.stop_gradient(dist)
  log_w = distance_weighted_log_weights(dist, dim, cutoff=cutoff)
  allowed = neg & (dist < nonzero_loss_cutoff)
  has_allowed = allowed.any(axis=1, keepdims=True)
  support = jnp.where(has_allowed, allowed, neg)
  logits = jnp.where(has_allowed, log_w, 0.0)
  row_max = jnp.max(jnp.where(support, logits, -jnp.inf), axis=1,
                    keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.where(support, jnp.exp(jnp.where(support, logits - row_max,
                                                -jnp.inf)), 0.0)
  m, n = dist.shape
  # Uniforms of the whole [N, N] global block, then this device's rows: the
  # draws do not depend on how the batch is split over devices.
  uniforms = jax.random.uniform(key, (n if num_rows is None else num_rows, n))
  uniforms = jax.lax.dynamic_slice_in_dim(uniforms, row_start, m, axis=0)
  # One draw per positive pair (a, p): uniforms[a, p] with valid = pos.
  counts = inverse_cdf_counts(probs, uniforms, pos)
  return jnp.where(pos, 1.0, jnp.where(neg, counts, 0.0))


# ----------------------------------------------------------------------------
# Public miners (embeddings in).
# ----------------------------------------------------------------------------


def multi_similarity_miner(
    embeddings: Array, labels: Array, *,
    epsilon: float = MultiSimilarity.epsilon,
    axis_name: Optional[str] = None,
    ref: Optional[engine.Candidates] = None) -> Tuple[Array, Array]:
  r"""Multi-Similarity pair mining (Wang et al. 2019, Sec. 4.1).

  With cosine similarities ``S``, for each anchor ``i``:

  .. math::

    \text{keep negative } j \iff S_{ij} + \epsilon > \min_{k \in P_i} S_{ik},
    \qquad
    \text{keep positive } j \iff S_{ij} - \epsilon < \max_{k \in N_i} S_{ik}.

  An anchor without positives keeps no negatives and vice versa.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (L2-normalised inside).
    labels: ``[B]`` integer labels.
    epsilon: the mining margin ``epsilon``.
    axis_name, ref: which block is mined (across devices; against
      references): see :func:`circle_jax.losses.miners.mining_block`.

  Returns:
    ``(pos_mask, neg_mask)``, boolean ``[B, B]`` (``[B_local, B_global]``).

  References:
    Wang et al., "Multi-Similarity Loss with General Pair Weighting for Deep
    Metric Learning", CVPR 2019, eqs. 4-5.
  """
  rule = MultiSimilarity(epsilon=epsilon)  # the loss's own mining
  sim, pos, neg, _ = mining_block(embeddings, labels, axis_name, ref)
  return engine.selected_pairs(rule, sim, pos, neg)


def batch_hard_miner(embeddings: Array, labels: Array, *,
                     axis_name: Optional[str] = None,
                     ref: Optional[engine.Candidates] = None
                     ) -> Tuple[Array, Array]:
  r"""Batch-hard mining (Hermans et al. 2017): one positive, one negative.

  For each anchor, the farthest positive ``argmax_{p \in P_i} d_{ip}`` and the
  closest negative ``argmin_{n \in N_i} d_{in}`` (first index on ties), with
  ``d`` the Euclidean distance between normalised embeddings.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    axis_name, ref: which block is mined (across devices; against
      references): see :func:`circle_jax.losses.miners.mining_block`.

  Returns:
    ``(pos_mask, neg_mask)``: one-hot boolean rows (all False for an anchor
    without positives, resp. negatives).

  References:
    Hermans, Beyer, Leibe, "In Defense of the Triplet Loss for Person
    Re-Identification", arXiv:1703.07737, 2017.
  """
  sim, pos, neg, _ = mining_block(embeddings, labels, axis_name, ref)
  return batch_hard_masks(ops.euclidean_from_cosine(sim), pos, neg)


def semi_hard_miner(embeddings: Array, labels: Array, *, margin: float = 0.2,
                    axis_name: Optional[str] = None,
                    ref: Optional[engine.Candidates] = None
                    ) -> Tuple[Array, Array]:
  r"""Pairs of the semi-hard triplets (Schroff et al. 2015).

  A triplet ``(a, p, n)`` is semi-hard when ``d_ap < d_an < d_ap + margin``:
  the negative is farther than the positive but still inside the margin. A
  triplet selection is not a ``[B, B]`` object, so this miner returns its
  projection on pairs: ``pos_mask[a, p]`` (``neg_mask[a, n]``) is True when
  the pair belongs to at least one semi-hard triplet. The per-positive-pair
  FaceNet selection is ``triplet_margin_loss(..., mining="semi_hard")``.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    margin: the triplet margin.
    axis_name, ref: which block is mined (across devices; against
      references): see :func:`circle_jax.losses.miners.mining_block`.

  Returns:
    ``(pos_mask, neg_mask)``, boolean. Binary searches in sorted rows
    replace the ``[N, N]`` triplet tests per anchor, so memory stays
    ``O(M N)`` and time ``O(M N log N)``.

  References:
    Schroff, Kalenichenko, Philbin, "FaceNet: A Unified Embedding for Face
    Recognition and Clustering", CVPR 2015, Sec. 3.2.
  """
  ranges.check_range(margin, "margin", ranges.NONNEGATIVE_RANGE)
  sim, pos, neg, _ = mining_block(embeddings, labels, axis_name, ref)
  return semi_hard_masks(ops.euclidean_from_cosine(sim), pos, neg,
                         margin=margin)


def pair_margin_miner(embeddings: Array, labels: Array, *,
                      pos_margin: float = 0.2, neg_margin: float = 0.8,
                      axis_name: Optional[str] = None,
                      ref: Optional[engine.Candidates] = None
                      ) -> Tuple[Array, Array]:
  r"""Pairs that violate a contrastive margin.

  Keeps positives with ``d_ap > pos_margin`` and negatives with
  ``d_an < neg_margin`` (Euclidean distance between normalised embeddings):
  exactly the pairs with non-zero :func:`contrastive_loss` for the same
  margins.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    pos_margin: positives closer than this are dropped.
    neg_margin: negatives farther than this are dropped.
    axis_name, ref: which block is mined (across devices; against
      references): see :func:`circle_jax.losses.miners.mining_block`.

  Returns:
    ``(pos_mask, neg_mask)``, boolean.

  References:
    Musgrave, Belongie, Lim, "A Metric Learning Reality Check", ECCV 2020
    (PairMarginMiner of pytorch-metric-learning).
  """
  sim, pos, neg, _ = mining_block(embeddings, labels, axis_name, ref)
  return pair_margin_masks(ops.euclidean_from_cosine(sim), pos, neg,
                           pos_margin=pos_margin, neg_margin=neg_margin)


@dataclasses.dataclass(frozen=True)
class DistanceWeighted:
  """The distance-weighted sampler's parameters, the defaults of
  :func:`distance_weighted_miner` and of the margin loss's sampler (the
  official code's): the distance floor ``cutoff`` and the distance beyond
  which a negative has no loss, ``nonzero_loss_cutoff``."""

  cutoff: float = 0.5
  nonzero_loss_cutoff: float = 1.4


def distance_weighted_miner(
    embeddings: Array, labels: Array, key: Array, *,
    cutoff: float = DistanceWeighted.cutoff,
    nonzero_loss_cutoff: float = DistanceWeighted.nonzero_loss_cutoff,
    axis_name: Optional[str] = None) -> Array:
  r"""Distance-weighted negative sampling (Wu et al. 2017, Sec. 4).

  Pairwise distances of points uniform on the unit sphere in ``R^n`` follow
  ``q(d) \propto d^{n-2} (1 - d^2/4)^{(n-3)/2}``. Each positive pair ``(a, p)``
  draws one negative ``j`` of ``a`` with probability

  .. math::

    \Pr(j \mid a) \propto q(\max(d_{aj}, \text{cutoff}))^{-1}
    \,[d_{aj} < \text{nonzero\_loss\_cutoff}],

  computed in log space, max-shifted per row. Anchors whose negatives are all
  beyond ``nonzero_loss_cutoff`` draw uniformly among their negatives (the
  official code falls back to uniform over the whole batch, positives
  included). Draws are with replacement, as in the official code.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (``n = D``).
    labels: ``[B]`` integer labels.
    key: a PRNG key. The draws of the global batch's row ``i`` do not
      depend on the device split, so single- and multi-device sampling agree.
    cutoff: distances are clipped below at ``cutoff`` (variance control).
    nonzero_loss_cutoff: negatives at least this far are never drawn.
    axis_name: mine the ``[B_local, B_global]`` block across devices.

  Returns:
    ``pair_weights``: float32 ``[B, B]`` (``[B_local, B_global]``), 1 on
    positive pairs, the number of draws on negative pairs, 0 elsewhere.
    Each row's negative counts sum to its number of positives (when it has a
    negative).

  References:
    Wu, Manmatha, Smola, Kraehenbuehl, "Sampling Matters in Deep Embedding
    Learning", ICCV 2017, eq. 4 and Sec. 4.
  """
  ranges.check_range(cutoff, "cutoff", ranges.NONNEGATIVE_RANGE)
  sim, pos, neg, offset = mining_block(embeddings, labels, axis_name)
  dist = ops.euclidean_from_cosine(sim)
  return distance_weighted_weights(
      dist, pos, neg, offset, key, embeddings.shape[1], cutoff=cutoff,
      nonzero_loss_cutoff=nonzero_loss_cutoff)
