"""Multi-Similarity loss with its pair mining (Wang et al., CVPR 2019).

The loss is written as a function of a similarity block ``[M, N]`` (private
per-anchor core ``_ms_per_anchor``), exposed as a square similarity-matrix form
(:func:`multi_similarity_loss_from_similarity`, differentiated by
:func:`circle_jax.losses.pair_weights`) and as an embedding wrapper
(:func:`multi_similarity_loss`) that supports the global batch across devices.
:func:`multi_similarity_weights` gives the paper's closed-form pair weights.

Reduction convention (the official code's): the per-anchor losses are summed
and divided by the batch size ``B`` (the global batch size with
``axis_name``), *including* anchors that contribute 0. An anchor contributes 0
when its (mined) positive or negative set is empty.

References:
  Wang, Han, Huang, Dong, Scott. "Multi-Similarity Loss with General Pair
  Weighting for Deep Metric Learning". CVPR 2019.
  https://arxiv.org/abs/1904.06627
  Official code: https://github.com/msight-tech/research-ms-loss
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from circle_jax.losses import _common
from circle_jax.losses import blockwise

Array = jax.Array


def _ms_mine(similarity: Array, pos: Array, neg: Array, *, epsilon,
             mining: bool) -> Tuple[Array, Array, Array, Array]:
  """The paper's pair mining; the decisions carry no gradient.

  A negative ``j`` of anchor ``i`` is kept if ``S_ij + epsilon > min_k S_ik``
  over the positives ``k``; a positive if ``S_ij - epsilon < max_k S_ik`` over
  the negatives ``k``. Both thresholds use the unmined sets.

  Returns:
    ``(pos, neg, min_pos, max_neg)``: the mined masks and the ``[M, 1]``
    minimum positive and maximum negative similarity (``+inf`` / ``-inf`` for
    an empty set). Mining keeps the extreme pair of a set whenever it keeps
    any, so these are also the extremes of the mined sets.
  """
  s = jax.lax.stop_gradient(similarity)
  min_pos = jnp.min(jnp.where(pos, s, jnp.inf), axis=-1, keepdims=True)
  max_neg = jnp.max(jnp.where(neg, s, -jnp.inf), axis=-1, keepdims=True)
  if mining:
    pos, neg = pos & (s - epsilon < max_neg), neg & (s + epsilon > min_pos)
  return pos, neg, min_pos, max_neg


def _ms_per_anchor(
    similarity: Array,
    pos: Array,
    neg: Array,
    *,
    alpha,
    beta,
    base,
    epsilon,
    mining: bool,
) -> Tuple[Array, Array]:
  """Per-anchor MS loss of an ``[M, N]`` block.

  Args:
    similarity: ``[M, N]`` float32 similarities.
    pos: ``[M, N]`` bool positive pairs (before mining).
    neg: ``[M, N]`` bool negative pairs (before mining).
    alpha, beta, base, epsilon, mining: see :func:`multi_similarity_loss`.

  Returns:
    ``(per_anchor, valid)``, both ``[M]``; ``valid`` marks anchors whose mined
    positive and negative sets are both non-empty (others give 0).
  """
  s = similarity
  pos, neg, min_pos, max_neg = _ms_mine(s, pos, neg, epsilon=epsilon,
                                        mining=mining)
  # One exp per pair for both sets, shifted by the set maxima that the
  # mining statistics already give; an empty set has lse = -inf (NaN stays).
  lse_p, lse_n = _common.two_set_logsumexp(
      -alpha * (s - base), beta * (s - base), pos, neg,
      shift=(-alpha * (min_pos - base), beta * (max_neg - base)))
  valid = (lse_p != -jnp.inf) & (lse_n != -jnp.inf)
  pos_term = jnp.logaddexp(0.0, lse_p) / alpha
  neg_term = jnp.logaddexp(0.0, lse_n) / beta
  return jnp.where(valid, pos_term + neg_term, 0.0), valid


def _check_hyper(alpha, beta, epsilon):
  _common.check_positive(alpha, "alpha")
  _common.check_positive(beta, "beta")
  if isinstance(epsilon, (int, float)) and epsilon < 0:
    raise ValueError(f"`epsilon` must be >= 0; got {epsilon}.")


def multi_similarity_loss_from_similarity(
    similarity: Array,
    labels: Array,
    *,
    alpha: float = 2.0,
    beta: float = 50.0,
    base: float = 0.5,
    epsilon: float = 0.1,
    mining: bool = True,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Array:
  r"""Multi-Similarity loss of a square similarity matrix.

  Row ``i`` is an anchor with positives ``P_i`` (same label, not ``i``) and
  negatives ``N_i`` (other labels), intersected with ``pos_mask`` /
  ``neg_mask``. With ``mining`` they are reduced to

  .. math::

    \tilde N_i = \{j \in N_i : S_{ij} + \epsilon > \min_{k \in P_i} S_{ik}\},
    \qquad
    \tilde P_i = \{j \in P_i : S_{ij} - \epsilon < \max_{k \in N_i} S_{ik}\},

  (decisions without gradient) and

  .. math::

    \ell_i = \frac{1}{\alpha} \log\Big[1 + \sum_{k \in \tilde P_i}
                 e^{-\alpha (S_{ik} - \lambda)}\Big]
           + \frac{1}{\beta} \log\Big[1 + \sum_{k \in \tilde N_i}
                 e^{\beta (S_{ik} - \lambda)}\Big],
    \qquad L = \frac{1}{B} \sum_i \ell_i,

  where ``l_i = 0`` if ``P~_i`` or ``N~_i`` is empty (also without mining).
  ``lambda`` is ``base``.

  Differences from the official code: self-pairs are excluded by index, not
  by ``S < 1 - 1e-5`` (so duplicated samples stay positives).

  Args:
    similarity: ``[B, B]`` float similarity matrix (row ``i``: anchor ``i``).
    labels: ``[B]`` integer labels.
    alpha: positive scale ``alpha`` (> 0; official code: 2, "scale_pos").
    beta: negative scale ``beta`` (> 0; default 50, the official code's
      configs use 40, "scale_neg").
    base: similarity margin ``lambda`` (official code: 0.5, "thresh").
    epsilon: mining margin ``epsilon`` (>= 0; official code: 0.1,
      "margin").
    mining: apply the pair mining above.
    pos_mask: optional ``[B, B]`` bool mask of usable positive pairs.
    neg_mask: optional ``[B, B]`` bool mask of usable negative pairs.

  Returns:
    float32 scalar: ``sum_i l_i / B``.

  References:
    Wang et al., "Multi-Similarity Loss with General Pair Weighting for Deep
    Metric Learning", CVPR 2019.
  """
  _check_hyper(alpha, beta, epsilon)
  similarity, labels = _common.check_similarity(similarity, labels)
  pos, neg = _common.pair_masks(labels, labels, 0, pos_mask, neg_mask)
  per_anchor, _ = _ms_per_anchor(similarity, pos, neg, alpha=alpha, beta=beta,
                                 base=base, epsilon=epsilon, mining=mining)
  return _common.to_float32_scalar(_common.sum_over_batch(per_anchor))


def multi_similarity_loss(
    embeddings: Array,
    labels: Array,
    *,
    alpha: float = 2.0,
    beta: float = 50.0,
    base: float = 0.5,
    epsilon: float = 0.1,
    mining: bool = True,
    axis_name=None,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
    block_size: Optional[int] = None,
) -> Array:
  r"""Multi-Similarity loss of a batch of embeddings.

  Cosine similarities ``S`` of the L2-normalised embeddings; per anchor

  .. math::

    \ell_i = \frac{1}{\alpha} \log\Big[1 + \sum_{k \in \tilde P_i}
                 e^{-\alpha (S_{ik} - \lambda)}\Big]
           + \frac{1}{\beta} \log\Big[1 + \sum_{k \in \tilde N_i}
                 e^{\beta (S_{ik} - \lambda)}\Big],

  with the mined sets of :func:`multi_similarity_loss_from_similarity`, and
  ``L = sum_i l_i / B``.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 embeddings.
    labels: ``[B]`` integer labels.
    alpha: positive scale ``alpha`` (> 0).
    beta: negative scale ``beta`` (> 0).
    base: similarity margin ``lambda``.
    epsilon: mining margin ``epsilon`` (>= 0).
    mining: apply the paper's pair mining.
    axis_name: optional mapped axis (``jax.shard_map`` / ``jax.pmap``): local
      anchors against the gathered global batch; the value is the loss of the
      global batch (divided by the global batch size) on every device, with
      the single-device gradient.
    pos_mask: optional ``[B, B_global]`` bool mask of usable positive pairs.
    neg_mask: optional ``[B, B_global]`` bool mask of usable negative pairs.
    block_size: ``None`` (default) builds the ``[B, B_global]`` similarity
      block at once. An integer processes anchor rows and candidate columns
      in blocks of that size (online logsumexp / weighted sums, and a
      ``custom_vjp`` that recomputes blocks in the backward pass), so memory
      is ``O(block_size^2 + B * D)`` instead of ``O(B^2)``; values and gradients
      equal the dense ones to float32 rounding. See
      :mod:`circle_jax.losses.blockwise`.

  Returns:
    float32 scalar: ``sum_i l_i / B``.

  References:
    Wang et al., "Multi-Similarity Loss with General Pair Weighting for Deep
    Metric Learning", CVPR 2019.
  """
  if block_size is not None:
    return blockwise.multi_similarity_loss_blockwise(
        embeddings, labels, block_size=block_size, alpha=alpha,
        beta=beta, base=base, epsilon=epsilon, mining=mining,
        axis_name=axis_name, pos_mask=pos_mask, neg_mask=neg_mask)
  _check_hyper(alpha, beta, epsilon)
  similarity, pos, neg, _ = _common.pair_block(
      embeddings, labels, axis_name, pos_mask, neg_mask)
  per_anchor, _ = _ms_per_anchor(similarity, pos, neg, alpha=alpha, beta=beta,
                                 base=base, epsilon=epsilon, mining=mining)
  return _common.to_float32_scalar(
      _common.sum_over_batch(per_anchor, axis_name))


def multi_similarity_weights(
    similarity: Array,
    labels: Array,
    *,
    alpha: float = 2.0,
    beta: float = 50.0,
    base: float = 0.5,
    epsilon: float = 0.1,
    mining: bool = True,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Tuple[Array, Array]:
  r"""The MS loss's closed-form pair weights ``w+`` and ``w-``.

  For a mined positive ``j`` and negative ``j`` of a valid anchor ``i``:

  .. math::

    w^+_{ij} = \frac{1}{e^{\alpha (S_{ij} - \lambda)}
                        + \sum_{k \in \tilde P_i} e^{\alpha (S_{ij} - S_{ik})}},
    \qquad
    w^-_{ij} = \frac{1}{e^{-\beta (S_{ij} - \lambda)}
                        + \sum_{k \in \tilde N_i} e^{\beta (S_{ik} - S_{ij})}},

  evaluated stably as ``exp(logit_ij - log(1 + sum_k exp(logit_ik)))``; 0 for
  unmined pairs and anchors that contribute no loss. In the General Pair
  Weighting view, ``dL/dS_ij = (-w+_ij or +w-_ij) / B`` for
  :func:`multi_similarity_loss_from_similarity` (see
  :func:`circle_jax.losses.pair_weights`).

  Args:
    similarity: ``[B, B]`` float similarity matrix.
    labels: ``[B]`` integer labels.
    alpha, beta, base, epsilon, mining, pos_mask, neg_mask: as in
      :func:`multi_similarity_loss_from_similarity`.

  Returns:
    ``(w_pos, w_neg)``: two ``[B, B]`` float32 arrays, without the ``1/B``
    factor.

  References:
    Wang et al., "Multi-Similarity Loss with General Pair Weighting for Deep
    Metric Learning", CVPR 2019.
  """
  _check_hyper(alpha, beta, epsilon)
  similarity, labels = _common.check_similarity(similarity, labels)
  pos, neg = _common.pair_masks(labels, labels, 0, pos_mask, neg_mask)
  s = jax.lax.stop_gradient(similarity)
  pos, neg, _, _ = _ms_mine(s, pos, neg, epsilon=epsilon, mining=mining)
  valid = (jnp.any(pos, axis=-1) & jnp.any(neg, axis=-1))[:, None]

  def weights(logits, mask):
    log_norm = _common.log1p_sum_exp(logits, mask)[:, None]
    keep = mask & valid
    return jnp.where(keep, jnp.exp(jnp.where(keep, logits - log_norm, 0.0)),
                     0.0)

  return (weights(-alpha * (s - base), pos), weights(beta * (s - base), neg))
