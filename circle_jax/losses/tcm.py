r"""Threshold-Consistent Margin loss (Zhang et al. 2023), a rule.

Per anchor, the rule keeps the sums and counts of the pairs on the wrong
side of each margin (the ``"sum"`` statistic); its own reduction turns them
into the global per-pair means, so it runs on every engine (dense,
blockwise, ring).
"""

from __future__ import annotations

import types

import jax

from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses import ranges

Array = jax.Array


@engine.rule_dataclass()
class ThresholdConsistentMargin(engine.PairSetMeans):
  """TCM's rule: per anchor, the sums and counts of the positives with
  ``s <= m_+`` and the negatives with ``s >= m_-``, reduced to global
  per-pair means. Its fields are the loss's defaults (PML 2.9's, the
  paper's).

  Attributes:
    lambda_plus: ``\\lambda_+``, the weight of the positive term.
    lambda_minus: ``\\lambda_-``, the weight of the negative term.
    margin_plus: ``m_+``: positives with a similarity up to it count.
    margin_minus: ``m_-``: negatives with a similarity from it count.
  """

  lambda_plus: float = 1.0
  lambda_minus: float = 1.0
  margin_plus: float = 0.9
  margin_minus: float = 0.5

  ranges = types.MappingProxyType({
      "lambda_plus": ranges.NONNEGATIVE_RANGE,
      "lambda_minus": ranges.NONNEGATIVE_RANGE,
      "margin_plus": ranges.SIMILARITY_MARGIN_RANGE,
      "margin_minus": ranges.SIMILARITY_MARGIN_RANGE})

  pair_terms = True

  def prepare(self, s):
    return s

  def values(self, s):
    return self.margin_plus - s, s - self.margin_minus

  def select(self, s, pos, neg, pre):
    del pre
    return pos & (s <= self.margin_plus), neg & (s >= self.margin_minus)

  def side_weights(self):
    return self.lambda_plus, self.lambda_minus


def threshold_consistent_margin_loss(
    embeddings: Array, labels: Array, *,
    lambda_plus: float = ThresholdConsistentMargin.lambda_plus,
    lambda_minus: float = ThresholdConsistentMargin.lambda_minus,
    margin_plus: float = ThresholdConsistentMargin.margin_plus,
    margin_minus: float = ThresholdConsistentMargin.margin_minus,
    **options) -> Array:
  r"""TCM: pull positives above ``m_+``, push negatives below ``m_-``.

  On cosine similarities ``s`` of the ordered pairs (the geometry's
  similarity with the ``geometry`` option), with ``P_+ = \{(i,j) \in P :
  s_{ij} \le m_+\}`` and ``N_- = \{(i,j) \in N : s_{ij} \ge m_-\}``:

  .. math::

    L = \lambda_+ \frac{\sum_{P_+} (m_+ - s_{ij})}{|P_+|}
      + \lambda_- \frac{\sum_{N_-} (s_{ij} - m_-)}{|N_-|},

  an empty set giving 0 (eq. 4 of the paper; PML 2.9's
  ``ThresholdConsistentMarginLoss``). The paper adds it to a base loss as a
  regulariser; here it is a loss by itself, as in PML (add it to another
  with a loss combination).

  Difference from PML 2.9: with reference embeddings, PML indexes its
  ``embeddings`` for the second member of every pair (``embeddings[p]``,
  ``embeddings[n]`` where the pair indices point into ``ref_emb``), so its
  pairs are wrong; here the pairs are (anchor, reference) as for every pair
  loss.

  A ``reduction`` (docs/reductions.md) reduces pair terms instead, each set
  on its own and the two added: ``lambda_+ (m_+ - s)`` of a positive in
  ``P_+`` and ``lambda_- (s - m_-)`` of a negative in ``N_-``, 0 for the
  other pairs (still elements: ``"mean"`` counts them), on the dense engine;
  ``"none"`` gives them as ``[B, N]`` at (anchor, candidate). PML's loss is
  already reduced: its reducers do nothing to it.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    lambda_plus: ``\lambda_+``.
    lambda_minus: ``\lambda_-``.
    margin_plus: ``m_+``.
    margin_minus: ``m_-``.
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar: the two per-pair means over the (global) ordered pairs,
    weighted and summed (PML's ``already_reduced``).

  References:
    Zhang, Jiang, Sun, Wang, Xia, Yao, Kuen, "Threshold-Consistent Margin
    Loss for Open-World Deep Metric Learning", ICLR 2024 (arXiv:2307.04047,
    2023), eq. 4.
  """
  rule = ThresholdConsistentMargin(
      lambda_plus=lambda_plus, lambda_minus=lambda_minus,
      margin_plus=margin_plus, margin_minus=margin_minus)
  return engine.embedding_loss(rule, embeddings, labels, **options)


REGISTRY = (
    entries.entry("threshold_consistent_margin",
        threshold_consistent_margin_loss, "pair",
        rule=ThresholdConsistentMargin,
        paper="Zhang et al., \"Threshold-Consistent Margin Loss for "
              "Open-World Deep Metric Learning\", ICLR 2024",
        reduction="lambda_+ mean over positives with s <= m_+ + lambda_- "
                  "mean over negatives with s >= m_-",
        reduction_note="each set on its own (a pair on the right side of "
                       "its margin adds 0); PML's loss is already reduced, "
                       "its reducers do nothing; the dense engine"),
)
