r"""Intra-pair variance loss (Yu and Tao, ICCV 2019), rules in three passes.

With ``mu_P`` and ``mu_N`` the means of the similarities over *all*
positive and *all* negative pairs of the (global) batch,

.. math::

  L = \frac{1}{|P|} \sum_{(a,p) \in P} [(1 - \epsilon_p) \mu_P - s_{ap}]_+^2
    + \frac{1}{|N|} \sum_{(a,n) \in N} [s_{an} - (1 + \epsilon_n) \mu_N]_+^2 .

A pair's term reads a statistic of the whole batch, not of its anchor, so it
is not one rule; but each factor is a global mean over one set's pairs,
which every engine computes (a ``"sum"`` rule with a ratio-of-sums
reduction). Per set, three passes on the chosen engine:

1. ``mu`` (with its gradient);
2. the squared hinges at ``mu`` held constant (the value, and the gradient
   through the pairs' own similarities);
3. the mean hinge at ``mu`` held constant, no gradient: with it,
   ``dL/dmu = 2 (1 - eps_p) mean_P [.]_+`` (positives) or
   ``-2 (1 + eps_n) mean_N [.]_+`` (negatives), and the loss adds
   ``dL/dmu * (mu - stop_gradient(mu))``: zero in value, the gradient through
   ``mu`` in backprop.

So it runs dense, blockwise and on the device ring with the exact gradient
(the tiled engines give their hyperparameters no cotangent, so ``mu`` may not
carry its gradient through a rule's field; pass 3 carries it instead).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses import ranges
from circle_jax.losses.engine import reductions

Array = jax.Array

class SetMean(engine.PairRule):
  """The global mean over one set's pairs (``side``: ``"pos"`` or
  ``"neg"``) of ``pair_value(s)`` (here the similarity itself)."""

  side = "pos"
  statistic = "sum"

  def pair_value(self, s):
    return s

  def values(self, s):
    v, zero = self.pair_value(s), jnp.zeros_like(s)
    return (v, zero) if self.side == "pos" else (zero, v)

  def combine(self, sum_count_p, sum_count_n):
    terms = sum_count_p if self.side == "pos" else sum_count_n
    return terms, terms[1] > 0

  def reduce(self, terms, valid, axis_name):
    del valid
    return reductions.ratio_of_sums(*terms, axis_name)


@engine.rule_dataclass
class PositiveMean(SetMean):
  """``mu_P``, the mean similarity of the positive pairs."""


@engine.rule_dataclass
class NegativeMean(SetMean):
  """``mu_N``, the mean similarity of the negative pairs."""

  side = "neg"


@engine.rule_dataclass(meta=("side", "power"))
class VarianceHinge(SetMean):
  """``[(1 - eps) mu - s]_+ ** power`` over the positive pairs, or ``[s -
  (1 + eps) mu]_+ ** power`` over the negative pairs, ``mu`` a constant
  (its gradient is :func:`intra_pair_variance_loss`'s)."""

  side: str = "pos"
  eps: float = 0.01
  mu: float = 0.0
  power: int = 2

  def pair_value(self, s):
    mu = jax.lax.stop_gradient(self.mu)
    if self.side == "pos":
      hinge = jax.nn.relu((1.0 - self.eps) * mu - s)
    else:
      hinge = jax.nn.relu(s - (1.0 + self.eps) * mu)
    return hinge if self.power == 1 else jnp.square(hinge)


@engine.rule_dataclass
class IntraPairVariance(engine.PairRule):
  """The intra-pair variance loss's hyperparameters and documented ranges
  (the loss runs :class:`SetMean` and :class:`VarianceHinge`).

  Attributes:
    pos_eps: ``epsilon_p``, in [0, 1].
    neg_eps: ``epsilon_n``, in [0, 1].
  """

  pos_eps: float = 0.01
  neg_eps: float = 0.01

  ranges = types.MappingProxyType({
      "pos_eps": ranges.HyperRange(0.0, 1.0),
      "neg_eps": ranges.HyperRange(0.0, 1.0)})


def _set_term(side, eps, embeddings, labels, options):
  """One set's term (module docstring: three passes)."""
  run = lambda r: engine.embedding_loss(r, embeddings, labels, **options)
  mu = run(PositiveMean() if side == "pos" else NegativeMean())
  held = jax.lax.stop_gradient(mu)
  hinge = VarianceHinge(side=side, eps=eps, mu=held, power=2)
  value = run(hinge)
  mean_hinge = jax.lax.stop_gradient(
      run(VarianceHinge(side=side, eps=eps, mu=held, power=1)))
  slope = 2.0 * (1.0 - eps) if side == "pos" else -2.0 * (1.0 + eps)
  return value + slope * mean_hinge * (mu - held)


def _reduced(embeddings, labels, pos_eps, neg_eps, reduction, options):
  """``reduction`` of the pair terms on the dense block, ``mu_P`` and
  ``mu_N`` global means differentiated by autodiff."""
  axis_name = options.get("axis_name")
  rows, _, s, pos, neg = engine.dense_block(
      embeddings, labels, loss="intra-pair variance loss with `reduction`",
      reason="its pair terms need the whole block", **options)
  mu_p, mu_n = (reductions.ratio_of_sums(jnp.where(m, s, 0.0), m, axis_name)
                for m in (pos, neg))
  terms_p = jnp.square(jax.nn.relu((1.0 - pos_eps) * mu_p - s))
  terms_n = jnp.square(jax.nn.relu(s - (1.0 + neg_eps) * mu_n))
  return engine.reduce_pair_sets(((terms_p, pos), (terms_n, neg)), reduction,
                                 labels=rows.labels, axis_name=axis_name)


def intra_pair_variance_loss(embeddings: Array, labels: Array, *,
                             pos_eps: float = IntraPairVariance.pos_eps,
                             neg_eps: float = IntraPairVariance.neg_eps,
                             **options) -> Array:
  r"""Intra-pair variance loss (Yu and Tao, ICCV 2019, eq. 4 and 5).

  .. math::

    L = \operatorname*{mean}_{(a,p) \in P}
          [(1 - \epsilon_p)\, \mu_P - s_{ap}]_+^2
      + \operatorname*{mean}_{(a,n) \in N}
          [s_{an} - (1 + \epsilon_n)\, \mu_N]_+^2 ,

  ``s`` the cosine similarity (or the geometry's), ``P`` / ``N`` every
  ordered positive / negative pair of the (global) batch (with miner masks,
  the masked pairs), ``mu_P`` / ``mu_N`` their mean similarities,
  differentiated.

  Reduction: the mean over the positive pairs plus the mean over the
  negative pairs, as pytorch-metric-learning's
  ``IntraPairVarianceLoss`` with its default ``MeanReducer``; an empty set
  adds 0 with zero gradient. A ``reduction`` (docs/reductions.md) reduces
  the pair terms ``[.]_+^2`` instead, each set on its own and the two added,
  on PML's elements (``pos_pair``, ``neg_pair``); it needs the dense engine
  (the means ``mu`` are differentiated through the whole block);
  ``"none"`` gives ``[B, N]``, each pair's term at (anchor, candidate).

  Differences from pytorch-metric-learning 2.9
  (``IntraPairVarianceLoss(pos_eps, neg_eps)``, same names and defaults):
  none found; equal value and gradient, with and without a miner (tested to
  float32 rounding). Costs six passes over the pairs (module docstring).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    pos_eps: ``epsilon_p``, the positives' tolerance, in [0, 1].
    neg_eps: ``epsilon_n``, the negatives' tolerance, in [0, 1].
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Yu, Tao, "Deep Metric Learning with Tuplet Margin Loss", ICCV 2019
    (its intra-pair variance loss).
  """
  IntraPairVariance(pos_eps=pos_eps, neg_eps=neg_eps)  # checks the ranges
  reduction = engine.as_reduction(options.pop("reduction", None))
  if reduction is not None:
    return _reduced(embeddings, labels, pos_eps, neg_eps, reduction, options)
  return (_set_term("pos", pos_eps, embeddings, labels, options)
          + _set_term("neg", neg_eps, embeddings, labels, options))


REGISTRY = (
    entries.entry("intra_pair_variance", intra_pair_variance_loss, "pair",
        rule=IntraPairVariance,
        paper="Yu and Tao, \"Deep Metric Learning with Tuplet Margin "
              "Loss\", ICCV 2019 (intra-pair variance)",
        reduction="mean over positive pairs + mean over negative pairs",
        reduction_note="PML's `pos_pair` and `neg_pair` elements, each set "
                       "on its own; the dense engine"),
)
