"""Triplet margin loss with in-batch mining (Schroff et al.; Hermans et al.).

``mining="batch_hard"`` is a rule (:class:`BatchHard`): the pre-pass finds
each anchor's farthest positive and closest negative distance, the selection
keeps the pairs at those distances (ties share the gradient equally, as the
autodiff of ``max`` does) and the ``"sum"`` statistic averages them, so it
runs on every engine (dense, blockwise, ring).

``mining="all"`` and ``"semi_hard"`` are not rules. A rule's per-anchor state
is a fixed number of set statistics that every tile updates independently
(a logsumexp, a weighted mean, a sum and count, a min or max), and its
per-anchor loss is a function of them. Here the loss couples each positive
with the negatives: ``"all"`` sums ``[d_ap - d_an + m]_+`` over every
``(p, n)``, whose active negatives depend on ``d_ap``, so the per-anchor
state it needs is the anchor's whole sorted list of negative distances
(``O(N)``, not ``O(1)``); ``"semi_hard"`` picks, per positive, the closest
negative farther than it, a per-pair search over the same list. Neither is a
fixed set of per-anchor statistics, so neither tiles. A two-stage rule (the
N-pair and lifted structure losses) does not help either: its pair term
reads one first-stage value per anchor (e.g. the negatives' logsumexp), but
``[d_ap - d_an + m]_+`` summed or searched over ``n`` depends on ``d_ap``
itself, so no single per-anchor value computed before the pairs gives it.
They take the same ``**options`` as the rules
(:func:`circle_jax.losses.engine.embedding_loss`) through
:func:`circle_jax.losses.engine.dense_block`, which runs the dense block and
refuses ``block_size`` and the ring with that reason.
"""

from __future__ import annotations

import types
from typing import Optional, Union

import jax
import jax.numpy as jnp

from circle_jax.losses import entries
from circle_jax.losses.engine import reductions
from circle_jax.losses import engine
from circle_jax.losses import miners
from circle_jax.losses import ranges as ranges_lib

Array = jax.Array

TRIPLET_MINING = ("all", "batch_hard", "semi_hard")
_NOT_A_RULE = ("each positive meets each negative: see "
               "circle_jax.losses.triplet's docstring")


def _checked_mining(mining):
  if mining not in TRIPLET_MINING:
    raise ValueError(
        f"`mining` must be one of {TRIPLET_MINING}; got {mining!r}.")
  return mining


@engine.rule_dataclass(meta=("on_distance",))
class BatchHard(engine.PairRule):
  """Batch-hard triplet rule: per anchor ``[max_p d_ap - min_n d_an + m]_+``.

  Attributes:
    margin: ``m``, >= 0.
    on_distance: static; see :func:`circle_jax.losses.engine.as_distance`.
  """

  margin: float = 0.2
  on_distance: bool = False

  statistic = "sum"
  prepass = (("max", "pos"), ("min", "neg"))
  ranges = types.MappingProxyType({"margin": ranges_lib.NONNEGATIVE_RANGE})

  def prepare(self, s):
    return engine.as_distance(self, s)

  def select(self, d, pos, neg, pre):
    hardest_pos, hardest_neg = pre
    return pos & (d == hardest_pos), neg & (d == hardest_neg)

  def values(self, d):
    return d, d

  def combine(self, sum_count_p, sum_count_n):
    (sum_p, count_p), (sum_n, count_n) = sum_count_p, sum_count_n
    valid = (count_p > 0) & (count_n > 0)
    gap = jnp.where(valid, sum_p / jnp.maximum(count_p, 1.0)
                    - sum_n / jnp.maximum(count_n, 1.0), 0.0)
    return jnp.where(valid, jax.nn.relu(gap + self.margin), 0.0), valid


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
  neg_sorted, _, _ = miners.sort_masked_rows(dist, neg)
  finite = jnp.isfinite(neg_sorted)
  # Prefix sums relative to each row's smallest negative distance (the
  # offset cancels in k c - S_k and keeps the cancellation small).
  base = jax.lax.stop_gradient(
      jnp.where(finite[:, :1], neg_sorted[:, :1], 0.0))
  prefix = jnp.cumsum(jnp.where(finite, neg_sorted - base, 0.0), axis=1)
  prefix = jnp.concatenate([jnp.zeros_like(prefix[:, :1]), prefix], axis=1)
  active = miners.row_searchsorted(neg_sorted, shifted, "left")  # [M, N]
  hinge = (active.astype(jnp.float32) * (shifted - base)
           - jnp.take_along_axis(prefix, active, axis=1))
  sums = jnp.sum(jnp.where(pos, hinge, 0.0), axis=1)
  counts = jnp.sum(jnp.where(pos, active, 0), axis=1).astype(jnp.float32)
  return sums, counts


def _triplet_terms(dist, pos, neg, margin):
  """``[M, N, N]`` terms ``[d_ap - d_an + m]_+`` and their elements (the
  triplets): what a ``reduction`` of ``mining="all"`` reduces."""
  terms = jax.nn.relu(dist[:, :, None] - dist[:, None, :] + margin)
  return terms, pos[:, :, None] & neg[:, None, :]


def _dense_core(dist, pos, neg, *, margin, mining, axis_name,
                reduction=None, labels=None):
  """``"all"`` and ``"semi_hard"`` on a whole block (module docstring);
  with ``reduction``, that one of the triplets' (``"all"``) or the positive
  pairs' (``"semi_hard"``) terms."""
  if reduction is not None and mining == "all":
    return reductions.reduce_terms(
        *_triplet_terms(dist, pos, neg, margin), reduction, labels=labels,
        axis_name=axis_name)
  if mining == "all":
    sums, counts = _all_triplet_sums(dist + margin, dist, pos, neg)
    return reductions.ratio_of_sums(sums, counts, axis_name)
  # "semi_hard": for each positive pair the closest negative farther than the
  # positive; if there is none, the farthest negative (FaceNet as implemented
  # by TensorFlow Addons' TripletSemiHardLoss), the lowest column among equal
  # distances. The choice is an index (no gradient) from a binary search in
  # the row's sorted negative distances; the distance is then gathered, so
  # time is O(M N log N) and memory O(M N).
  neg_sorted, order, num_neg = miners.sort_masked_rows(
      jax.lax.stop_gradient(dist), neg)
  closest = miners.row_searchsorted(neg_sorted, dist, "right")
  farthest_value = miners.take_rows(neg_sorted, num_neg[:, None] - 1)
  farthest = miners.row_searchsorted(neg_sorted, farthest_value, "left")
  pick = jnp.where(closest < num_neg[:, None], closest, farthest)
  chosen = miners.take_rows(order, pick)
  d_an = jnp.take_along_axis(dist, chosen, axis=1)  # [M, P]
  valid = pos & neg.any(1, keepdims=True)
  loss = jnp.where(valid, jax.nn.relu(dist - d_an + margin), 0.0)
  if reduction is not None:
    return reductions.reduce_terms(loss, valid, reduction, labels=labels,
                                   axis_name=axis_name)
  return reductions.ratio_of_sums(loss, valid, axis_name)


def _per_anchor(triplets_per_anchor):
  """``"all"`` or a positive int (a config gives it as a string)."""
  value = triplets_per_anchor
  if isinstance(value, str) and value.isdigit():
    value = int(value)
  if value != "all" and not (isinstance(value, int) and value > 0):
    raise ValueError(
        "`triplets_per_anchor` must be \"all\" or a positive integer; got "
        f"{triplets_per_anchor!r}.")
  return value


def sample_triplets(pos: Array, neg: Array, triplets_per_anchor: int,
                    key: Array):
  """``k = triplets_per_anchor`` triplets per anchor, as PML's sampler.

  Each draws a positive and a negative of its anchor, uniformly and with
  replacement (pytorch-metric-learning's ``get_random_triplet_indices``),
  from ``key``: the same key gives the same triplets.

  Args:
    pos, neg: ``[M, N]`` bool pair masks.
    triplets_per_anchor: ``k`` > 0.
    key: a PRNG key.

  Returns:
    ``(p, n)``: ``[M, k]`` int32 column indices; the rows of anchors
    without a positive or a negative are arbitrary (mask them).
  """
  kp, kn = jax.random.split(key)
  shape = (triplets_per_anchor, pos.shape[0])
  draw = lambda k, mask: jax.random.categorical(
      k, jnp.where(mask, 0.0, -jnp.inf), shape=shape).T.astype(jnp.int32)
  return draw(kp, pos), draw(kn, neg)


def _pml_triplets(dist, pos, neg, pn_dist, *, margin, swap, smooth_loss,
                  per_anchor, key, offset, axis_name):
  """PML's ``TripletMarginLoss`` on an explicit table of triplets: every
  ``(a, p, n)`` (``[M, N, N]``) or ``per_anchor`` sampled per anchor
  (``[M, k]``); ``pn_dist`` the ``[N, N]`` candidates' distances (swap)."""
  if per_anchor == "all":
    d_ap, d_an = dist[:, :, None], dist[:, None, :]
    mask = pos[:, :, None] & neg[:, None, :]
    d_pn = pn_dist[None] if swap else None
  else:
    p, n = sample_triplets(pos, neg, per_anchor,
                           jax.random.fold_in(key, offset))
    d_ap = jnp.take_along_axis(dist, p, axis=1)
    d_an = jnp.take_along_axis(dist, n, axis=1)
    mask = jnp.broadcast_to(pos.any(1, keepdims=True)
                            & neg.any(1, keepdims=True), p.shape)
    d_pn = pn_dist[p, n] if swap else None
  if swap:  # Balntas et al.'s swap: the closer of d_an and d_pn
    d_an = jnp.minimum(d_an, d_pn)
  violation = d_ap - d_an + margin
  loss = jnp.where(mask, (jax.nn.softplus if smooth_loss else jax.nn.relu)(
      violation), 0.0)
  # PML's AvgNonZeroReducer: the mean over the triplets with a loss > 0.
  return reductions.ratio_of_sums(loss, mask & (loss > 0), axis_name)


def triplet_margin_loss_from_distance(distance: Array, labels: Array, *,
                                      margin: float = BatchHard.margin,
                                      mining: str = "all",
                                      pos_mask: Optional[Array] = None,
                                      neg_mask: Optional[Array] = None) -> Array:
  """Triplet margin loss of a square ``[B, B]`` distance matrix.

  See :func:`triplet_margin_loss`.
  """
  if _checked_mining(mining) == "batch_hard":
    return engine.distance_matrix_loss(BatchHard(margin=margin), distance,
                                       labels, pos_mask=pos_mask,
                                       neg_mask=neg_mask)
  dist, _, pos, neg = engine.square_block(distance, labels, pos_mask,
                                          neg_mask, "distance")
  return _dense_core(dist, pos, neg, margin=margin, mining=mining,
                     axis_name=None)


def triplet_margin_loss(embeddings: Array, labels: Array, *,
                        margin: float = BatchHard.margin, mining: str = "all",
                        swap: bool = False, smooth_loss: bool = False,
                        triplets_per_anchor: Union[str, int] = "all",
                        key: Optional[Array] = None,
                        **options) -> Array:
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

  With references (``ref``, pytorch-metric-learning's
  ``ref_emb`` semantics) the anchor ``a`` is a row of ``embeddings`` and its
  positives ``p`` and negatives ``n`` are references: the triplets are
  ``(a, p, n)`` with ``p`` and ``n`` among the references, mined per anchor
  as above.

  pytorch-metric-learning's ``TripletMarginLoss`` options (with
  ``mining="all"``, PML's triplets; equal value and gradient, tested in
  float64): ``swap`` (Balntas et al.) replaces ``d_{an}`` by
  ``\min(d_{an}, d_{pn})``; ``smooth_loss`` replaces the hinge by
  ``\operatorname{softplus}`` (then every triplet counts in the mean);
  ``triplets_per_anchor=k`` takes ``k`` triplets per anchor that has a
  positive and a negative, each with a positive and a negative drawn
  uniformly with replacement, as PML's sampler, but from the PRNG ``key``
  (JAX's explicit randomness: the same key gives the same triplets; the
  registry passes the train step's key; on several devices, each device
  folds its first row's index into the key, so the draws differ from one
  device's). These three build the explicit table of triplets, ``[M, N, N]``
  for ``"all"`` (``[M, k]`` sampled), not the sorted form. With miner masks,
  PML ignores ``triplets_per_anchor`` and takes the mined triplets; here the
  draws are among the masked pairs. PML bug: with ``ref_emb`` and ``swap``
  it reads ``d_{pn}`` at row ``p`` of the query-by-reference matrix, a query
  row, not the reference ``p``; here ``d_{pn}`` is between the references.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    margin: the margin ``m``.
    mining: ``"all"``, ``"batch_hard"`` or ``"semi_hard"``.
    swap: use ``\min(d_{an}, d_{pn})`` (PML's name; ``mining="all"``).
    smooth_loss: softplus instead of the hinge (PML's name;
      ``mining="all"``).
    triplets_per_anchor: ``"all"`` or the number of sampled triplets per
      anchor (PML's name; ``mining="all"``; needs ``key``).
    key: the PRNG key of ``triplets_per_anchor``'s draws (else unused).
    **options: the pair losses' shared keywords (``axis_name``,
      ``pos_mask``, ``neg_mask``, ``block_size``, ``collective``, ``ref``),
      documented once at :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Schroff, Kalenichenko, Philbin, "FaceNet", CVPR 2015. Hermans, Beyer,
    Leibe, "In Defense of the Triplet Loss for Person Re-Identification",
    arXiv:1703.07737, 2017.
  """
  per_anchor = _per_anchor(triplets_per_anchor)
  pml_options = swap or smooth_loss or per_anchor != "all"
  if pml_options and _checked_mining(mining) != "all":
    raise ValueError("`swap`, `smooth_loss` and `triplets_per_anchor` are "
                     "pytorch-metric-learning's options of all triplets: "
                     "use them with mining=\"all\".")
  if per_anchor != "all" and key is None:
    raise ValueError("`triplets_per_anchor` draws triplets: pass a PRNG "
                     "`key`, or triplets_per_anchor=\"all\".")
  if _checked_mining(mining) == "batch_hard":
    return engine.embedding_loss(BatchHard(margin=margin), embeddings, labels,
                                 **options)
  ranges_lib.check_range(margin, "margin", ranges_lib.NONNEGATIVE_RANGE)
  reduction = engine.as_reduction(options.pop("reduction", None))
  rows, cols, dist, pos, neg = engine.dense_block(
      embeddings, labels, loss=f"triplet loss with mining={mining!r}",
      reason=_NOT_A_RULE, distance=True, **options)
  if pml_options and reduction is not None:
    raise ValueError(
        "triplet's swap, smooth_loss and triplets_per_anchor reduce their "
        "sampled triplets themselves (PML's mean over non-zero terms); drop "
        "`reduction` or those options.")
  if pml_options:
    geometry = engine.resolve_geometry(
        options.get("geometry")) or engine.COSINE
    pn_dist = (geometry.to_distance(geometry.tile(cols.z, cols.z))
               if swap else None)
    return _pml_triplets(
        dist, pos, neg, pn_dist, margin=margin, swap=swap,
        smooth_loss=smooth_loss, per_anchor=per_anchor, key=key,
        offset=reductions.local_row_offset(rows.z.shape[0],
                                           options.get("axis_name")),
        axis_name=options.get("axis_name"))
  return _dense_core(dist, pos, neg, margin=margin,
                     mining=mining, axis_name=options.get("axis_name"),
                     reduction=reduction, labels=rows.labels)


# The registry's facts of this module's losses (circle_jax.losses.registry
# collects them).
REGISTRY = (
    entries.entry("triplet", triplet_margin_loss, "pair", tiled=False,
        needs_key=True,
        paper="Schroff et al., \"FaceNet\", CVPR 2015; Hermans et al., "
              "\"In Defense of the Triplet Loss\", 2017",
        reduction="all: mean over non-zero triplets; batch_hard: mean "
                  "over anchors; semi_hard: mean over positive pairs"),
)
