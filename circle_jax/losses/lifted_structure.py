"""Smooth lifted structured embedding loss (Oh Song et al. 2016), dense.

Not a rule: each positive pair ``(i, j)`` costs ``[log(e^{L_i} + e^{L_j}) +
D_ij]_+^2`` with ``L_i`` the logsumexp over anchor ``i``'s negatives. The
pair's term is a function of the anchor's negative statistic *with its
gradient*, and of the column's own (``L_j``, another anchor's), so it is not
a function of per-anchor set statistics that the tiles update independently
(the rule interface, :mod:`circle_jax.losses.engine.rule`): a tiled form
needs a second pass that differentiates through the first and a per-column
statistic. It takes the rules' ``**options`` through
:func:`circle_jax.losses.engine.dense_block` (dense engine only).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import _common
from circle_jax.losses import engine

Array = jax.Array

_NOT_A_RULE = ("each positive pair reads both anchors' negative "
               "logsumexps with their gradient")


def _lifted_core(dist, pos, neg, *, margin, axis_name, column_term=True):
  # log sum_{k in N_i} exp(margin - d_ik) for every row; the column sample j
  # needs the same quantity for its own row, which lives on its device
  # (without `column_term`, the columns are references: no such term).
  row_lse = ops.masked_logsumexp(margin - dist, neg)  # [M]
  m, n = dist.shape
  if column_term:
    col_lse = ops.gather_global(row_lse, axis_name)  # [N]
    both = jnp.stack([jnp.broadcast_to(row_lse[:, None], (m, n)),
                      jnp.broadcast_to(col_lse[None, :], (m, n))], axis=-1)
    lse = ops.masked_logsumexp(both, jnp.isfinite(both), axis=-1)
  else:
    lse = jnp.broadcast_to(row_lse[:, None], (m, n))
  has_neg = jnp.isfinite(lse)
  j = jnp.where(pos & has_neg, lse, 0.0) + dist
  loss = jnp.where(pos & has_neg, jnp.square(jax.nn.relu(j)), 0.0)
  return 0.5 * _common.ratio_of_sums(loss, pos, axis_name)


def lifted_structure_loss_from_distance(
    distance: Array,
    labels: Array,
    *,
    margin: float = 1.0,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Array:
  """Lifted structure loss of a square ``[B, B]`` distance matrix.

  See :func:`lifted_structure_loss`.
  """
  dist, _, pos, neg = engine.square_block(distance, labels, pos_mask, neg_mask,
                                          "distance")
  return _lifted_core(dist, pos, neg, margin=margin, axis_name=None)


def lifted_structure_loss(
    embeddings: Array,
    labels: Array,
    *,
    margin: float = 1.0,
    **options,
) -> Array:
  r"""Smooth lifted structured embedding loss (Oh Song et al. 2016, eq. 4).

  On Euclidean distances ``D`` between L2-normalised embeddings, for every
  positive pair ``(i, j)``:

  .. math::

    J_{ij} = \log\Big(\sum_{k \in N_i} e^{m - D_{ik}}
                    + \sum_{l \in N_j} e^{m - D_{jl}}\Big) + D_{ij},
    \qquad
    L = \frac{1}{2|P|} \sum_{(i,j) \in P} [J_{ij}]_+^2 .

  ``P`` is the set of ordered positive pairs (the paper's unordered sum
  counts each pair once and divides by twice the unordered count, the same
  value). Both log-sum-exps are max-shifted and masked; a pair whose two
  negative sets are empty contributes 0. With a miner's ``neg_mask`` the sets
  ``N_i`` and ``N_j`` are the mined negatives of rows ``i`` and ``j``.

  With references (``ref``) the anchor ``i`` is a row of
  ``embeddings``, ``j`` ranges over its positives among the references and
  the negative term is the anchor's: ``N_i`` are its negatives among the
  references, and there is no ``N_j`` term (a reference is not an anchor;
  pytorch-metric-learning's lifted structure loss with ``ref_emb`` likewise
  takes the negatives of the anchor's pairs). So passing the batch as its
  own references is *not* the loss above, which also adds the ``N_j`` term.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    margin: ``m`` (the paper's ``alpha``).
    **options: the pair losses' shared keywords (``axis_name``,
      ``pos_mask``, ``neg_mask``, ``block_size``, ``collective``, ``ref``),
      documented once at :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Oh Song, Xiang, Jegelka, Savarese, "Deep Metric Learning via Lifted
    Structured Feature Embedding", CVPR 2016.
  """
  axis_name = options.get("axis_name")
  _, _, dist, pos, neg = engine.dense_block(
      embeddings, labels, loss="lifted structure loss", reason=_NOT_A_RULE,
      distance=True, **options)
  return _lifted_core(dist, pos, neg,
                      margin=margin, axis_name=axis_name,
                      column_term=options.get("ref") is None)
