"""Multi-class N-pair loss (Sohn 2016), a two-stage rule on inner products.

Each positive pair ``(a, p)`` costs ``softplus(t_a - s_ap)`` with ``t_a =
LSE_{n in N_a} s_an`` the anchor's logsumexp over its negatives, read *with
its gradient*. So it is a two-stage rule (:mod:`circle_jax.losses.engine.rule`):
the first stage, :class:`NPairNegatives`, gives every anchor its ``t_a``;
the second, :class:`NPair`, sums ``softplus(t_a - s_ap)`` over the anchor's
positives and averages over the pairs. The engines run both stages and
differentiate through ``t``, so it runs dense, blockwise and on the device
ring, on the :class:`circle_jax.losses.engine.Dot` geometry (embeddings not
normalised). The L2 penalty on the embeddings is added outside the pair term.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax.losses import entries
from circle_jax.losses import checks
from circle_jax.losses.engine import reductions
from circle_jax.losses import engine
from circle_jax.losses import ranges

Array = jax.Array


@engine.rule_dataclass
class NPairNegatives(engine.NegativeLogsumexp):
  """First stage: ``t_a = LSE_{n in N_a} s_an`` per anchor."""

  geometry = engine.DOT

  def logits(self, s):
    return jnp.zeros_like(s), s


@engine.rule_dataclass
class NPair(engine.PositivePairMean):
  """N-pair rule: ``softplus(t_a - s_ap)`` over the positive pairs whose
  anchor has a negative, averaged over them (no hyperparameters; the L2
  penalty is :func:`n_pair_loss`'s)."""

  geometry = engine.DOT
  pair_terms = True

  def first_stage(self):
    return NPairNegatives(geometry=self.geometry)

  def prepare(self, s, t_row=None, t_col=None):
    del t_col
    return t_row - s  # -inf where the anchor has no negative

  def select(self, u, pos, neg, pre):
    del pre
    return pos & (u != -jnp.inf), neg

  def values(self, u):
    some = u != -jnp.inf
    return (jnp.where(some, jax.nn.softplus(jnp.where(some, u, 0.0)), 0.0),
            jnp.zeros_like(u))


def n_pair_loss_from_similarity(similarity: Array, labels: Array, *,
                                pos_mask: Optional[Array] = None,
                                neg_mask: Optional[Array] = None) -> Array:
  """Multi-class N-pair loss of a square ``[B, B]`` inner-product matrix.

  The tuplet term of :func:`n_pair_loss` without the L2 penalty (which
  depends on the embeddings, not on their similarities).
  """
  rule = NPair()
  return engine.matrix_loss(rule, similarity, labels, pos_mask=pos_mask,
                            neg_mask=neg_mask)


def n_pair_loss(embeddings: Array, labels: Array, *, l2_reg: float = 0.02,
                **options) -> Array:
  r"""Multi-class N-pair loss (Sohn 2016), for any batch with repeated labels.

  On raw inner products ``s_ij = f_i . f_j`` (embeddings are *not*
  normalised: Sohn regularises their norm instead), every positive pair
  ``(a, p)`` forms an ``(N+1)``-tuplet with all negatives of ``a``:

  .. math::

    L = \operatorname*{mean}_{(a,p) \in P}
        \log\Big(1 + \sum_{n \in N_a} e^{s_{an} - s_{ap}}\Big)
        + \lambda \, \frac{1}{B} \sum_b \lVert f_b \rVert^2 .

  Reduction: mean over ordered positive pairs whose anchor has a negative,
  plus ``l2_reg`` times the mean squared norm over the (global) batch. On a
  batch of N pairs from N classes laid out as ``[anchors; positives]``, with
  ``pos_mask``/``neg_mask`` keeping anchor rows, their own positive and the
  other classes' positives, this is exactly Sohn's multi-class N-pair loss
  (tested); without masks both members of a pair are anchors and every other
  sample of another class is a negative.

  With references (``ref``) every anchor ``a`` (a row of
  ``embeddings``) forms a tuplet with each of its positives ``p`` among the
  references and all its negatives among the references; the L2 penalty is
  over the anchors only (the references are regularised as anchors of their
  own batch).

  A ``reduction`` (docs/reductions.md) reduces the tuplet term's pair terms
  ``softplus(t_a - s_ap)`` of the positive pairs instead (0 for an anchor
  without a negative), on the dense engine, and adds the penalty as above;
  ``"none"`` gives the pair terms as ``[B, N]`` at (anchor, positive)
  without the penalty (a per-sample term: add ``l2_reg * |x|^2`` yourself).
  PML's ``NPairsLoss`` has other elements: one positive per anchor and
  class, a cross-entropy over the other classes' positives.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (raw, not normalised).
    labels: ``[B]`` integer labels.
    l2_reg: ``lambda``, weight of the squared-norm penalty.
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Sohn, "Improved Deep Metric Learning with Multi-class N-pair Loss
    Objective", NeurIPS 2016, eq. 6 and Sec. 3.2.1.
  """
  ranges.check_range(l2_reg, "l2_reg", ranges.NONNEGATIVE_RANGE)
  tuplet = engine.embedding_loss(NPair(), embeddings, labels, **options)
  if tuplet.ndim:  # reduction="none": the pair terms (docstring)
    return tuplet
  x = checks.check_embeddings(embeddings)
  penalty = reductions.sum_over_batch(jnp.sum(x * x, axis=1),
                                   options.get("axis_name"))
  return tuplet + l2_reg * penalty


REGISTRY = (
    entries.entry("n_pair", n_pair_loss, "pair", geometry="dot",
        paper="Sohn, \"Improved Deep Metric Learning with Multi-class "
              "N-pair Loss Objective\", NeurIPS 2016",
        reduction="mean over positive pairs + l2_reg * mean squared "
                  "norm",
        reduction_note="PML's element differs: one positive per anchor and "
                       "class; the L2 penalty keeps its mean (`none` "
                       "leaves it out); the dense engine"),
)
