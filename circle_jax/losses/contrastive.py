"""Two-margin contrastive loss (Hadsell et al. 2006), a rule.

Per anchor, the rule keeps the sums and counts of the non-zero hinges of
each set (the ``"sum"`` statistic); its own reduction turns them into the
global per-pair means, so it runs on every engine (dense, blockwise, ring).
"""

from __future__ import annotations

import types

from typing import Optional

import jax

from circle_jax.losses import entries
from circle_jax.losses import engine
from circle_jax.losses import ranges

Array = jax.Array


@engine.rule_dataclass(meta=("on_distance",))
class Contrastive(engine.PairSetMeans):
  """Two-margin contrastive rule: per anchor, the sums and counts of the
  non-zero hinges of each set, reduced to global per-pair means.

  Its fields are the defaults of both forms of the loss.

  Attributes:
    pos_margin: ``m_+``, in [0, 2]: positives closer than this are not
      pulled.
    neg_margin: ``m_-``, in [0, 2]: negatives farther than this are not
      pushed (distances of unit vectors lie in [0, 2]).
    on_distance: static; see :func:`circle_jax.losses.engine.as_distance`.
  """

  pos_margin: float = 0.0
  neg_margin: float = 0.5
  on_distance: bool = False

  pair_terms = True

  ranges = types.MappingProxyType({
      "pos_margin": ranges.DISTANCE_MARGIN_RANGE,
      "neg_margin": ranges.DISTANCE_MARGIN_RANGE})

  def prepare(self, s):
    return engine.as_distance(self, s)

  def values(self, d):
    return (jax.nn.relu(d - self.pos_margin),
            jax.nn.relu(self.neg_margin - d))

  def select(self, d, pos, neg, pre):
    del pre
    v_p, v_n = self.values(d)
    return pos & (v_p > 0), neg & (v_n > 0)  # the non-zero pair terms



def contrastive_loss_from_distance(distance: Array, labels: Array, *,
                                   pos_margin: float = Contrastive.pos_margin,
                                   neg_margin: float = Contrastive.neg_margin,
                                   pos_mask: Optional[Array] = None,
                                   neg_mask: Optional[Array] = None) -> Array:
  """Contrastive loss of a square ``[B, B]`` distance matrix.

  See :func:`contrastive_loss`; ``distance`` replaces the Euclidean distances
  of the normalised embeddings.
  """
  return engine.distance_matrix_loss(
      Contrastive(pos_margin=pos_margin, neg_margin=neg_margin), distance,
      labels, pos_mask=pos_mask, neg_mask=neg_mask)


def contrastive_loss(embeddings: Array, labels: Array, *,
                     pos_margin: float = Contrastive.pos_margin,
                     neg_margin: float = Contrastive.neg_margin,
                     **options) -> Array:
  r"""Two-margin contrastive loss (Hadsell et al. 2006; Musgrave et al. 2020).

  On Euclidean distances ``d`` between L2-normalised embeddings:

  .. math::

    L = \operatorname*{mean}_{(i,j) \in P,\ \ell^+_{ij} > 0} \ell^+_{ij}
      + \operatorname*{mean}_{(i,j) \in N,\ \ell^-_{ij} > 0} \ell^-_{ij},
    \quad \ell^+_{ij} = [d_{ij} - m_+]_+,\ \ell^-_{ij} = [m_- - d_{ij}]_+ .

  Reduction: positive and negative pair terms are each averaged over the
  ordered pairs with a non-zero term (pytorch-metric-learning's
  ``AvgNonZeroReducer``, used by "A Metric Learning Reality Check") and
  summed; a side with no non-zero pair contributes 0. The distances are not
  squared (Hadsell et al. square them; the Reality Check form does not).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    pos_margin: ``m_+``, in [0, 2]: positives closer than this are not
      pulled.
    neg_margin: ``m_-``, in [0, 2]: negatives farther than this are not
      pushed.
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Hadsell, Chopra, LeCun, "Dimensionality Reduction by Learning an
    Invariant Mapping", CVPR 2006. Musgrave, Belongie, Lim, "A Metric
    Learning Reality Check", ECCV 2020.
  """
  rule = Contrastive(pos_margin=pos_margin, neg_margin=neg_margin)
  return engine.embedding_loss(rule, embeddings, labels, **options)


REGISTRY = (
    entries.entry("contrastive", contrastive_loss, "pair", rule=Contrastive,
        paper="Hadsell, Chopra, LeCun, CVPR 2006; two-margin form of "
              "Musgrave et al., \"A Metric Learning Reality Check\", "
              "ECCV 2020",
        reduction="mean over non-zero positive pairs + mean over "
                  "non-zero negative pairs"),
)
