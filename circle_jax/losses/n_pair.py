"""Multi-class N-pair loss (Sohn 2016), dense, on raw inner products.

Not a rule: each positive pair ``(a, p)`` costs
``softplus(LSE_{n in N_a} s_an - s_ap)``; the pair's term reads the
anchor's negative logsumexp *with its gradient*, so the per-anchor loss
``sum_p softplus(L_a - s_ap)`` is not a function of independent per-set
statistics (the rule interface, :mod:`circle_jax.losses.engine.rule`): a
tiled form needs a second pass that differentiates through the first. It
takes the rules' ``**options`` through
:func:`circle_jax.losses.engine.dense_block` (dense engine only), with the
:class:`circle_jax.losses.engine.Dot` geometry (embeddings not normalised).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import _common
from circle_jax.losses import engine
from circle_jax.losses import ranges

Array = jax.Array

_NOT_A_RULE = ("each positive pair reads the anchor's negative "
               "logsumexp with its gradient")


def _n_pair_core(sim, pos, neg, *, axis_name):
  neg_lse = ops.masked_logsumexp(sim, neg)  # [M]
  has_neg = neg.any(axis=1)
  valid = pos & has_neg[:, None]
  logits = jnp.where(valid, jnp.where(has_neg, neg_lse, 0.0)[:, None] - sim,
                     0.0)
  loss = jnp.where(valid, jax.nn.softplus(logits), 0.0)
  return _common.ratio_of_sums(loss, valid, axis_name)


def n_pair_loss_from_similarity(
    similarity: Array,
    labels: Array,
    *,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Array:
  """Multi-class N-pair loss of a square ``[B, B]`` inner-product matrix.

  The tuplet term of :func:`n_pair_loss` without the L2 penalty (which
  depends on the embeddings, not on their similarities).
  """
  sim, _, pos, neg = engine.square_block(similarity, labels, pos_mask, neg_mask,
                                          "similarity")
  return _n_pair_core(sim, pos, neg, axis_name=None)


def n_pair_loss(
    embeddings: Array,
    labels: Array,
    *,
    l2_reg: float = 0.02,
    **options,
) -> Array:
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

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (raw, not normalised).
    labels: ``[B]`` integer labels.
    l2_reg: ``lambda``, weight of the squared-norm penalty.
    **options: the pair losses' shared keywords (``axis_name``,
      ``pos_mask``, ``neg_mask``, ``block_size``, ``collective``, ``ref``),
      documented once at :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Sohn, "Improved Deep Metric Learning with Multi-class N-pair Loss
    Objective", NeurIPS 2016, eq. 6 and Sec. 3.2.1.
  """
  ranges.check_range(l2_reg, "l2_reg", ranges.NONNEGATIVE_RANGE)
  axis_name = options.get("axis_name")
  options.setdefault("geometry", engine.DOT)
  rows, _, sim, pos, neg = engine.dense_block(
      embeddings, labels, loss="N-pair loss", reason=_NOT_A_RULE, **options)
  emb = rows.z
  tuplet = _n_pair_core(sim, pos, neg, axis_name=axis_name)
  penalty = _common.sum_over_batch(jnp.sum(emb * emb, axis=1), axis_name)
  return tuplet + l2_reg * penalty
