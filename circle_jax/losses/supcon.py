r"""Supervised contrastive loss, SupCon (Khosla et al., NeurIPS 2020), a rule.

The ``L^sup_out`` form (their eq. 2): for anchor ``i`` with positives
``P(i)`` (same label, not ``i``) and candidates ``A(i)`` (every other
sample),

.. math::

  \ell_i = -\frac{1}{|P(i)|} \sum_{p \in P(i)}
    \log \frac{\exp(s_{ip}/\tau)}{\sum_{a \in A(i)} \exp(s_{ia}/\tau)}
  = \operatorname*{LSE}_{a \in A(i)} \frac{s_{ia}}{\tau}
    - \frac{1}{|P(i)|} \sum_{p \in P(i)} \frac{s_{ip}}{\tau}.

The rule's statistics are ``("sum", "lse")``: the positives' sum of
``s / tau`` and their count, and the logsumexp over every candidate (its
``select`` widens the negative set to positives and negatives), so it runs
on every engine (dense, blockwise, ring) in one pass.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from circle_jax.losses import entries
from circle_jax.losses import engine
from circle_jax.losses import ranges

Array = jax.Array


@engine.rule_dataclass
class SupCon(engine.PairRule):
  """SupCon rule (``L_out``): ``LSE_A(s/tau) - mean_P(s/tau)`` per anchor.

  Attributes:
    tau: the temperature ``tau`` in [1e-3, 1e4].
  """

  tau: float = 0.1

  statistic = ("sum", "lse")
  ranges = types.MappingProxyType(
      {"tau": ranges.DIVIDING_TEMPERATURE_RANGE})

  def select(self, x, pos, neg, pre):
    del x, pre
    return pos, pos | neg  # the denominator runs over every candidate

  def logits(self, x):
    return jnp.zeros_like(x), x / self.tau

  def values(self, x):
    return x / self.tau, jnp.zeros_like(x)

  def terms(self, sum_count_p, lse_all):
    """``(|P| LSE_A - sum_P s/tau, |P|, valid)`` per anchor (0 if P empty)."""
    sum_p, count = sum_count_p
    valid = count > 0
    lse_all = jnp.where(valid, lse_all, 0.0)
    return jnp.where(valid, count * lse_all - sum_p, 0.0), count, valid

  def combine(self, sum_count_p, lse_all):
    total, count, valid = self.terms(sum_count_p, lse_all)
    return total / jnp.maximum(count, 1.0), valid


def supcon_loss(embeddings: Array, labels: Array, *, tau: float = SupCon.tau,
                **options) -> Array:
  r"""Supervised contrastive loss ``L^sup_out`` (Khosla et al., NeurIPS 2020).

  .. math::

    L = \operatorname*{mean}_{i:\ |P(i)| > 0} \Big[
      \operatorname*{LSE}_{a \in A(i)} \frac{s_{ia}}{\tau}
      - \frac{1}{|P(i)|} \sum_{p \in P(i)} \frac{s_{ip}}{\tau} \Big],

  ``s`` the cosine similarity (or ``-d_c`` on the Poincaré ball), ``P(i)``
  the anchor's positives and ``A(i)`` its positives and negatives (every
  candidate but itself; with miner masks, the masked sets).

  Reduction: mean over the anchors with at least one positive (the paper
  sums over the ``2N`` anchors; its official code, HobbitLong/SupContrast,
  averages, and so do we). An anchor without positives contributes 0 with
  zero gradient.

  Differences from the official code: SupContrast subtracts the row maximum
  of *all* logits including the self pair and multiplies the loss by
  ``tau / base_temperature`` (both 0.07 there, factor 1); we take the
  paper's form (no factor) with an exact masked logsumexp. Their default
  temperature is 0.07 (paper: 0.1 on ImageNet); ours is the paper's 0.1.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels (views of a sample share its label).
    tau: the temperature ``tau`` in [1e-3, 1e4].
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Khosla, Teterwak, Wang, Sarna, Tian, Isola, Maschinot, Liu, Krishnan,
    "Supervised Contrastive Learning", NeurIPS 2020.
  """
  rule = SupCon(tau=tau)
  return engine.embedding_loss(rule, embeddings, labels, **options)


REGISTRY = (
    entries.entry("supcon", supcon_loss, "pair", rule=SupCon,
        paper="Khosla et al., \"Supervised Contrastive Learning\", "
              "NeurIPS 2020 (L_out, eq. 2)",
        reduction="mean over anchors with >= 1 positive"),
)
