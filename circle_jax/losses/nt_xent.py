r"""NT-Xent / InfoNCE with label-defined views (Chen et al., ICML 2020), a rule.

SimCLR's normalised temperature-scaled cross-entropy, for every positive
pair ``(i, p)`` (two views of one sample: the same label),

.. math::

  \ell_{ip} = -\log \frac{\exp(s_{ip}/\tau)}
                         {\sum_{k \ne i} \exp(s_{ik}/\tau)},

averaged over all positive pairs. With two views per label it is SupCon
(:mod:`circle_jax.losses.supcon`) exactly; with more, NT-Xent weighs every
positive pair alike where SupCon weighs every anchor alike. Per anchor the
rule keeps ``|P| LSE - sum_P s/tau`` and ``|P|``, reduced to the global ratio
of sums, so it runs on every engine.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import entries
from circle_jax.losses.engine import reductions
from circle_jax.losses import engine
from circle_jax.losses import supcon

Array = jax.Array


@engine.rule_dataclass
class NTXent(supcon.SupCon):
  """NT-Xent rule: SupCon's statistics and temperature ``tau``, averaged
  over the positive pairs instead of the anchors."""

  def combine(self, sum_count_p, lse_all):
    total, count, valid = self.terms(sum_count_p, lse_all)
    return (total, count), valid

  def reduce(self, terms, valid, axis_name):
    del valid
    return reductions.ratio_of_sums(*terms, axis_name)

  pair_terms = True

  def pair_values(self, x, sel_p, sel_n):
    # A positive pair's term: its row's LSE over every candidate (``sel_n``,
    # the positives and negatives) minus its own logit.
    del sel_p
    lse = ops.masked_logsumexp(x / self.tau, sel_n, axis=-1)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return lse[:, None] - x / self.tau, jnp.zeros_like(x)


def nt_xent_loss(embeddings: Array, labels: Array, *, tau: float = NTXent.tau,
                 **options) -> Array:
  r"""NT-Xent / InfoNCE (Chen et al., ICML 2020; van den Oord et al. 2018).

  .. math::

    L = \frac{1}{\sum_i |P(i)|} \sum_i \sum_{p \in P(i)} \Big[
      \operatorname*{LSE}_{k \in A(i)} \frac{s_{ik}}{\tau}
      - \frac{s_{ip}}{\tau} \Big],

  labels give the views (``P(i)``: the other views of sample ``i``; ``A(i)``
  every candidate but ``i``), ``s`` the cosine similarity (or ``-d_c``).

  Reduction: mean over all positive pairs (SimCLR's ``1/2N`` sum over its
  ``2N`` ordered pairs with two views); 0 with zero gradient when there is
  no positive pair.

  Differences: the paper's denominator runs over every ``k != i``, and so
  does ours; pytorch-metric-learning's ``NTXentLoss`` keeps only the positive
  ``p`` and the negatives in it (the same with two views, not with more).
  Temperature: we default to 0.1, the ``temperature`` flag's default in the
  official code's ``run.py`` (google-research/simclr) and the value of its
  README's ImageNet pretraining command. Its README's CIFAR-10 command uses
  ``--temperature=0.5`` (google-research/simclr README, "Pretraining";
  checked there, not in the paper's appendix). pytorch-metric-learning's
  ``NTXentLoss`` defaults to 0.07 (``NTXentLoss.__init__(self,
  temperature=0.07)`` in ``pytorch_metric_learning/losses/ntxent_loss.py``,
  checked in version 2.9.0).

  A ``reduction`` (docs/reductions.md) reduces the pair terms ``l_ip``
  instead (PML's ``pos_pair`` elements), on the dense engine; ``"none"``
  gives them as ``[B, N]`` at (anchor, positive), 0 elsewhere.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels: the views of one sample share a label.
    tau: the temperature ``tau`` in [1e-3, 1e4].
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Chen, Kornblith, Norouzi, Hinton, "A Simple Framework for Contrastive
    Learning of Visual Representations", ICML 2020. van den Oord, Li,
    Vinyals, "Representation Learning with Contrastive Predictive Coding",
    arXiv:1807.03748, 2018.
  """
  rule = NTXent(tau=tau)
  return engine.embedding_loss(rule, embeddings, labels, **options)


REGISTRY = (
    entries.entry("nt_xent", nt_xent_loss, "pair", rule=NTXent,
        paper="Chen et al., \"A Simple Framework for Contrastive "
              "Learning of Visual Representations\", ICML 2020; van den "
              "Oord et al., arXiv 2018 (InfoNCE); labels give the views",
        reduction="mean over positive pairs",
        reduction_note="PML's `pos_pair` elements (its denominator holds "
                       "the pair's own positive only); the dense engine"),
)
