"""Ranked List Loss (Wang et al., CVPR 2019; TPAMI 2021).

Every sample is used in turn as a query; the rest of the batch is its ranked
list, split into a positive and a negative set. The loss pushes the negatives
beyond a boundary ``alpha`` and pulls the positives inside ``alpha - margin``
(a hypersphere per class, not a point), so the two sets are separated by
``margin``. Only the non-trivial pairs (those that violate their boundary)
contribute, and the negatives are weighted by how much they violate it.

The loss is written as a private per-anchor core on an ``[M, N]`` distance
block, a public square distance-matrix form
(:func:`ranked_list_loss_from_distance`), a similarity-matrix form
(:func:`ranked_list_loss_from_similarity`, so that General Pair Weighting
applies), and the embedding wrapper :func:`ranked_list_loss`.

Reduction convention: the mean of the per-anchor losses over *all* anchors of
the (global) batch; an anchor whose non-trivial positive or negative set is
empty gets 0 from that term.

References:
  Wang, Hua, Kodirov, Hu, Garnier, Robertson. "Ranked List Loss for Deep
  Metric Learning". CVPR 2019. https://arxiv.org/abs/1903.03238
  Wang, Hua, Kodirov, Robertson. "Ranked List Loss for Deep Metric
  Learning". IEEE TPAMI 44(9), 2021 (adds the positive weighting ``T_p``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax.losses import _common
from circle_jax.losses import blockwise

Array = jax.Array


def _check_hyper(alpha, margin, imbalance) -> None:
  """Checks (when concrete) the RLL hyperparameters."""
  _common.check_positive(alpha, "alpha")
  if isinstance(margin, (int, float)) and not margin >= 0:
    raise ValueError(
        f"`margin` must be >= 0 (the gap between the positive boundary "
        f"alpha - margin and the negative boundary alpha); got {margin}."
    )
  if isinstance(imbalance, (int, float)) and not 0.0 <= imbalance <= 1.0:
    raise ValueError(
        f"`imbalance` must be in [0, 1] (the weight lambda of the negative "
        f"term; the positive term gets 1 - lambda); got {imbalance}."
    )


def _weighted_hinge_means(hinge_p: Array, hinge_n: Array, logits_p: Array,
                          logits_n: Array, pos: Array, neg: Array):
  """Per-row weighted means ``sum_j w_j * hinge_j`` over two disjoint sets.

  ``w = softmax(logits)`` over each set, max-shifted (no overflow for any
  temperature) with one ``exp`` per pair for both sets
  (:func:`circle_jax.losses._common.two_set_exp`), and constant in
  backpropagation (``stop_gradient``), as in the paper's gradient and the
  official implementation. An empty set gives 0 with a zero gradient.

  Args:
    hinge_p, hinge_n: ``[..., N]`` float32 values to average over ``pos`` /
      ``neg`` (only masked entries used).
    logits_p, logits_n: ``[..., N]`` float32 weight logits (``T * hinge`` for
      RLL).
    pos, neg: ``[..., N]`` bool, the (disjoint) sets.

  Returns:
    ``(mean_p, mean_n)``, each ``[...]`` (0 for empty sets).
  """
  e, _, _ = _common.two_set_exp(logits_p, logits_n, pos, neg)
  e = jax.lax.stop_gradient(e)

  def mean(mask, hinge):
    # An empty set has all weights 0 (total 0); a non-empty one has total
    # about >= 1 (its maximum gives exp(0), up to the rounding of a
    # recomputed logit, which at large temperatures is not exactly 0).
    total = jnp.sum(jnp.where(mask, e, 0.0), axis=-1)
    return (jnp.sum(jnp.where(mask, e * hinge, 0.0), axis=-1)
            / jnp.where(total == 0, 1.0, total))

  return mean(pos, hinge_p), mean(neg, hinge_n)


def _rll_per_anchor(
    distance: Array,
    pos: Array,
    neg: Array,
    *,
    alpha,
    margin,
    t_neg,
    t_pos,
    imbalance,
) -> Array:
  """Per-anchor Ranked List Loss of an ``[M, N]`` distance block.

  Args:
    distance: ``[M, N]`` float32 distances of ``M`` anchors to ``N``
      candidates.
    pos: ``[M, N]`` bool, the positive pairs of each anchor (self excluded).
    neg: ``[M, N]`` bool, the negative pairs of each anchor.
    alpha, margin, t_neg, t_pos, imbalance: see :func:`ranked_list_loss`.

  Returns:
    ``[M]`` float32 per-anchor losses.
  """
  pos_hinge = distance - (alpha - margin)
  neg_hinge = alpha - distance
  pos_set = pos & (pos_hinge > 0)  # non-trivial positives
  neg_set = neg & (neg_hinge > 0)  # non-trivial negatives
  loss_p, loss_n = _weighted_hinge_means(
      pos_hinge, neg_hinge, t_pos * pos_hinge, t_neg * neg_hinge, pos_set,
      neg_set)
  return (1.0 - imbalance) * loss_p + imbalance * loss_n


def ranked_list_loss_from_distance(
    distance: Array,
    labels: Array,
    *,
    alpha: float = 1.2,
    margin: float = 0.4,
    t_neg: float = 10.0,
    t_pos: float = 0.0,
    imbalance: float = 0.5,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Array:
  r"""Ranked List Loss of a square distance matrix.

  For anchor :math:`i` with non-trivial positives
  :math:`P^*_i = \{j \ne i: y_j = y_i,\ d_{ij} > \alpha - m\}` and
  non-trivial negatives :math:`N^*_i = \{j: y_j \ne y_i,\ d_{ij} < \alpha\}`:

  .. math::

    L_P(i) = \sum_{j \in P^*_i} \frac{w^+_{ij}}{\sum_{k \in P^*_i} w^+_{ik}}
             (d_{ij} - (\alpha - m)), \quad
             w^+_{ij} = e^{T_p (d_{ij} - (\alpha - m))}

    L_N(i) = \sum_{j \in N^*_i} \frac{w^-_{ij}}{\sum_{k \in N^*_i} w^-_{ik}}
             (\alpha - d_{ij}), \quad w^-_{ij} = e^{T_n (\alpha - d_{ij})}

    L = \frac{1}{B} \sum_i (1 - \lambda) L_P(i) + \lambda L_N(i)

  An empty set gives 0 for its term. The normalised weights are constants in
  backpropagation (the paper's gradient; the official Caffe code scales the
  pair gradients by them), so ``dL/dd_ij`` is ``(1-lambda) w+/sum w+ / B`` on
  non-trivial positives and ``-lambda w-/sum w- / B`` on non-trivial
  negatives. With ``t_pos = 0`` the positive term is the plain mean.

  Args:
    distance: ``[B, B]`` float distance matrix (float32 or bfloat16; computed
      in float32). The diagonal is ignored.
    labels: ``[B]`` integer labels.
    alpha: the negative boundary :math:`\alpha`.
    margin: the gap :math:`m` between the positive boundary
      :math:`\alpha - m` and the negative boundary.
    t_neg: temperature :math:`T_n` of the negative weighting (0: plain mean).
    t_pos: temperature :math:`T_p` of the positive weighting (0: plain mean).
    imbalance: :math:`\lambda`, the weight of the negative term.
    pos_mask: optional ``[B, B]`` bool mask of the positive pairs to use
      (e.g. from a miner), intersected with the label mask.
    neg_mask: optional ``[B, B]`` bool mask of the negative pairs to use.

  Returns:
    A float32 scalar: the mean over all ``B`` anchors.

  References:
    Wang et al., "Ranked List Loss for Deep Metric Learning", CVPR 2019 and
    TPAMI 2021.
  """
  _check_hyper(alpha, margin, imbalance)
  distance, labels = _common.check_similarity(distance, labels, name="distance")
  pos, neg = _common.pair_masks(labels, labels, 0, pos_mask, neg_mask)
  per_anchor = _rll_per_anchor(
      distance, pos, neg, alpha=alpha, margin=margin, t_neg=t_neg,
      t_pos=t_pos, imbalance=imbalance)
  return _common.to_float32_scalar(_common.sum_over_batch(per_anchor))


def ranked_list_loss_from_similarity(
    similarity: Array,
    labels: Array,
    *,
    alpha: float = 1.2,
    margin: float = 0.4,
    t_neg: float = 10.0,
    t_pos: float = 0.0,
    imbalance: float = 0.5,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Array:
  r"""Ranked List Loss of a square cosine-similarity matrix.

  The same loss as :func:`ranked_list_loss_from_distance` on the Euclidean
  distance between unit vectors, :math:`d_{ij} = \sqrt{2 - 2 s_{ij}}` (0 with
  a zero gradient where :math:`s_{ij} = 1`). This form lets
  :func:`circle_jax.losses.pair_weights` (General Pair Weighting) compute
  ``|dL/dS|``.

  Args:
    similarity: ``[B, B]`` float cosine similarities.
    labels: ``[B]`` integer labels.
    alpha, margin, t_neg, t_pos, imbalance, pos_mask, neg_mask: see
      :func:`ranked_list_loss_from_distance`.

  Returns:
    A float32 scalar: the mean over all ``B`` anchors.
  """
  similarity, labels = _common.check_similarity(similarity, labels)
  return ranked_list_loss_from_distance(
      _common.euclidean_from_cosine(similarity), labels, alpha=alpha,
      margin=margin, t_neg=t_neg, t_pos=t_pos, imbalance=imbalance,
      pos_mask=pos_mask, neg_mask=neg_mask)


def ranked_list_loss(
    embeddings: Array,
    labels: Array,
    *,
    alpha: float = 1.2,
    margin: float = 0.4,
    t_neg: float = 10.0,
    t_pos: float = 0.0,
    imbalance: float = 0.5,
    axis_name=None,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
    block_size: Optional[int] = None,
) -> Array:
  r"""Ranked List Loss (RLL) on the Euclidean distance of normalised embeddings.

  Each anchor's positives should lie within :math:`\alpha - m` and its
  negatives beyond :math:`\alpha`; per anchor

  .. math::

    L(i) = (1 - \lambda) \operatorname{wmean}_{j \in P^*_i}
           [d_{ij} - (\alpha - m)]
         + \lambda \operatorname{wmean}_{j \in N^*_i} [\alpha - d_{ij}]

  over the non-trivial positives (:math:`d > \alpha - m`) and negatives
  (:math:`d < \alpha`), with weights :math:`e^{T_p (d - (\alpha - m))}` and
  :math:`e^{T_n (\alpha - d)}` normalised per anchor (max-shifted, so no
  overflow for any temperature) and held constant in backpropagation. See
  :func:`ranked_list_loss_from_distance` for the full formula.

  The distance is :math:`d_{ij} = \|\hat x_i - \hat x_j\| = \sqrt{2 - 2
  \cos(x_i, x_j)}` between L2-normalised embeddings (zero vectors stay zero).
  Defaults are the paper's (``alpha = 1 + m/2 = 1.2``, ``m = 0.4``,
  ``T_n = 10``, ``T_p = 0``, ``lambda = 0.5``).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 embeddings (raw; normalised
      inside, computed in float32).
    labels: ``[B]`` integer labels.
    alpha: the negative boundary :math:`\alpha`.
    margin: the gap :math:`m` between the positive and negative boundaries.
    t_neg: temperature :math:`T_n` of the negative weighting.
    t_pos: temperature :math:`T_p` of the positive weighting.
    imbalance: :math:`\lambda`, the weight of the negative term.
    axis_name: optional mapped axis (``jax.shard_map`` / ``jax.pmap``). Each
      device compares its local anchors with the global batch gathered over
      the axis; the result is the loss of the global batch on every device and
      the gradient w.r.t. the local embeddings is exact.
    pos_mask: optional ``[B, B_global]`` bool mask of usable positive pairs
      (rows: this device's anchors, columns: the global batch), intersected
      with the label mask.
    neg_mask: optional ``[B, B_global]`` bool mask of usable negative pairs.
    block_size: ``None`` (default) builds the ``[B, B_global]`` similarity
      block at once. An integer processes anchor rows and candidate columns
      in blocks of that size (online logsumexp / weighted sums, and a
      ``custom_vjp`` that recomputes blocks in the backward pass), so memory
      is ``O(block_size^2 + B * D)`` instead of ``O(B^2)``; values and gradients
      equal the dense ones to float32 rounding. See
      :mod:`circle_jax.losses.blockwise`.

  Returns:
    A float32 scalar: the mean of the per-anchor losses over all anchors of
    the (global) batch.

  References:
    Wang et al., "Ranked List Loss for Deep Metric Learning", CVPR 2019,
    https://arxiv.org/abs/1903.03238, and TPAMI 2021.
  """
  if block_size is not None:
    return blockwise.ranked_list_loss_blockwise(
        embeddings, labels, block_size=block_size, alpha=alpha,
        margin=margin, t_neg=t_neg, t_pos=t_pos, imbalance=imbalance,
        axis_name=axis_name, pos_mask=pos_mask, neg_mask=neg_mask)
  _check_hyper(alpha, margin, imbalance)
  x = _common.check_embeddings(embeddings)
  labels = _common.check_labels(labels, x.shape[0])
  x = _common.l2_normalize(x)
  all_x, all_labels, row_offset = _common.gathered_batch(x, labels, axis_name)
  similarity = jnp.matmul(x, all_x.T, precision=jax.lax.Precision.HIGHEST)
  distance = _common.euclidean_from_cosine(similarity)
  pos, neg = _common.pair_masks(labels, all_labels, row_offset, pos_mask,
                                neg_mask)
  per_anchor = _rll_per_anchor(
      distance, pos, neg, alpha=alpha, margin=margin, t_neg=t_neg,
      t_pos=t_pos, imbalance=imbalance)
  return _common.to_float32_scalar(
      _common.sum_over_batch(per_anchor, axis_name))
