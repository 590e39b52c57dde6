"""The miners of pytorch-metric-learning 2.9 that :mod:`.miners` lacks.

Same conventions as :mod:`circle_jax.losses.miners` (its docstring): fixed
shapes, jit-able, stop-gradient, and with ``axis_name`` the local rows
``[B_local, B_global]`` of the global batch's masks. Distances are Euclidean
distances between L2-normalised embeddings (PML's default ``LpDistance``),
except :func:`angular_miner`'s, which PML measures on the embeddings as given
(the paper's geometry; the trainer's embeddings are unit vectors anyway).

PML returns indices: triplets ``(a, p, n)`` or pairs ``(a1, p, a2, n)``.
Here every miner returns ``[M, N]`` arrays for the pair losses' ``pos_mask``
/ ``neg_mask`` (or ``pair_weights``):

* **Pair miners** (:func:`batch_easy_hard_miner`, :func:`hdc_miner`): the
  masks are exactly PML's pairs. PML's triplet losses turn pairs into every
  triplet ``(a, p, n)`` whose ``(a, p)`` and ``(a, n)`` are both mined
  (``convert_to_triplets``), which is what this project's triplet loss does
  with masks: equal for every loss.
* **Triplet miners** (:func:`angular_miner`, :func:`triplet_margin_miner`):
  a set of triplets is not a ``[B, B]`` object. The miner returns its
  projection on pairs: ``pos_mask[a, p]`` (``neg_mask[a, n]``) is True when
  the pair belongs to at least one mined triplet. That is exactly what PML's
  pair losses receive from a triplet miner (``convert_to_pairs`` keeps
  ``(a, p)`` and ``(a, n)`` of every triplet), up to PML's repetitions of a
  pair that belongs to several triplets. A triplet loss on the masks uses
  every triplet ``(a, p, n)`` of the two masks, a superset of the mined set;
  ``triplet_margin_loss(mining="all", margin=m)`` on
  ``triplet_margin_miner(margin=m)``'s masks still equals PML's
  TripletMarginLoss on the mined triplets (the extra triplets all have a
  zero hinge; tested). The exact triplet sets are
  :func:`angular_triplets` and :func:`triplet_margin_triplets`
  (``[M, N, N]`` bool).
* :func:`uniform_histogram_miner` samples and returns ``pair_weights``, the
  number of draws of each pair (PML repeats drawn indices).

:data:`circle_jax.losses.miner_registry.MINERS` names every miner of both
modules for the configuration.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import checks
from circle_jax.losses import miners
from circle_jax.losses import ranges
from circle_jax.losses.engine.sides import Candidates

Array = jax.Array

STRATEGIES = ("easy", "semihard", "hard", "all")
TRIPLET_TYPES = ("all", "hard", "semihard", "easy")
_ANGLE_RANGE = ranges.HyperRange(0.0, 90.0, True, False)


def _distance_block(embeddings, labels, axis_name, ref=None):
  """Stop-gradient Euclidean distances ``[M, N]`` of the normalised
  embeddings, the label masks and this device's first global row
  (``ref``: :func:`circle_jax.losses.miners.mining_block`)."""
  sim, pos, neg, offset = miners.mining_block(embeddings, labels, axis_name,
                                              ref)
  return ops.euclidean_from_cosine(sim), pos, neg, offset


def _global_rows(fn, embeddings, labels, axis_name, ref=None):
  """``fn(dist, pos, neg)`` on the whole ``[N, N]`` global block (for miners
  that rank all pairs of the batch; ``[N, K]`` with ``ref``), then this
  device's rows of each output."""
  dist, pos, neg, offset = _distance_block(embeddings, labels, axis_name,
                                           ref)
  gather = lambda v: ops.gather_global(v, axis_name)
  out = fn(gather(dist), gather(pos), gather(neg))
  m = dist.shape[0]
  return jax.tree.map(
      lambda v: jax.lax.dynamic_slice_in_dim(v, offset, m, axis=0), out)


# ----------------------------------------------------------------------------
# Angular.
# ----------------------------------------------------------------------------


def angular_triplets(embeddings: Array, labels: Array, *, angle: float = 20.0,
                     axis_name: Optional[str] = None) -> Array:
  r"""The exact triplet set of :func:`angular_miner`, ``[M, N, N]`` bool
  (``[a, p, n]``); ``O(M N^2)`` memory."""
  return _angular(embeddings, labels, angle, axis_name, table=True)


def angular_miner(embeddings: Array, labels: Array, *, angle: float = 20.0,
                  axis_name: Optional[str] = None) -> Tuple[Array, Array]:
  r"""Triplets whose angle at the negative exceeds ``angle`` (PML's
  AngularMiner, after Wang et al. 2017).

  With ``x_c = (x_a + x_p) / 2`` the centre of a positive pair, the angle at
  the negative of the triplet ``(a, p, n)`` is

  .. math::

    \theta_{apn} = \arctan \frac{\lVert x_a - x_p \rVert}
                               {2 \lVert x_n - x_c \rVert},

  and the miner keeps the triplets with ``theta > angle`` (those for which
  Wang et al.'s angular constraint ``theta <= alpha`` fails). As in PML the
  distances are those of the embeddings as given (not normalised); PML's
  ``pairwise_distance`` adds ``1e-6`` to each coordinate difference, which
  is left out here. Returns the pairs of the mined triplets (module
  docstring); :func:`angular_triplets` is the triplet set. Each anchor's
  ``[N, N]`` table is built in turn: ``O(M N^2)`` time, ``O(N^2)`` memory.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    angle: the threshold in degrees, in ``[0, 90)`` (PML's ``angle``).
    axis_name: mine the ``[B_local, B_global]`` block across devices.

  Returns:
    ``(pos_mask, neg_mask)``, boolean ``[B, B]`` (``[B_local, B_global]``).

  References:
    Wang, Zhou, Wen, Liu, Lin, "Deep Metric Learning with Angular Loss",
    ICCV 2017, Sec. 3.
    Musgrave, Belongie, Lim, "A Metric Learning Reality Check", ECCV 2020
    (pytorch-metric-learning's AngularMiner).
  """
  return _angular(embeddings, labels, angle, axis_name, table=False)


def _angular(embeddings, labels, angle, axis_name, *, table):
  ranges.check_range(angle, "angle", _ANGLE_RANGE, " (degrees)")
  _, pos, neg, _ = miners.mining_block(embeddings, labels, axis_name)
  x = jax.lax.stop_gradient(checks.check_embeddings(embeddings))
  cols = ops.gather_global(x, axis_name)
  hi = jax.lax.Precision.HIGHEST
  g_rows = jnp.matmul(x, cols.T, precision=hi)  # [M, N] raw inner products
  g_cols = jnp.matmul(cols, cols.T, precision=hi)  # [N, N]
  sq = jnp.diagonal(g_cols)  # [N] squared norms of the columns
  sq_rows = jnp.sum(x * x, axis=1)
  threshold = jnp.deg2rad(jnp.asarray(angle, jnp.float32))

  def one_anchor(args):
    g_a, sq_a, pos_a, neg_a = args
    d_ap = jnp.sqrt(jnp.maximum(sq_a + sq - 2.0 * g_a, 0.0))  # [N] over p
    # ||x_n - (x_a + x_p)/2||^2 for [p, n].
    d_nc = jnp.sqrt(jnp.maximum(
        sq[None, :] - g_a[None, :] - g_cols
        + 0.25 * (sq_a + sq + 2.0 * g_a)[:, None], 0.0))
    theta = jnp.arctan(d_ap[:, None] / (2.0 * d_nc))
    return (theta > threshold) & pos_a[:, None] & neg_a[None, :]

  args = (g_rows, sq_rows, pos, neg)
  if table:
    return jax.lax.map(one_anchor, args)

  def projected(a):
    t = one_anchor(a)
    return t.any(axis=1), t.any(axis=0)
  return jax.lax.map(projected, args)


# ----------------------------------------------------------------------------
# Triplet margin.
# ----------------------------------------------------------------------------


def _margin_interval(margin, type_of_triplets):
  """``(lo, hi)``: PML keeps the triplets with ``lo < d_an - d_ap <= hi``."""
  if type_of_triplets not in TRIPLET_TYPES:
    raise ValueError(f"type_of_triplets must be one of {TRIPLET_TYPES}; got "
                     f"{type_of_triplets!r}.")
  inf = float("inf")
  return {"all": (-inf, margin), "hard": (-inf, min(margin, 0.0)),
          "semihard": (0.0, margin), "easy": (margin, inf)}[type_of_triplets]


def triplet_margin_triplets(embeddings: Array, labels: Array, *,
                            margin: float = 0.2, type_of_triplets: str = "all",
                            axis_name: Optional[str] = None,
                            ref: Optional[Candidates] = None) -> Array:
  """The exact triplet set of :func:`triplet_margin_miner`, ``[M, N, N]``
  bool (``[a, p, n]``); ``O(M N^2)`` memory."""
  lo, hi = _margin_interval(margin, type_of_triplets)
  dist, pos, neg, _ = _distance_block(embeddings, labels, axis_name, ref)
  t = dist[:, None, :] - dist[:, :, None]  # d_an - d_ap at [a, p, n]
  return (t > lo) & (t <= hi) & pos[:, :, None] & neg[:, None, :]


def triplet_margin_miner(
    embeddings: Array, labels: Array, *, margin: float = 0.2,
    type_of_triplets: str = "all",
    axis_name: Optional[str] = None,
    ref: Optional[Candidates] = None) -> Tuple[Array, Array]:
  r"""Triplets by their margin ``d_an - d_ap`` (PML's TripletMarginMiner).

  With ``t = d_an - d_ap`` (Euclidean distances of normalised embeddings),
  ``type_of_triplets`` keeps

  * ``"all"``: ``t <= margin`` (the triplets with a non-negative hinge
    ``d_ap - d_an + margin``),
  * ``"hard"``: ``t <= margin`` and ``t <= 0`` (the negative is closer than
    the positive),
  * ``"semihard"``: ``0 < t <= margin``,
  * ``"easy"``: ``t > margin`` (the complement of ``"all"``).

  Returns the pairs of the mined triplets (module docstring; for the
  triplet loss with the same margin, ``"all"`` is exact);
  :func:`triplet_margin_triplets` is the triplet set. Found without the
  triplet table by binary searches in each row's sorted distances:
  ``O(M N log N)`` time, ``O(M N)`` memory.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    margin: the margin (PML's ``margin``; any real).
    type_of_triplets: ``"all"``, ``"hard"``, ``"semihard"`` or ``"easy"``.
    axis_name, ref: which block is mined (across devices; against
      references): see :func:`circle_jax.losses.miners.mining_block`.

  Returns:
    ``(pos_mask, neg_mask)``, boolean ``[B, B]`` (``[B_local, B_global]``).

  References:
    Schroff, Kalenichenko, Philbin, "FaceNet: A Unified Embedding for Face
    Recognition and Clustering", CVPR 2015, Sec. 3.2.
    Musgrave, Belongie, Lim, "A Metric Learning Reality Check", ECCV 2020
    (pytorch-metric-learning's TripletMarginMiner).
  """
  lo, hi = _margin_interval(margin, type_of_triplets)
  dist, pos, neg, _ = _distance_block(embeddings, labels, axis_name, ref)
  # A positive is kept iff the first negative beyond d_ap + lo is at most
  # d_ap + hi; a negative iff the first positive from d_an - hi is below
  # d_an - lo.
  neg_sorted, _, num_neg = miners.sort_masked_rows(dist, neg)
  first = miners.row_searchsorted(neg_sorted, dist + lo, "right")
  keep_pos = pos & (first < num_neg[:, None]) & (
      miners.take_rows(neg_sorted, first) <= dist + hi)
  pos_sorted, _, num_pos = miners.sort_masked_rows(dist, pos)
  first = miners.row_searchsorted(pos_sorted, dist - hi, "left")
  keep_neg = neg & (first < num_pos[:, None]) & (
      miners.take_rows(pos_sorted, first) < dist - lo)
  return keep_pos, keep_neg


# ----------------------------------------------------------------------------
# Batch easy / hard.
# ----------------------------------------------------------------------------


def _check_strategies(pos_strategy, neg_strategy):
  for name, value in (("pos_strategy", pos_strategy),
                      ("neg_strategy", neg_strategy)):
    if value not in STRATEGIES:
      raise ValueError(f"{name} must be one of {STRATEGIES}; got {value!r}.")
  if pos_strategy == neg_strategy == "semihard":
    raise ValueError('pos_strategy and neg_strategy cannot both be '
                     '"semihard": each is relative to the other.')
  if "semihard" in (pos_strategy, neg_strategy) and "all" in (
      pos_strategy, neg_strategy):
    raise ValueError('"semihard" cannot be combined with "all": it needs one '
                     'mined pair on the other side.')


def _check_allowed_range(value, name):
  if value is None:
    return None
  if len(value) != 2 or not value[0] <= value[1]:
    raise ValueError(f"{name} must be None or (low, high) with low <= high; "
                     f"got {value!r}.")
  return float(value[0]), float(value[1])


def _pick_per_row(dist, mask, largest, allowed, beyond=None):
  """PML's ``get_x_per_row``: per row the largest (smallest) distance of the
  masked pairs inside ``allowed`` (inclusive) and strictly below (above)
  ``beyond``; ``(value, column, found)``."""
  if beyond is not None:
    mask = mask & ((dist < beyond[:, None]) if largest
                   else (dist > beyond[:, None]))
  if allowed is not None:
    mask = mask & (dist >= allowed[0]) & (dist <= allowed[1])
  fill = -jnp.inf if largest else jnp.inf
  keyed = jnp.where(mask, dist, fill)
  col = jnp.argmax(keyed, axis=1) if largest else jnp.argmin(keyed, axis=1)
  return (jnp.take_along_axis(keyed, col[:, None], axis=1)[:, 0], col,
          mask.any(axis=1))


def batch_easy_hard_miner(
    embeddings: Array, labels: Array, *, pos_strategy: str = "easy",
    neg_strategy: str = "semihard",
    allowed_pos_range: Optional[Sequence[float]] = None,
    allowed_neg_range: Optional[Sequence[float]] = None,
    axis_name: Optional[str] = None,
    ref: Optional[Candidates] = None) -> Tuple[Array, Array]:
  r"""One positive and one negative per anchor, by strategy (PML's
  BatchEasyHardMiner, Xuan et al. 2020).

  Per anchor, among its pairs whose distance lies in the allowed range
  (inclusive; ``None``: any):

  * positive: ``"easy"`` the closest, ``"hard"`` the farthest,
    ``"semihard"`` the farthest closer than the mined negative;
  * negative: ``"easy"`` the farthest, ``"hard"`` the closest,
    ``"semihard"`` the closest farther than the mined positive;
  * ``"all"``: every pair of that side (the range is then not applied).

  Without ``"all"``, an anchor is kept only when both its pairs are found.
  ``"semihard"`` on both sides, or with ``"all"``, is refused (as in PML).
  The result is pairs, so every loss reads it exactly (module docstring).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    pos_strategy, neg_strategy: ``"easy"``, ``"semihard"``, ``"hard"`` or
      ``"all"``.
    allowed_pos_range, allowed_neg_range: ``(low, high)`` distances or
      ``None``.
    axis_name, ref: which block is mined (across devices; against
      references): see :func:`circle_jax.losses.miners.mining_block`.

  Returns:
    ``(pos_mask, neg_mask)``, boolean ``[B, B]`` (``[B_local, B_global]``):
    one-hot rows, or the label masks for ``"all"``.

  References:
    Xuan, Stylianou, Liu, Pless, "Hard Negative Examples are Hard, but
    Useful", ECCV 2020.
    Musgrave, Belongie, Lim, "A Metric Learning Reality Check", ECCV 2020
    (pytorch-metric-learning's BatchEasyHardMiner).
  """
  _check_strategies(pos_strategy, neg_strategy)
  pos_range = _check_allowed_range(allowed_pos_range, "allowed_pos_range")
  neg_range = _check_allowed_range(allowed_neg_range, "allowed_neg_range")
  dist, pos, neg, _ = _distance_block(embeddings, labels, axis_name, ref)
  pos_largest = pos_strategy in ("hard", "semihard")
  neg_largest = neg_strategy == "easy"
  pos_pick = neg_pick = None
  if pos_strategy == "semihard":
    neg_pick = _pick_per_row(dist, neg, neg_largest, neg_range)
    pos_pick = _pick_per_row(dist, pos, pos_largest, pos_range, neg_pick[0])
  elif neg_strategy == "semihard":
    pos_pick = _pick_per_row(dist, pos, pos_largest, pos_range)
    neg_pick = _pick_per_row(dist, neg, neg_largest, neg_range, pos_pick[0])
  else:
    if pos_strategy != "all":
      pos_pick = _pick_per_row(dist, pos, pos_largest, pos_range)
    if neg_strategy != "all":
      neg_pick = _pick_per_row(dist, neg, neg_largest, neg_range)
  both = (pos_pick is not None and neg_pick is not None)
  keep = (pos_pick[2] & neg_pick[2]) if both else None
  cols = jnp.arange(dist.shape[1])[None, :]

  def one_hot(pick):
    found = keep if both else pick[2]
    return (cols == pick[1][:, None]) & found[:, None]

  return (pos if pos_pick is None else one_hot(pos_pick),
          neg if neg_pick is None else one_hot(neg_pick))


# ----------------------------------------------------------------------------
# HDC.
# ----------------------------------------------------------------------------


def _top_fraction(dist, mask, fraction, largest):
  """The ``ceil(fraction * count)`` masked entries of ``dist`` with the
  largest (smallest) values, over the whole block; ties by lower row-major
  index."""
  v = dist.reshape(-1)
  m = mask.reshape(-1)
  key = jnp.where(m, -v if largest else v, jnp.inf)
  order = jnp.argsort(key, stable=True)
  rank = jnp.zeros(v.shape, jnp.int32).at[order].set(
      jnp.arange(v.shape[0], dtype=jnp.int32))
  k = jnp.ceil(jnp.float32(fraction) * jnp.sum(m).astype(jnp.float32))
  return (m & (rank < k)).reshape(mask.shape)


def hdc_miner(embeddings: Array, labels: Array, *,
              filter_percentage: float = 0.5,
              axis_name: Optional[str] = None,
              ref: Optional[Candidates] = None) -> Tuple[Array, Array]:
  r"""The hardest fraction of the batch's pairs (PML's HDCMiner, the mining
  of Yuan et al.'s hard-aware cascade).

  Keeps the ``ceil(filter_percentage * |P|)`` positive pairs of the whole
  (global) batch with the largest distances and the
  ``ceil(filter_percentage * |N|)`` negative pairs with the smallest, over
  all pairs at once (not per anchor). Ties at the cut go to the lower
  row-major index (PML's ``torch.topk`` leaves their order unspecified).
  The count is rounded in float32 (exact for fractions such as 0.25 or
  0.5). With ``axis_name`` each device ranks the whole ``[N, N]`` block.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    filter_percentage: the fraction kept, in ``[0, 1]``.
    axis_name, ref: which block is mined (across devices; against
      references): see :func:`circle_jax.losses.miners.mining_block`.

  Returns:
    ``(pos_mask, neg_mask)``, boolean ``[B, B]`` (``[B_local, B_global]``).

  References:
    Yuan, Yang, Zhang, "Hard-Aware Deeply Cascaded Embedding", ICCV 2017.
    Musgrave, Belongie, Lim, "A Metric Learning Reality Check", ECCV 2020
    (pytorch-metric-learning's HDCMiner).
  """
  ranges.check_range(filter_percentage, "filter_percentage",
                     ranges.UNIT_INTERVAL)

  def mine(dist, pos, neg):
    return (_top_fraction(dist, pos, filter_percentage, True),
            _top_fraction(dist, neg, filter_percentage, False))
  return _global_rows(mine, embeddings, labels, axis_name, ref)


# ----------------------------------------------------------------------------
# Uniform histogram.
# ----------------------------------------------------------------------------


def histogram_bins(dist: Array, mask: Array, num_bins: int) -> Array:
  """PML's bin of each masked entry: ``num_bins`` equal bins from the
  smallest to the largest masked value, each ``[low, high)`` but the last
  ``[low, high]``; ``num_bins`` for unmasked entries (int32, ``dist``'s
  shape)."""
  lo = jnp.min(jnp.where(mask, dist, jnp.inf))
  hi = jnp.max(jnp.where(mask, dist, -jnp.inf))
  edges = jnp.linspace(lo, hi, num_bins + 1)
  b = jnp.searchsorted(edges[1:-1], dist.reshape(-1), side="right")
  return jnp.where(mask, b.reshape(dist.shape), num_bins).astype(jnp.int32)


def _histogram_draws(dist, mask, key, num_bins, per_bin):
  """``per_bin`` uniform draws with replacement in each non-empty bin; the
  number of draws of each entry (float32, ``dist``'s shape)."""
  b = histogram_bins(dist, mask, num_bins).reshape(-1)
  order = jnp.argsort(b, stable=True)  # the entries grouped by bin
  counts = jnp.bincount(b, length=num_bins + 1)[:num_bins]
  starts = jnp.cumsum(counts) - counts
  u = jax.random.uniform(key, (num_bins, per_bin))
  offset = jnp.minimum(jnp.floor(u * counts[:, None]).astype(jnp.int32),
                       counts[:, None] - 1)
  picked = order[jnp.clip(starts[:, None] + offset, 0, b.shape[0] - 1)]
  drawn = jnp.broadcast_to(counts[:, None] > 0, picked.shape)
  w = jnp.zeros(b.shape, jnp.float32).at[picked.reshape(-1)].add(
      drawn.reshape(-1).astype(jnp.float32))
  return w.reshape(dist.shape)


def uniform_histogram_miner(
    embeddings: Array, labels: Array, key: Array, *, num_bins: int = 100,
    pos_per_bin: int = 10, neg_per_bin: int = 10,
    axis_name: Optional[str] = None,
    ref: Optional[Candidates] = None) -> Array:
  r"""Pairs drawn uniformly over the range of distances (PML's
  UniformHistogramMiner).

  The positive pairs of the (global) batch are put in ``num_bins`` equal
  bins from their smallest to their largest distance; each non-empty bin
  draws ``pos_per_bin`` of its pairs uniformly with replacement. Likewise
  the negative pairs with ``neg_per_bin``. The distances the loss sees are
  then spread evenly over their range, whatever their density.

  Randomness: JAX's counter-based PRNG from ``key`` instead of PML's
  ``torch.multinomial`` on the global torch generator. Draw ``j`` of bin
  ``b`` takes the member ``floor(u_{bj} c_b)`` (in row-major order) of the
  bin's ``c_b`` pairs: the same distribution as PML's, different numbers.
  Everything else (bins, membership, draws per bin) is deterministic and
  equals PML's. With ``axis_name`` every device draws on the whole global
  block with the same key, so the result does not depend on the split.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    key: a PRNG key.
    num_bins: the number of bins (PML's ``num_bins``).
    pos_per_bin, neg_per_bin: draws per non-empty bin.
    axis_name, ref: which block is mined (across devices; against
      references): see :func:`circle_jax.losses.miners.mining_block`.

  Returns:
    ``pair_weights``: float32 ``[B, B]`` (``[B_local, B_global]``), the
    number of draws of each pair (PML repeats the indices); pass it as
    ``pair_weights=`` to :func:`~circle_jax.losses.margin_loss`, or
    ``pos_mask=w > 0, neg_mask=w > 0`` to a mask-taking loss.

  References:
    Musgrave, Belongie, Lim, "A Metric Learning Reality Check", ECCV 2020
    (pytorch-metric-learning's UniformHistogramMiner).
  """
  for name, value in (("num_bins", num_bins), ("pos_per_bin", pos_per_bin),
                      ("neg_per_bin", neg_per_bin)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int; got {value!r}.")
  k_pos, k_neg = jax.random.split(key)

  def mine(dist, pos, neg):
    return (_histogram_draws(dist, pos, k_pos, num_bins, pos_per_bin)
            + _histogram_draws(dist, neg, k_neg, num_bins, neg_per_bin))
  return _global_rows(mine, embeddings, labels, axis_name, ref)
