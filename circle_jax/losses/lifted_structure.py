"""Smooth lifted structured embedding loss (Oh Song et al. 2016), a
two-stage rule.

Each positive pair ``(i, j)`` costs ``[log(e^{L_i} + e^{L_j}) + D_ij]_+^2``
with ``L_i = LSE_{k in N_i} (m - D_ik)`` anchor ``i``'s logsumexp over its
negatives, read *with its gradient*, and ``L_j`` the column's own (another
anchor's). So it is a two-stage rule (:mod:`circle_jax.losses.engine.rule`):
the first stage, :class:`LiftedNegatives`, gives every anchor its ``L``; the
second, :class:`LiftedStructure`, reads the row's ``L_i`` and the column's
``L_j`` (``column_stage``: the engines gather it over the devices with the
columns, or pass it around the ring with the column shard) and sums the
pair terms over the positives. The engines differentiate through both, so
it runs dense, blockwise and on the device ring. With references (``ref``)
the columns are not anchors and there is no ``L_j`` term.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax.losses import entries
from circle_jax.losses import engine

Array = jax.Array

_NO_SET = -jnp.inf


def _logaddexp(a, b):
  """``log(e^a + e^b)`` with ``-inf`` (zero gradient) when both are ``-inf``;
  ``b`` ``None``: ``a``."""
  if b is None:
    return a
  m = jax.lax.stop_gradient(jnp.maximum(a, b))
  some = m != _NO_SET
  m = jnp.where(some, m, 0.0)
  total = jnp.exp(a - m) + jnp.exp(b - m)
  return jnp.where(some, jnp.log(jnp.where(some, total, 1.0)) + m, _NO_SET)


@engine.rule_dataclass(meta=("on_distance",))
class LiftedNegatives(engine.NegativeLogsumexp):
  """First stage: ``L_i = LSE_{k in N_i} (m - D_ik)`` per anchor (the
  fields: :class:`LiftedStructure`'s)."""

  margin: float = 1.0
  on_distance: bool = False

  def prepare(self, s):
    return engine.as_distance(self, s)

  def logits(self, d):
    return jnp.zeros_like(d), self.margin - d


@engine.rule_dataclass(meta=("on_distance",))
class LiftedStructure(engine.PositivePairMean):
  """Lifted structure rule: ``[logaddexp(L_i, L_j) + D_ij - m_p]_+^2``
  over the positive pairs, ``1 / (2 |P|)`` times their sum; its fields are
  the defaults of both forms.

  Attributes:
    margin: ``m`` (the paper's ``alpha``).
    pos_margin: ``m_p``, subtracted from the positive distance (0 in the
      paper; PML's ``pos_margin``).
    on_distance: static; see :func:`circle_jax.losses.engine.as_distance`.
  """

  margin: float = 1.0
  pos_margin: float = 0.0
  on_distance: bool = False

  scale = 0.5
  column_stage = True
  pair_terms = True

  def first_stage(self):
    return LiftedNegatives(margin=self.margin, on_distance=self.on_distance,
                           geometry=self.geometry)

  def prepare(self, s, l_row=None, l_col=None):
    # J_ij; -inf where neither anchor has a negative (the pair adds 0).
    d = engine.as_distance(self, s)
    return _logaddexp(l_row, l_col) + d - self.pos_margin

  def values(self, j):
    some = j != _NO_SET
    return (jnp.where(some, jnp.square(jax.nn.relu(jnp.where(some, j, 0.0))),
                      0.0),
            jnp.zeros_like(j))


def lifted_structure_loss_from_distance(
    distance: Array, labels: Array, *, margin: float = LiftedStructure.margin,
    pos_margin: float = LiftedStructure.pos_margin,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None) -> Array:
  """Lifted structure loss of a square ``[B, B]`` distance matrix.

  See :func:`lifted_structure_loss`.
  """
  return engine.distance_matrix_loss(
      LiftedStructure(margin=margin, pos_margin=pos_margin), distance, labels,
      pos_mask=pos_mask, neg_mask=neg_mask)


def lifted_structure_loss(embeddings: Array, labels: Array, *,
                          margin: float = LiftedStructure.margin,
                          pos_margin: float = LiftedStructure.pos_margin,
                          **options) -> Array:
  r"""Smooth lifted structured embedding loss (Oh Song et al. 2016, eq. 4).

  On Euclidean distances ``D`` between L2-normalised embeddings, for every
  positive pair ``(i, j)``:

  .. math::

    J_{ij} = \log\Big(\sum_{k \in N_i} e^{m - D_{ik}}
                    + \sum_{l \in N_j} e^{m - D_{jl}}\Big) + D_{ij} - m_p,
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

  A ``reduction`` (docs/reductions.md) reduces the pair terms ``[J_ij]_+^2 /
  2`` of the ordered positive pairs instead (PML's ``pos_pair`` elements),
  on the dense engine; ``"none"`` gives them as ``[B, N]`` at (anchor,
  positive), 0 elsewhere.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    margin: ``m`` (the paper's ``alpha``; pytorch-metric-learning's
      ``LiftedStructureLoss(neg_margin)``).
    pos_margin: ``m_p``, subtracted from the positive distance (0 in the
      paper; PML's ``LiftedStructureLoss(pos_margin)``, same name and
      default, equal value and gradient, tested in float64; PML's
      ``GeneralizedLiftedStructureLoss`` has one too:
      :func:`circle_jax.losses.generalized_lifted_structure_loss`).
    **options: the pair losses' shared keywords (``axis_name``,
      ``pos_mask``, ``neg_mask``, ``block_size``, ``collective``, ``ref``),
      documented once at :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Oh Song, Xiang, Jegelka, Savarese, "Deep Metric Learning via Lifted
    Structured Feature Embedding", CVPR 2016.
  """
  rule = LiftedStructure(margin=margin, pos_margin=pos_margin)
  return engine.embedding_loss(rule, embeddings, labels, **options)


# The registry's facts of this module's losses (circle_jax.losses.registry
# collects them).
REGISTRY = (
    entries.entry("lifted_structure", lifted_structure_loss, "pair",
        paper="Oh Song et al., \"Deep Metric Learning via Lifted "
              "Structured Feature Embedding\", CVPR 2016 (smooth form)",
        reduction="sum over ordered positive pairs of [J]_+^2 / (2 #pairs)",
        reduction_note="PML's `pos_pair` elements (a term [J]_+^2 / 2); "
                       "the dense engine"),
)
