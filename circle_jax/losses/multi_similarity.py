"""Multi-Similarity loss with its pair mining (Wang et al., CVPR 2019).

The loss is a rule on a similarity block ``[M, N]`` (:class:`MultiSimilarity`,
run by :mod:`circle_jax.losses.engine`), exposed as a square similarity-matrix form
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

import types
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import entries
from circle_jax.losses import ranges
from circle_jax.losses import engine

Array = jax.Array


@engine.rule_dataclass(meta=("mining",))
class MultiSimilarity(engine.PairRule):
  """Multi-Similarity rule: the paper's pair mining and two soft-plus terms.

  Its fields are the defaults of every form of the loss (and of
  :func:`circle_jax.losses.multi_similarity_miner`'s ``epsilon``).

  Mining (``mining=True``): a negative ``j`` of anchor ``i`` is kept if
  ``S_ij + epsilon > min_k S_ik`` over the positives ``k``; a positive if
  ``S_ij - epsilon < max_k S_ik`` over the negatives ``k``. Both thresholds
  come from the unmined sets (the pre-pass) and the decisions carry no
  gradient. Mining keeps the extreme pair of a set whenever it keeps any,
  so the pre-pass statistics also give each mined set's logit maximum.

  Attributes:
    alpha, beta, base, epsilon: the scales, similarity margin and mining
      margin, with their ranges (``ranges``) and the official code's values
      in :func:`multi_similarity_loss_from_similarity`.
    mining: apply the pair mining (static).
  """

  alpha: float = 2.0
  beta: float = 50.0
  base: float = 0.5
  epsilon: float = 0.1
  mining: bool = True

  prepass = (("min", "pos"), ("max", "neg"))
  reduction = "batch_mean"

  ranges = types.MappingProxyType({
      "alpha": ranges.SCALE_RANGE,
      "beta": ranges.SCALE_RANGE,
      "base": ranges.SIMILARITY_MARGIN_RANGE,
      "epsilon": ranges.NONNEGATIVE_RANGE})

  def select(self, s, pos, neg, pre):
    if not self.mining:
      return pos, neg
    min_pos, max_neg = pre
    return (pos & (s - self.epsilon < max_neg),
            neg & (s + self.epsilon > min_pos))

  def logits(self, s):
    return -self.alpha * (s - self.base), self.beta * (s - self.base)

  def shift(self, pre):
    min_pos, max_neg = pre
    return (-self.alpha * (min_pos - self.base),
            self.beta * (max_neg - self.base))

  def combine(self, lse_p, lse_n):
    # An anchor whose (mined) positive or negative set is empty contributes 0
    # (with or without mining).
    valid = engine.both_sets_nonempty(lse_p, lse_n)
    pos_term = jnp.logaddexp(0.0, lse_p) / self.alpha
    neg_term = jnp.logaddexp(0.0, lse_n) / self.beta
    return jnp.where(valid, pos_term + neg_term, 0.0), valid


def multi_similarity_loss_from_similarity(
    similarity: Array, labels: Array, *, alpha: float = MultiSimilarity.alpha,
    beta: float = MultiSimilarity.beta, base: float = MultiSimilarity.base,
    epsilon: float = MultiSimilarity.epsilon,
    mining: bool = MultiSimilarity.mining, pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None) -> Array:
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
    alpha: positive scale ``alpha``, in [1e-6, 1e4] (official code: 2,
      "scale_pos").
    beta: negative scale ``beta``, in [1e-6, 1e4] (default 50, the official
      code's configs use 40, "scale_neg").
    base: similarity margin ``lambda``, in [-1, 1] (official code: 0.5,
      "thresh").
    epsilon: mining margin ``epsilon``, >= 0 (official code: 0.1,
      "margin").
    mining: apply the pair mining above.
    pos_mask: optional ``[B, B]`` bool mask of usable positive pairs.
    neg_mask: optional ``[B, B]`` bool mask of usable negative pairs.

  Returns:
    float32 scalar: ``sum_i l_i / B``.

  References:
    as :func:`multi_similarity_loss`.
  """
  return engine.matrix_loss(
      MultiSimilarity(alpha=alpha, beta=beta, base=base, epsilon=epsilon,
                      mining=mining),
      similarity, labels, pos_mask=pos_mask, neg_mask=neg_mask)


def multi_similarity_loss(embeddings: Array, labels: Array, *,
                          alpha: float = MultiSimilarity.alpha,
                          beta: float = MultiSimilarity.beta,
                          base: float = MultiSimilarity.base,
                          epsilon: float = MultiSimilarity.epsilon,
                          mining: bool = MultiSimilarity.mining,
                          **options) -> Array:
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
    alpha: positive scale ``alpha``, in [1e-6, 1e4].
    beta: negative scale ``beta``, in [1e-6, 1e4].
    base: similarity margin ``lambda``, in [-1, 1].
    epsilon: mining margin ``epsilon``, >= 0.
    mining: apply the paper's pair mining.
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar: ``sum_i l_i / B``.

  References:
    Wang et al., "Multi-Similarity Loss with General Pair Weighting for Deep
    Metric Learning", CVPR 2019.
  """
  rule = MultiSimilarity(alpha=alpha, beta=beta, base=base, epsilon=epsilon,
                         mining=mining)
  return engine.embedding_loss(rule, embeddings, labels, **options)


def multi_similarity_weights(
    similarity: Array, labels: Array, *, alpha: float = MultiSimilarity.alpha,
    beta: float = MultiSimilarity.beta, base: float = MultiSimilarity.base,
    epsilon: float = MultiSimilarity.epsilon,
    mining: bool = MultiSimilarity.mining, pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None) -> Tuple[Array, Array]:
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
  rule = MultiSimilarity(alpha=alpha, beta=beta, base=base, epsilon=epsilon,
                         mining=mining)
  similarity, labels, pos, neg = engine.square_block(similarity, labels,
                                                     pos_mask, neg_mask)
  s = jax.lax.stop_gradient(similarity)
  pos, neg = engine.selected_pairs(rule, s, pos, neg)
  valid = (jnp.any(pos, axis=-1) & jnp.any(neg, axis=-1))[:, None]

  def weights(logits, mask):
    log_norm = ops.log1p_sum_exp(logits, mask)[:, None]
    keep = mask & valid
    return jnp.where(keep, jnp.exp(jnp.where(keep, logits - log_norm, 0.0)),
                     0.0)

  logit_p, logit_n = rule.logits(s)
  return weights(logit_p, pos), weights(logit_n, neg)


REGISTRY = (
    entries.entry("multi_similarity", multi_similarity_loss,
        "pair", rule=MultiSimilarity,
        paper="Wang et al., \"Multi-Similarity Loss with General Pair "
              "Weighting for Deep Metric Learning\", CVPR 2019",
        reduction="sum over anchors / batch size (mined-out anchors "
                  "count as 0)"),
)
