"""Ranked List Loss (Wang et al., CVPR 2019; TPAMI 2021).

Every sample is used in turn as a query; the rest of the batch is its ranked
list, split into a positive and a negative set. The loss pushes the negatives
beyond a boundary ``alpha`` and pulls the positives inside ``alpha - margin``
(a hypersphere per class, not a point), so the two sets are separated by
``margin``. Only the non-trivial pairs (those that violate their boundary)
contribute, and the negatives are weighted by how much they violate it.

The loss is a rule on an ``[M, N]`` block (:class:`RankedList`, run by
:mod:`circle_jax.losses.engine`), exposed as a public square distance-matrix form
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

import types

from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax.losses import entries
from circle_jax.losses import ranges
from circle_jax.losses import engine

Array = jax.Array


@engine.rule_dataclass(meta=("on_distance",))
class RankedList(engine.PairRule):
  """Ranked List rule on distances: non-trivial pairs, hinges, weighted means.

  Its fields are the defaults of every form of the loss (the paper's:
  ``alpha = 1 + m/2 = 1.2``, ``m = 0.4``, ``T_n = 10``, ``T_p = 0``,
  ``lambda = 0.5``). The hinges and non-trivial sets are also used by the
  Ranked Proxy-Anchor loss.

  Attributes:
    alpha: the negative boundary ``alpha``, in (0, 2] (distances of unit
      vectors lie in [0, 2]).
    margin: the gap ``m`` between the positive boundary ``alpha - m`` and the
      negative boundary, in [0, 2].
    t_neg: temperature ``T_n`` of the negative weighting, in [0, 1e4] (0:
      plain mean).
    t_pos: temperature ``T_p`` of the positive weighting, in [0, 1e4] (0:
      plain mean).
    imbalance: ``lambda``, the weight of the negative term, in [0, 1].
    on_distance: static; see :func:`circle_jax.losses.engine.as_distance`.
  """

  alpha: float = 1.2
  margin: float = 0.4
  t_neg: float = 10.0
  t_pos: float = 0.0
  imbalance: float = 0.5
  on_distance: bool = False

  statistic = "mean"
  reduction = "batch_mean"

  ranges = types.MappingProxyType({
      "alpha": ranges.HyperRange(0.0, 2.0, False, True),
      "margin": ranges.DISTANCE_MARGIN_RANGE,
      "t_neg": ranges.TEMPERATURE_RANGE,
      "t_pos": ranges.TEMPERATURE_RANGE,
      "imbalance": ranges.UNIT_INTERVAL})

  def prepare(self, s):
    return engine.as_distance(self, s)

  def hinges(self, d):
    """``(d - (alpha - m), alpha - d)``: positive and negative violations."""
    return d - (self.alpha - self.margin), self.alpha - d

  def select(self, d, pos, neg, pre):
    del pre
    v_p, v_n = self.hinges(d)
    return pos & (v_p > 0), neg & (v_n > 0)  # the non-trivial pairs

  def values(self, d):
    return self.hinges(d)

  def logits(self, d):
    v_p, v_n = self.hinges(d)
    return self.t_pos * v_p, self.t_neg * v_n

  def combine(self, mean_p, mean_n):
    loss = (1.0 - self.imbalance) * mean_p + self.imbalance * mean_n
    return loss, jnp.ones(loss.shape, bool)


def ranked_list_loss_from_distance(
    distance: Array, labels: Array, *, alpha: float = RankedList.alpha,
    margin: float = RankedList.margin, t_neg: float = RankedList.t_neg,
    t_pos: float = RankedList.t_pos, imbalance: float = RankedList.imbalance,
    pos_mask: Optional[Array] = None, neg_mask: Optional[Array] = None,
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
    alpha: the negative boundary :math:`\alpha`, in (0, 2] (the distances
      are those of unit vectors, in [0, 2]).
    margin: the gap :math:`m`, in [0, 2], between the positive boundary
      :math:`\alpha - m` and the negative boundary.
    t_neg: temperature :math:`T_n` of the negative weighting, in [0, 1e4]
      (0: plain mean).
    t_pos: temperature :math:`T_p` of the positive weighting, in [0, 1e4]
      (0: plain mean).
    imbalance: :math:`\lambda`, the weight of the negative term, in [0, 1].
    pos_mask: optional ``[B, B]`` bool mask of the positive pairs to use
      (e.g. from a miner), intersected with the label mask.
    neg_mask: optional ``[B, B]`` bool mask of the negative pairs to use.

  Returns:
    A float32 scalar: the mean over all ``B`` anchors.

  References:
    Wang et al., "Ranked List Loss for Deep Metric Learning", CVPR 2019 and
    TPAMI 2021.
  """
  return engine.distance_matrix_loss(
      RankedList(alpha=alpha, margin=margin, t_neg=t_neg, t_pos=t_pos,
                 imbalance=imbalance),
      distance, labels, pos_mask=pos_mask, neg_mask=neg_mask)


def ranked_list_loss_from_similarity(
    similarity: Array, labels: Array, *, alpha: float = RankedList.alpha,
    margin: float = RankedList.margin, t_neg: float = RankedList.t_neg,
    t_pos: float = RankedList.t_pos, imbalance: float = RankedList.imbalance,
    pos_mask: Optional[Array] = None, neg_mask: Optional[Array] = None,
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
  return engine.matrix_loss(
      RankedList(alpha=alpha, margin=margin, t_neg=t_neg, t_pos=t_pos,
                 imbalance=imbalance),
      similarity, labels, pos_mask=pos_mask, neg_mask=neg_mask)


def ranked_list_loss(embeddings: Array, labels: Array, *,
                     alpha: float = RankedList.alpha,
                     margin: float = RankedList.margin,
                     t_neg: float = RankedList.t_neg,
                     t_pos: float = RankedList.t_pos,
                     imbalance: float = RankedList.imbalance,
                     **options) -> Array:
  r"""Ranked List Loss (RLL) on the Euclidean distance of normalised embeddings.

  Each anchor's positives should lie within :math:`\alpha - m` and its
  negatives beyond :math:`\alpha`; per anchor

  .. math::

    L(i) = (1 - \lambda) \operatorname{wmean}_{j \in P^*_i}
           [d_{ij} - (\alpha - m)]
         + \lambda \operatorname{wmean}_{j \in N^*_i} [\alpha - d_{ij}]

  over the non-trivial positives (:math:`d > \alpha - m`) and negatives
  (:math:`d < \alpha`), with weights :math:`e^{T_p (d - (\alpha - m))}` and
  :math:`e^{T_n (\alpha - d)}` normalised per anchor (max-shifted, the
  shifted exponents clamped at 0, so finite for any temperature; in the
  documented range ``[0, 1e4]`` float32 rounding of the distances moves the
  weights by at most ~0.1%) and held constant in backpropagation. See
  :func:`ranked_list_loss_from_distance` for the full formula.

  The distance is :math:`d_{ij} = \|\hat x_i - \hat x_j\| = \sqrt{2 - 2
  \cos(x_i, x_j)}` between L2-normalised embeddings (zero vectors stay zero).
  Defaults are the paper's (``alpha = 1 + m/2 = 1.2``, ``m = 0.4``,
  ``T_n = 10``, ``T_p = 0``, ``lambda = 0.5``).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 embeddings (raw; normalised
      inside, computed in float32).
    labels: ``[B]`` integer labels.
    alpha: the negative boundary :math:`\alpha`, in (0, 2].
    margin: the gap :math:`m` between the positive and negative boundaries,
      in [0, 2].
    t_neg: temperature :math:`T_n` of the negative weighting, in [0, 1e4].
    t_pos: temperature :math:`T_p` of the positive weighting, in [0, 1e4].
    imbalance: :math:`\lambda`, the weight of the negative term, in [0, 1].
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    A float32 scalar: the mean of the per-anchor losses over all anchors of
    the (global) batch.

  References:
    Wang et al., "Ranked List Loss for Deep Metric Learning", CVPR 2019,
    https://arxiv.org/abs/1903.03238, and TPAMI 2021.
  """
  return engine.embedding_loss(
      RankedList(alpha=alpha, margin=margin, t_neg=t_neg, t_pos=t_pos,
                 imbalance=imbalance),
      embeddings, labels, **options)


REGISTRY = (
    entries.entry("ranked_list", ranked_list_loss, "pair", rule=RankedList,
        paper="Wang et al., \"Ranked List Loss for Deep Metric "
              "Learning\", CVPR 2019",
        reduction="mean over all anchors"),
)
