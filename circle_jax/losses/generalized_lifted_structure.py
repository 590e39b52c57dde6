r"""Generalised lifted structure loss (Hermans et al. 2017, p. 4), a rule.

Per anchor ``a``, on Euclidean distances ``d`` of the L2-normalised
embeddings,

.. math::

  \ell_a = \Big[\operatorname*{LSE}_{p \in P_a} (d_{ap} - m_p)
               + \operatorname*{LSE}_{n \in N_a} (m_n - d_{an})\Big]_+ ,

two disjoint log-sum-exps per anchor (like Circle's), so it runs dense,
blockwise and on the device ring.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses import ranges


@engine.rule_dataclass
class GeneralizedLiftedStructure(engine.PairRule):
  """Generalised lifted structure rule: ``[LSE_P (d - m_p) + LSE_N (m_n -
  d)]_+`` per anchor with both sets.

  Attributes:
    neg_margin: ``m_n`` (the paper's ``m``), in [0, 2].
    pos_margin: ``m_p`` (0 in the paper), in [0, 2].
  """

  neg_margin: float = 1.0
  pos_margin: float = 0.0

  ranges = types.MappingProxyType({
      "neg_margin": ranges.DISTANCE_MARGIN_RANGE,
      "pos_margin": ranges.DISTANCE_MARGIN_RANGE})

  def prepare(self, s):
    return self.geometry.to_distance(s)

  def logits(self, d):
    return d - self.pos_margin, self.neg_margin - d

  def combine(self, lse_p, lse_n):
    valid = engine.both_sets_nonempty(lse_p, lse_n)
    x = jnp.where(valid, lse_p + lse_n, 0.0)
    return jnp.where(valid, jax.nn.relu(x), 0.0), valid


def generalized_lifted_structure_loss(
    embeddings: jax.Array, labels: jax.Array, *,
    neg_margin: float = GeneralizedLiftedStructure.neg_margin,
    pos_margin: float = GeneralizedLiftedStructure.pos_margin,
    **options) -> jax.Array:
  r"""Generalised lifted structure loss (Hermans, Beyer, Leibe 2017, p. 4).

  .. math::

    L = \operatorname*{mean}_{a:\ P_a, N_a \ne \emptyset}
      \Big[\log \sum_{p \in P_a} e^{d_{ap} - m_p}
           + \log \sum_{n \in N_a} e^{m_n - d_{an}}\Big]_+ ,

  ``d`` the Euclidean distance of the L2-normalised embeddings (on another
  geometry, its distance), ``P_a`` / ``N_a`` the anchor's positives and
  negatives (with miner masks, the masked sets).

  Reduction: mean over the anchors with at least one positive and one
  negative; the others contribute 0 with zero gradient.

  Differences from pytorch-metric-learning 2.9
  (``GeneralizedLiftedStructureLoss(neg_margin, pos_margin)``, same names
  and defaults): equal value and gradient when every anchor has a positive
  and a negative (tested to float32 rounding). PML takes an empty set's
  log-sum-exp as 0, so an anchor without positives still costs
  ``[LSE_N (m_n - d)]_+``, and averages over every anchor (its
  ``MeanReducer``); the paper, written for P x K batches, never has an
  empty set, and here such an anchor adds nothing (the mean is over the
  anchors with both sets).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    neg_margin: ``m_n``, the paper's margin ``m``, in [0, 2].
    pos_margin: ``m_p``, subtracted from the positive distances (not in
      the paper, PML's option), in [0, 2].
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Hermans, Beyer, Leibe, "In Defense of the Triplet Loss for Person
    Re-Identification", arXiv:1703.07737, 2017 (the generalised lifted
    structure loss of its Sec. 2); Oh Song, Xiang, Jegelka, Savarese, "Deep
    Metric Learning via Lifted Structured Feature Embedding", CVPR 2016.
  """
  rule = GeneralizedLiftedStructure(neg_margin=neg_margin,
                                    pos_margin=pos_margin)
  return engine.embedding_loss(rule, embeddings, labels, **options)


REGISTRY = (
    entries.entry("generalized_lifted_structure",
        generalized_lifted_structure_loss, "pair",
        rule=GeneralizedLiftedStructure,
        paper="Hermans et al., \"In Defense of the Triplet Loss for Person "
              "Re-Identification\", arXiv 2017 (generalised lifted "
              "structure)",
        reduction="mean over anchors with >= 1 positive and >= 1 "
                  "negative"),
)
