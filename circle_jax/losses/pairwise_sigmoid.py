r"""SigLIP's pairwise sigmoid loss with label-defined positives, a rule.

Zhai et al.'s sigmoid loss treats every pair as an independent binary
classification: for anchor ``i`` and candidate ``j`` with ``z_ij = 1`` for a
positive (same label) and ``-1`` for a negative,

.. math::

  \ell_i = \sum_{j \ne i} \log\big(1 + \exp(-z_{ij}\,(t\,s_{ij} + b))\big),

summed over the anchor's pairs and divided by the batch size (SigLIP's
``-1/|B| sum_i sum_j log sigmoid``). The rule's statistic is ``"sum"`` (per
anchor, the sum over each set), so it runs on every engine.

Differences from the paper: SigLIP pairs image ``i`` with text ``j`` of two
towers and its positives are the diagonal; here one tower's embeddings meet
each other (or the references), a pair's label says whether it is positive,
and self pairs are excluded. ``t`` and ``b`` are learned in SigLIP
(``t = exp(t')``, initialised ``t' = log 10``, ``b = -10``); here they are
hyperparameters fixed at those initial values: the tiled engines give a
rule's hyperparameters no gradient, so a learned ``t``, ``b`` would train
only under the dense engine.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from circle_jax.losses import entries
from circle_jax.losses import engine
from circle_jax.losses import ranges

Array = jax.Array

BIAS_RANGE = ranges.HyperRange(-1e4, 1e4)


@engine.rule_dataclass
class PairwiseSigmoid(engine.PairRule):
  """Pairwise sigmoid rule: per anchor, the sum of the pairs' log-sigmoid
  losses; reduced by the global batch size.

  Attributes:
    t: the logit scale ``t > 0`` (SigLIP's ``exp(t')``, init 10).
    b: the logit bias ``b`` (SigLIP's init -10).
  """

  t: float = 10.0
  b: float = -10.0

  statistic = "sum"
  reduction = "batch_mean"
  ranges = types.MappingProxyType({"t": ranges.SCALE_RANGE,
                                   "b": BIAS_RANGE})

  def values(self, x):
    logit = self.t * x + self.b
    return jax.nn.softplus(-logit), jax.nn.softplus(logit)

  def combine(self, sum_count_p, sum_count_n):
    total = sum_count_p[0] + sum_count_n[0]
    return total, jnp.ones(total.shape, bool)


def pairwise_sigmoid_loss(embeddings: Array, labels: Array, *,
                          t: float = PairwiseSigmoid.t,
                          b: float = PairwiseSigmoid.b, **options) -> Array:
  r"""Pairwise sigmoid loss with label positives (Zhai et al., ICCV 2023).

  .. math::

    L = \frac{1}{B} \sum_i \Big[\sum_{p \in P(i)}
      \log(1 + e^{-(t s_{ip} + b)})
      + \sum_{n \in N(i)} \log(1 + e^{t s_{in} + b})\Big],

  ``s`` the cosine similarity (or ``-d_c`` on the Poincaré ball), ``B`` the
  global batch size, ``P(i)`` / ``N(i)`` the anchor's positives / negatives
  (miner masks restrict them; self pairs never count).

  Reduction: sum over pairs / global batch size (SigLIP's). An anchor
  without pairs contributes 0.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    t: the logit scale, in [1e-6, 1e4] (SigLIP's ``exp(t')`` at its init
      ``t' = log 10``; fixed here, not learned: module docstring).
    b: the logit bias, in [-1e4, 1e4] (SigLIP's init -10, fixed here).
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Zhai, Mustafa, Kolesnikov, Beyer, "Sigmoid Loss for Language Image
    Pre-Training", ICCV 2023.
  """
  rule = PairwiseSigmoid(t=t, b=b)
  return engine.embedding_loss(rule, embeddings, labels, **options)


REGISTRY = (
    entries.entry("pairwise_sigmoid", pairwise_sigmoid_loss,
        "pair", rule=PairwiseSigmoid,
        paper="Zhai et al., \"Sigmoid Loss for Language Image "
              "Pre-Training\", ICCV 2023 (label positives, fixed t, b)",
        reduction="sum over pairs / batch size"),
)
