"""Baseline pair-based losses: contrastive, triplet, lifted structure, N-pair,
margin.

Every loss here has three layers:

* a private core on an ``[M, N]`` distance (or similarity) block with boolean
  ``pos`` / ``neg`` masks, which also performs the (possibly global) reduction;
* a public square-matrix form ``<name>_from_distance(distance, labels, ...)``
  (``n_pair_loss_from_similarity`` for the N-pair loss), the function General
  Pair Weighting differentiates;
* the embedding wrapper ``<name>(embeddings, labels, ...)``.

Distances are Euclidean distances between L2-normalised embeddings,
``d_ij = ||x_i/|x_i| - x_j/|x_j| || = sqrt(2 - 2 cos_ij)`` (zero gradient at
``d = 0``). The N-pair loss is the exception: it uses raw inner products and an
L2 penalty on the embeddings, as in Sohn (2016).

With ``axis_name`` (inside ``jax.shard_map`` or ``jax.pmap``) a wrapper gathers
the batch across devices, compares its local anchors with the global batch and
reduces with global sums: the value is the loss of the global batch on every
device and the gradient with respect to the local embeddings equals the
single-device gradient on the concatenated batch.

Miner masks ``pos_mask`` / ``neg_mask`` (see :mod:`circle_jax.losses.miners`)
have the shape of the block and are intersected with the label masks.

With reference embeddings (``ref_embeddings``, e.g. a cross-batch memory) the
block's columns are the references instead of the batch
(:func:`circle_jax.losses.engines.pair_sides`); each wrapper's docstring says
what its loss then means (anchors from the batch, positives and negatives
from the references, as pytorch-metric-learning's ``ref_emb``).
"""

from __future__ import annotations

import types
from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax.losses import _common
from circle_jax.losses import engines
from circle_jax.losses import miners as _miners

Array = jax.Array

TRIPLET_MINING = ("all", "batch_hard", "semi_hard")


# ----------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------


def _ratio(total: Array, count: Array, axis_name) -> Array:
  """(Global) ``sum(total) / max(sum(count), 1)``; the count has no gradient."""
  total = _common.maybe_global_sum(jnp.sum(total), axis_name)
  count = jax.lax.stop_gradient(
      _common.maybe_global_sum(jnp.sum(count.astype(jnp.float32)), axis_name))
  return total / jnp.maximum(count, 1.0)


def _embedding_block(embeddings, labels, axis_name, pos_mask, neg_mask,
                     normalize=True, **references):
  """Local anchors against the candidates (the (global) batch or the
  references, :func:`circle_jax.losses.engines.pair_sides`).

  Returns:
    ``(rows, sim, pos, neg)``: the anchors' :class:`engines.PairSide` (their
    float32 embeddings as given when ``normalize`` is False) and the
    ``[M, N]`` similarity block with its pair masks.
  """
  rows, cols = engines.pair_sides(embeddings, labels, axis_name=axis_name,
                                  normalize=normalize, **references)
  sim = jnp.matmul(rows.z, cols.z.T, precision=jax.lax.Precision.HIGHEST)
  shape = sim.shape
  pos, neg = engines.side_masks(
      rows, cols, _common.check_mask(pos_mask, shape, "pos_mask"),
      _common.check_mask(neg_mask, shape, "neg_mask"))
  return rows, sim, pos, neg


def _square(matrix, labels, pos_mask, neg_mask, name):
  matrix, labels = _common.check_similarity(matrix, labels, name=name)
  pos, neg = _common.pair_masks(labels, labels, 0, pos_mask, neg_mask)
  return matrix, labels, pos, neg


def _check_margin(value, name):
  if isinstance(value, (int, float)) and value < 0:
    raise ValueError(f"`{name}` must be >= 0; got {value}.")


def _checked_mining(mining):
  if mining not in TRIPLET_MINING:
    raise ValueError(
        f"`mining` must be one of {TRIPLET_MINING}; got {mining!r}.")
  return mining


# ----------------------------------------------------------------------------
# Contrastive loss.
# ----------------------------------------------------------------------------


@engines.rule_dataclass(meta=("on_distance",))
class Contrastive(engines.PairRule):
  """Two-margin contrastive rule: per anchor, the sums and counts of the
  non-zero hinges of each set, reduced to global per-pair means.

  Its fields are the defaults of both forms of the loss.

  Attributes:
    pos_margin: ``m_+``, in [0, 2]: positives closer than this are not
      pulled.
    neg_margin: ``m_-``, in [0, 2]: negatives farther than this are not
      pushed (distances of unit vectors lie in [0, 2]).
    on_distance: the block holds distances (static); otherwise cosine
      similarities, turned into the Euclidean distance of unit vectors.
  """

  pos_margin: float = 0.0
  neg_margin: float = 0.5
  on_distance: bool = False

  statistic = "sum"

  ranges = types.MappingProxyType({
      "pos_margin": _common.DISTANCE_MARGIN_RANGE,
      "neg_margin": _common.DISTANCE_MARGIN_RANGE})

  def prepare(self, s):
    return s if self.on_distance else _common.euclidean_from_cosine(s)

  def values(self, d):
    return (jax.nn.relu(d - self.pos_margin),
            jax.nn.relu(self.neg_margin - d))

  def select(self, d, pos, neg, pre):
    del pre
    v_p, v_n = self.values(d)
    return pos & (v_p > 0), neg & (v_n > 0)  # the non-zero pair terms

  def combine(self, sum_count_p, sum_count_n):
    terms = sum_count_p + sum_count_n  # (sum_p, count_p, sum_n, count_n)
    return terms, jnp.ones(terms[0].shape, bool)

  def reduce(self, terms, valid, axis_name):
    del valid
    sum_p, count_p, sum_n, count_n = terms
    return (_ratio(sum_p, count_p, axis_name)
            + _ratio(sum_n, count_n, axis_name))


def contrastive_loss_from_distance(
    distance: Array,
    labels: Array,
    *,
    pos_margin: float = Contrastive.pos_margin,
    neg_margin: float = Contrastive.neg_margin,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Array:
  """Contrastive loss of a square ``[B, B]`` distance matrix.

  See :func:`contrastive_loss`; ``distance`` replaces the Euclidean distances
  of the normalised embeddings.
  """
  rule = Contrastive(pos_margin=pos_margin, neg_margin=neg_margin,
                     on_distance=True)
  return engines.matrix_loss(rule, distance, labels, pos_mask=pos_mask,
                             neg_mask=neg_mask, name="distance")


def contrastive_loss(
    embeddings: Array,
    labels: Array,
    *,
    pos_margin: float = Contrastive.pos_margin,
    neg_margin: float = Contrastive.neg_margin,
    axis_name: Optional[str] = None,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
    block_size: Optional[int] = None,
    collective: str = "all_gather",
    ref_embeddings: Optional[Array] = None,
    ref_labels: Optional[Array] = None,
    ref_valid: Optional[Array] = None,
    ids: Optional[Array] = None,
    ref_ids: Optional[Array] = None,
) -> Array:
  r"""Two-margin contrastive loss (Hadsell et al. 2006; Musgrave et al. 2020).

  On Euclidean distances ``d`` between L2-normalised embeddings:

  .. math::

    L = \operatorname*{mean}_{(i,j) \in P,\ \ell^+_{ij} > 0} \ell^+_{ij}
      + \operatorname*{mean}_{(i,j) \in N,\ \ell^-_{ij} > 0} \ell^-_{ij},
    \quad \ell^+_{ij} = [d_{ij} - m_+]_+,\ \ell^-_{ij} = [m_- - d_{ij}]_+ .

  Reduction: positive and negative pair terms are each averaged over the
  ordered pairs with a non-zero term (pytorch-metric-learning's
  ``AvgNonZeroReducer``, used by "A Metric Learning Reality Check") and
  summed; a side with no non-zero pair contributes 0. The distances are not
  squared (Hadsell et al. square them; the Reality Check form does not).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    pos_margin: ``m_+``, in [0, 2]: positives closer than this are not
      pulled.
    neg_margin: ``m_-``, in [0, 2]: negatives farther than this are not
      pushed.
    axis_name: global-batch loss across devices (see module docstring).
    pos_mask, neg_mask: optional miner masks of the block's shape.
    block_size: ``None`` (dense) or the block size of the blockwise engine
      of :mod:`circle_jax.losses.engines` (memory ``O(block_size^2 + B D)``).
    collective: ``"all_gather"`` or ``"ring"``: how the anchors meet the
      global batch with ``axis_name`` (see
      :func:`circle_jax.losses.circle_loss`).
    ref_embeddings, ref_labels, ref_valid, ids, ref_ids: references (e.g. a
      cross-batch memory) the anchors meet instead of the batch; see
      :func:`circle_jax.losses.engines.pair_sides` and docs/losses.md.

  Returns:
    float32 scalar.

  References:
    Hadsell, Chopra, LeCun, "Dimensionality Reduction by Learning an
    Invariant Mapping", CVPR 2006. Musgrave, Belongie, Lim, "A Metric
    Learning Reality Check", ECCV 2020.
  """
  rule = Contrastive(pos_margin=pos_margin, neg_margin=neg_margin)
  return engines.embedding_loss(
      rule, embeddings, labels, axis_name=axis_name, pos_mask=pos_mask,
      neg_mask=neg_mask, block_size=block_size, collective=collective,
      ref_embeddings=ref_embeddings, ref_labels=ref_labels,
      ref_valid=ref_valid, ids=ids, ref_ids=ref_ids)


# ----------------------------------------------------------------------------
# Triplet margin loss.
# ----------------------------------------------------------------------------


def _all_triplet_sums(shifted, dist, pos, neg):
  """Per-anchor sum and count of the non-zero hinges over all triplets.

  ``sum_{p, n} [shifted_ap - d_an]_+`` over the positives ``p`` and
  negatives ``n`` of each anchor, with ``shifted = dist + margin`` (the
  margin is added outside, so its gradient, if it is traced, comes from plain
  autodiff). For one positive, the active negatives are those closer than
  ``c = shifted_ap``: with the row's negative distances sorted ascending and
  their prefix sums ``S``, there are ``k = #{d_an < c}`` of them (a binary
  search) and their hinges sum to ``k c - S_k``. So no ``[M, N, N]`` triplet
  table is built: ``O(M N log N)`` time and ``O(M N)`` memory, and autodiff
  through the sort's gather and the prefix sums gives the exact gradient
  (``#active negatives`` per positive, ``-#active positives`` per negative).

  Args:
    shifted: ``[M, N]`` float32, ``d + margin`` (the positive side).
    dist: ``[M, N]`` float32 distances (the negative side).
    pos, neg: ``[M, N]`` bool masks.

  Returns:
    ``(sums, counts)``, both ``[M]``.
  """
  neg_sorted, _, _ = _miners.sort_masked_rows(dist, neg)
  finite = jnp.isfinite(neg_sorted)
  # Prefix sums relative to each row's smallest negative distance (the
  # offset cancels in k c - S_k and keeps the cancellation small).
  base = jax.lax.stop_gradient(
      jnp.where(finite[:, :1], neg_sorted[:, :1], 0.0))
  prefix = jnp.cumsum(jnp.where(finite, neg_sorted - base, 0.0), axis=1)
  prefix = jnp.concatenate([jnp.zeros_like(prefix[:, :1]), prefix], axis=1)
  active = _miners.row_searchsorted(neg_sorted, shifted, "left")  # [M, N]
  hinge = (active.astype(jnp.float32) * (shifted - base)
           - jnp.take_along_axis(prefix, active, axis=1))
  sums = jnp.sum(jnp.where(pos, hinge, 0.0), axis=1)
  counts = jnp.sum(jnp.where(pos, active, 0), axis=1).astype(jnp.float32)
  return sums, counts


def _triplet_core(dist, pos, neg, *, margin, mining, axis_name):
  if mining == "all":
    sums, counts = _all_triplet_sums(dist + margin, dist, pos, neg)
    return _ratio(sums, counts, axis_name)
  if mining == "batch_hard":
    valid = pos.any(1) & neg.any(1)
    hardest_pos = jnp.max(jnp.where(pos, dist, -jnp.inf), axis=1)
    hardest_neg = jnp.min(jnp.where(neg, dist, jnp.inf), axis=1)
    gap = jnp.where(valid, hardest_pos - hardest_neg, 0.0)
    per_anchor = jnp.where(valid, jax.nn.relu(gap + margin), 0.0)
    return _common.mean_over_valid(per_anchor, valid, axis_name)
  # "semi_hard": for each positive pair the closest negative farther than the
  # positive; if there is none, the farthest negative (FaceNet as implemented
  # by TensorFlow Addons' TripletSemiHardLoss), the lowest column among equal
  # distances. The choice is an index (no gradient) from a binary search in
  # the row's sorted negative distances; the distance is then gathered, so
  # time is O(M N log N) and memory O(M N).
  neg_sorted, order, num_neg = _miners.sort_masked_rows(
      jax.lax.stop_gradient(dist), neg)
  closest = _miners.row_searchsorted(neg_sorted, dist, "right")
  farthest_value = _miners.take_rows(neg_sorted, num_neg[:, None] - 1)
  farthest = _miners.row_searchsorted(neg_sorted, farthest_value, "left")
  pick = jnp.where(closest < num_neg[:, None], closest, farthest)
  chosen = _miners.take_rows(order, pick)
  d_an = jnp.take_along_axis(dist, chosen, axis=1)  # [M, P]
  valid = pos & neg.any(1, keepdims=True)
  loss = jnp.where(valid, jax.nn.relu(dist - d_an + margin), 0.0)
  return _ratio(loss, valid, axis_name)


def triplet_margin_loss_from_distance(
    distance: Array,
    labels: Array,
    *,
    margin: float = 0.2,
    mining: str = "all",
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Array:
  """Triplet margin loss of a square ``[B, B]`` distance matrix.

  See :func:`triplet_margin_loss`.
  """
  mining = _checked_mining(mining)
  dist, _, pos, neg = _square(distance, labels, pos_mask, neg_mask, "distance")
  return _triplet_core(dist, pos, neg, margin=margin, mining=mining,
                       axis_name=None)


def triplet_margin_loss(
    embeddings: Array,
    labels: Array,
    *,
    margin: float = 0.2,
    mining: str = "all",
    axis_name: Optional[str] = None,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
    ref_embeddings: Optional[Array] = None,
    ref_labels: Optional[Array] = None,
    ref_valid: Optional[Array] = None,
    ids: Optional[Array] = None,
    ref_ids: Optional[Array] = None,
) -> Array:
  r"""Triplet margin loss with in-batch mining (Schroff et al.; Hermans et al.).

  On Euclidean distances ``d`` between L2-normalised embeddings, a triplet
  ``(a, p, n)`` (``p`` a positive, ``n`` a negative of ``a``) costs
  ``\ell_{apn} = [d_{ap} - d_{an} + m]_+``.

  * ``mining="all"``: every triplet of the batch;
    ``L = \operatorname{mean}_{\ell_{apn} > 0} \ell_{apn}``, the mean over the
    triplets with non-zero loss (0 if none).
  * ``mining="batch_hard"`` (Hermans et al.): per anchor, the farthest
    positive and the closest negative,
    ``L = \operatorname{mean}_a [\max_p d_{ap} - \min_n d_{an} + m]_+`` over
    anchors with at least one positive and one negative.
  * ``mining="semi_hard"`` (Schroff et al., as in TensorFlow Addons'
    ``TripletSemiHardLoss``): every positive pair ``(a, p)`` takes the closest
    negative with ``d_{an} > d_{ap}``, or the farthest negative if none is
    farther than the positive; ``L`` is the mean over positive pairs whose
    anchor has a negative.

  Masks from a miner restrict the positive and negative pairs before mining.
  ``"all"`` and ``"semi_hard"`` never build the ``[M, N, N]`` triplet table:
  each row's negative distances are sorted once, and binary searches with
  prefix sums give, per positive pair, the number and the hinge sum of its
  active negatives (``"all"``) or its chosen negative (``"semi_hard"``). Time
  is ``O(M N log N)`` and memory ``O(M N)``; the gradient is exact autodiff
  through the sort's gather and the prefix sums.

  With references (``ref_embeddings``, pytorch-metric-learning's
  ``ref_emb`` semantics) the anchor ``a`` is a row of ``embeddings`` and its
  positives ``p`` and negatives ``n`` are references: the triplets are
  ``(a, p, n)`` with ``p`` and ``n`` among the references, mined per anchor
  as above.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    margin: the margin ``m``.
    mining: ``"all"``, ``"batch_hard"`` or ``"semi_hard"``.
    axis_name: global-batch loss across devices (see module docstring).
    pos_mask, neg_mask: optional miner masks of the block's shape.

    ref_embeddings, ref_labels, ref_valid, ids, ref_ids: references (e.g. a
      cross-batch memory) the anchors meet instead of the batch (above); see
      :func:`circle_jax.losses.engines.pair_sides` and docs/losses.md.
  Returns:
    float32 scalar.

  References:
    Schroff, Kalenichenko, Philbin, "FaceNet", CVPR 2015. Hermans, Beyer,
    Leibe, "In Defense of the Triplet Loss for Person Re-Identification",
    arXiv:1703.07737, 2017.
  """
  mining = _checked_mining(mining)
  _check_margin(margin, "margin")
  _, sim, pos, neg = _embedding_block(
      embeddings, labels, axis_name, pos_mask, neg_mask,
      ref_embeddings=ref_embeddings,
      ref_labels=ref_labels, ref_valid=ref_valid, ids=ids, ref_ids=ref_ids)
  return _triplet_core(_common.euclidean_from_cosine(sim), pos, neg,
                       margin=margin, mining=mining, axis_name=axis_name)


# ----------------------------------------------------------------------------
# Lifted structure loss.
# ----------------------------------------------------------------------------


def _lifted_core(dist, pos, neg, *, margin, axis_name, column_term=True):
  # log sum_{k in N_i} exp(margin - d_ik) for every row; the column sample j
  # needs the same quantity for its own row, which lives on its device
  # (without `column_term`, the columns are references: no such term).
  row_lse = _common.masked_logsumexp(margin - dist, neg)  # [M]
  m, n = dist.shape
  if column_term:
    col_lse = _common.gather_global(row_lse, axis_name)  # [N]
    both = jnp.stack([jnp.broadcast_to(row_lse[:, None], (m, n)),
                      jnp.broadcast_to(col_lse[None, :], (m, n))], axis=-1)
    lse = _common.masked_logsumexp(both, jnp.isfinite(both), axis=-1)
  else:
    lse = jnp.broadcast_to(row_lse[:, None], (m, n))
  has_neg = jnp.isfinite(lse)
  j = jnp.where(pos & has_neg, lse, 0.0) + dist
  loss = jnp.where(pos & has_neg, jnp.square(jax.nn.relu(j)), 0.0)
  return 0.5 * _ratio(loss, pos, axis_name)


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
  dist, _, pos, neg = _square(distance, labels, pos_mask, neg_mask, "distance")
  return _lifted_core(dist, pos, neg, margin=margin, axis_name=None)


def lifted_structure_loss(
    embeddings: Array,
    labels: Array,
    *,
    margin: float = 1.0,
    axis_name: Optional[str] = None,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
    ref_embeddings: Optional[Array] = None,
    ref_labels: Optional[Array] = None,
    ref_valid: Optional[Array] = None,
    ids: Optional[Array] = None,
    ref_ids: Optional[Array] = None,
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

  With references (``ref_embeddings``) the anchor ``i`` is a row of
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
    axis_name: global-batch loss across devices; each device's row
      log-sum-exps are all-gathered to serve as the ``N_j`` terms.
    pos_mask, neg_mask: optional miner masks of the block's shape.

    ref_embeddings, ref_labels, ref_valid, ids, ref_ids: references (e.g. a
      cross-batch memory) the anchors meet instead of the batch (above); see
      :func:`circle_jax.losses.engines.pair_sides` and docs/losses.md.
  Returns:
    float32 scalar.

  References:
    Oh Song, Xiang, Jegelka, Savarese, "Deep Metric Learning via Lifted
    Structured Feature Embedding", CVPR 2016.
  """
  _, sim, pos, neg = _embedding_block(
      embeddings, labels, axis_name, pos_mask, neg_mask,
      ref_embeddings=ref_embeddings,
      ref_labels=ref_labels, ref_valid=ref_valid, ids=ids, ref_ids=ref_ids)
  return _lifted_core(_common.euclidean_from_cosine(sim), pos, neg,
                      margin=margin, axis_name=axis_name,
                      column_term=ref_embeddings is None)


# ----------------------------------------------------------------------------
# N-pair loss.
# ----------------------------------------------------------------------------


def _n_pair_core(sim, pos, neg, *, axis_name):
  neg_lse = _common.masked_logsumexp(sim, neg)  # [M]
  has_neg = neg.any(axis=1)
  valid = pos & has_neg[:, None]
  logits = jnp.where(valid, jnp.where(has_neg, neg_lse, 0.0)[:, None] - sim,
                     0.0)
  loss = jnp.where(valid, jax.nn.softplus(logits), 0.0)
  return _ratio(loss, valid, axis_name)


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
  sim, _, pos, neg = _square(similarity, labels, pos_mask, neg_mask,
                             "similarity")
  return _n_pair_core(sim, pos, neg, axis_name=None)


def n_pair_loss(
    embeddings: Array,
    labels: Array,
    *,
    l2_reg: float = 0.02,
    axis_name: Optional[str] = None,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
    ref_embeddings: Optional[Array] = None,
    ref_labels: Optional[Array] = None,
    ref_valid: Optional[Array] = None,
    ids: Optional[Array] = None,
    ref_ids: Optional[Array] = None,
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

  With references (``ref_embeddings``) every anchor ``a`` (a row of
  ``embeddings``) forms a tuplet with each of its positives ``p`` among the
  references and all its negatives among the references; the L2 penalty is
  over the anchors only (the references are regularised as anchors of their
  own batch).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (raw, not normalised).
    labels: ``[B]`` integer labels.
    l2_reg: ``lambda``, weight of the squared-norm penalty.
    axis_name: global-batch loss across devices (see module docstring).
    pos_mask, neg_mask: optional miner masks of the block's shape.

    ref_embeddings, ref_labels, ref_valid, ids, ref_ids: references (e.g. a
      cross-batch memory) the anchors meet instead of the batch (above); see
      :func:`circle_jax.losses.engines.pair_sides` and docs/losses.md.
  Returns:
    float32 scalar.

  References:
    Sohn, "Improved Deep Metric Learning with Multi-class N-pair Loss
    Objective", NeurIPS 2016, eq. 6 and Sec. 3.2.1.
  """
  _check_margin(l2_reg, "l2_reg")
  rows, sim, pos, neg = _embedding_block(
      embeddings, labels, axis_name, pos_mask, neg_mask, normalize=False,
      ref_embeddings=ref_embeddings,
      ref_labels=ref_labels, ref_valid=ref_valid, ids=ids, ref_ids=ref_ids)
  emb = rows.z
  tuplet = _n_pair_core(sim, pos, neg, axis_name=axis_name)
  penalty = _common.sum_over_batch(jnp.sum(emb * emb, axis=1), axis_name)
  return tuplet + l2_reg * penalty


# ----------------------------------------------------------------------------
# Margin loss.
# ----------------------------------------------------------------------------


def _beta_rows(beta, labels):
  beta = jnp.asarray(beta)
  _common.check_floating(beta, f"`beta` must be a floating array; got "
                               f"{beta.dtype}.")
  if beta.ndim == 0:
    return jnp.broadcast_to(beta.astype(jnp.float32), labels.shape)
  _common.check_rank(beta, 1, f"`beta` must be a scalar or a [num_classes] "
                              f"vector; got shape {beta.shape}.")
  return beta.astype(jnp.float32)[labels]


def _margin_core(dist, pos_w, neg_w, beta_rows, *, margin, nu, axis_name):
  b = beta_rows[:, None]
  pos_loss = jax.nn.relu(dist - b + margin)
  neg_loss = jax.nn.relu(b - dist + margin)
  total = (jnp.sum(pos_w * pos_loss) + jnp.sum(neg_w * neg_loss)
           + nu * jnp.sum(pos_w * b))
  count = (jnp.sum(jnp.where(pos_loss > 0, pos_w, 0.0))
           + jnp.sum(jnp.where(neg_loss > 0, neg_w, 0.0)))
  return _ratio(total, count, axis_name)


def _margin_weights(pos, neg, pair_weights):
  if pair_weights is None:
    return pos.astype(jnp.float32), neg.astype(jnp.float32)
  pair_weights = _common.check_shape(
      pair_weights, pos.shape,
      f"`pair_weights` must have the shape of the distance block "
      f"{pos.shape}; got {jnp.shape(pair_weights)}.")
  w = pair_weights.astype(jnp.float32)
  return jnp.where(pos, w, 0.0), jnp.where(neg, w, 0.0)


def margin_loss_from_distance(
    distance: Array,
    labels: Array,
    beta: Array,
    *,
    margin: float = 0.2,
    nu: float = 0.0,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
    pair_weights: Optional[Array] = None,
) -> Array:
  """Margin loss of a square ``[B, B]`` distance matrix (no sampling).

  See :func:`margin_loss`; pass a sampler's ``pair_weights`` to reproduce
  distance-weighted sampling.
  """
  dist, labels, pos, neg = _square(distance, labels, pos_mask, neg_mask,
                                   "distance")
  pos_w, neg_w = _margin_weights(pos, neg, pair_weights)
  return _margin_core(dist, pos_w, neg_w, _beta_rows(beta, labels),
                      margin=margin, nu=nu, axis_name=None)


def margin_loss(
    embeddings: Array,
    labels: Array,
    beta: Array,
    *,
    margin: float = 0.2,
    nu: float = 0.0,
    key: Optional[Array] = None,
    cutoff: float = 0.5,
    nonzero_loss_cutoff: float = 1.4,
    axis_name: Optional[str] = None,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
    pair_weights: Optional[Array] = None,
    ref_embeddings: Optional[Array] = None,
    ref_labels: Optional[Array] = None,
    ref_valid: Optional[Array] = None,
    ids: Optional[Array] = None,
    ref_ids: Optional[Array] = None,
) -> Array:
  r"""Margin loss with learnable boundary and distance-weighted sampling.

  Wu et al. (2017), eq. 5, on Euclidean distances ``d`` between L2-normalised
  embeddings, with ``beta_a`` the boundary of the anchor's class (or one
  shared scalar):

  .. math::

    L = \frac{\sum_{(a,p)} w_{ap} [d_{ap} - \beta_a + m]_+
              + \sum_{(a,n)} w_{an} [\beta_a - d_{an} + m]_+
              + \nu \sum_{(a,p)} w_{ap} \beta_a}
             {\sum_{(a,j)} w_{aj}\, [\ell_{aj} > 0]} .

  This is the official reduction: the sum of the hinge terms and of the
  ``nu``-regulariser (one ``beta`` per triplet, i.e. per positive pair),
  divided by the number of pairs with non-zero loss (counted with
  multiplicity; 1 when there is none, so an empty batch gives 0).

  Sampling: with ``key``, each positive pair ``(a, p)`` draws one negative of
  ``a`` by distance-weighted sampling (:func:`distance_weighted_miner`;
  ``w_{an}`` is the draw count, ``w_{ap} = 1``), as in the official code.
  Without ``key`` every pair has weight 1 (or ``pair_weights``).

  With references (``ref_embeddings``) the pairs are (anchor, reference):
  ``a`` is a row of ``embeddings`` with its class's ``beta_a``, ``p`` and
  ``n`` are its positives and negatives among the references, and the
  sampler draws each positive pair's negative among the references.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels in ``[0, num_classes)`` when ``beta`` is
      per class.
    beta: learnable boundary, a scalar or ``[num_classes]`` (the official
      code is class-specific, initialised to 1.2).
    margin: the margin ``m`` (the paper's ``alpha``).
    nu: weight of the ``beta`` regulariser.
    key: PRNG key of the distance-weighted sampler; ``None`` uses all pairs.
    cutoff, nonzero_loss_cutoff: sampler parameters (see
      :func:`distance_weighted_miner`).
    axis_name: global-batch loss across devices; sampling is per global row,
      so it matches the single-device draws.
    pos_mask, neg_mask: optional miner masks of the block's shape.
    pair_weights: optional float ``[M, N]`` pair multiplicities (e.g. from
      :func:`distance_weighted_miner`); exclusive with ``key``.

    ref_embeddings, ref_labels, ref_valid, ids, ref_ids: references (e.g. a
      cross-batch memory) the anchors meet instead of the batch (above); see
      :func:`circle_jax.losses.engines.pair_sides` and docs/losses.md.
  Returns:
    float32 scalar.

  References:
    Wu, Manmatha, Smola, Kraehenbuehl, "Sampling Matters in Deep Embedding
    Learning", ICCV 2017.
  """
  if key is not None and pair_weights is not None:
    raise ValueError(
        "Pass either `key` (sample negatives) or `pair_weights` (already "
        "sampled), not both.")
  _check_margin(margin, "margin")
  rows, sim, pos, neg = _embedding_block(
      embeddings, labels, axis_name, pos_mask, neg_mask,
      ref_embeddings=ref_embeddings,
      ref_labels=ref_labels, ref_valid=ref_valid, ids=ids, ref_ids=ref_ids)
  dist = _common.euclidean_from_cosine(sim)
  if key is not None:
    m, dim = rows.z.shape
    num_rows = m if axis_name is None else m * jax.lax.axis_size(axis_name)
    pair_weights = _miners.distance_weighted_weights(
        dist, pos, neg, _common.local_row_offset(m, axis_name), key, dim,
        cutoff=cutoff, nonzero_loss_cutoff=nonzero_loss_cutoff,
        num_rows=num_rows)
  pos_w, neg_w = _margin_weights(pos, neg, pair_weights)
  return _margin_core(dist, pos_w, neg_w, _beta_rows(beta, rows.labels),
                      margin=margin, nu=nu, axis_name=axis_name)
