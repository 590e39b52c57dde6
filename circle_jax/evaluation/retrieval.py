"""Exact retrieval metrics on device: Recall@K, P@1, R-Precision and MAP@R.

For every query ``q`` the gallery is ranked by cosine similarity, highest
first; equal similarities are ranked by gallery index (lower index first), so
every ranking, and therefore every metric, is deterministic. With
``gallery=None`` the queries are their own gallery and each query's own entry
(same index) is left out of its ranking.

Let ``R_q`` be the number of gallery items with the label of ``q`` (the query
itself excluded) and ``rel_q(i) = 1`` when the ``i``-th ranked item (1-based)
has the label of ``q``. Over the queries with ``R_q > 0``:

* ``recall@K`` (the definition of the deep-metric-learning papers, e.g. Song
  et al. 2016): the fraction of queries with at least one ``rel_q(i) = 1`` for
  ``i <= K``. It is 1 for every such query once ``K`` reaches the gallery size.
* ``precision@1``: the fraction with ``rel_q(1) = 1`` (equal to ``recall@1``).
* ``r_precision`` (Musgrave et al. 2020): ``mean_q (1/R_q) sum_{i<=R_q}
  rel_q(i)``.
* ``map@r`` (Musgrave et al. 2020): ``mean_q (1/R_q) sum_{i<=R_q} rel_q(i)
  P_q(i)`` with ``P_q(i) = (1/i) sum_{j<=i} rel_q(j)``.

Queries with ``R_q = 0`` (their class has no gallery item) are left out of all
means and counted in ``num_queries_without_match``.

How it is computed (exactly, no approximate search):

* The queries are processed in chunks of ``chunk_size`` rows. The gallery is
  L2-normalised, padded and split into tiles of ``T <= 4096`` rows, ``T``
  a function of the gallery size only; the tiles are sharded over the
  devices. Each device computes the ``[chunk, T]`` similarity blocks of its
  tiles with a float32 ``HIGHEST``-precision matmul, so a device holds
  ``O(chunk_size * gallery_size / num_devices)`` similarities, never the
  ``N x N`` matrix.
* The similarity tiles are used raw: the query's own entry (self-retrieval)
  and the zero padding rows are not masked out of ``[chunk, T]``, but
  accounted for afterwards, from their similarities (gathered) and their
  known positions. The tile matmuls run one after the other (XLA:CPU would
  otherwise run them concurrently and slower).
* Recall@K for every ``K`` comes from the exact rank of each query's first
  relevant item: the best positive similarity ``s*`` (with the lowest gallery
  index among equal ones) is reduced over tiles and devices, then the items
  ranked before it are counted (``s > s*``, or ``s == s*`` and a lower index).
  This costs one counting pass over the similarities whatever ``K`` is (SOP's
  ``K = 1000`` included), instead of a top-1000 selection. The positives'
  similarities are gathered from the similarity tiles at their gallery
  indices (listed on the host from the labels), so they are the very numbers
  the ranking uses, without a masked pass over the ``[chunk, T]`` block.
* R-Precision and MAP@R need the top ``k = max_q R_q`` items. The same pass
  over each tile that counts also takes the maxima of its blocks of 32
  consecutive items (one variadic reduction). The ``k`` best blocks by
  maximum hold the top ``k`` items (each block ahead of a top item's block
  holds an item ahead of it), plus one block for the query's own entry and
  one for a part-padding block. So ``lax.top_k`` runs on the ``[chunk,
  blocks]`` maxima and then on the ``k + 2`` chosen blocks' items, instead of
  on whole tiles: XLA's TopK is far slower than a reduction. The per-device
  lists are merged with ``top_k`` again. Candidates are kept in gallery-index
  order and ``top_k`` puts the lower index first among equal values, so
  every selection keeps the index tie-break exactly.
* Every matmul has the same ``[chunk, T]`` shape whatever the number of
  devices, so one device and eight give bitwise identical similarities and
  identical metrics (XLA's matmul results can depend on the operand shapes).

The query vectors are not normalised: dividing all of a query's similarities
by its (positive) norm does not change its ranking, and skipping it avoids
creating ties by rounding.

References:
  Musgrave, Belongie, Lim. "A Metric Learning Reality Check". ECCV 2020.
  https://arxiv.org/abs/2003.08505
  Oh Song, Xiang, Jegelka, Savarese. "Deep Metric Learning via Lifted
  Structured Feature Embedding". CVPR 2016. https://arxiv.org/abs/1511.06452
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Dict, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from circle_jax.evaluation import checks
from circle_jax.evaluation.ks import DEFAULT_KS, default_ks

Array = jax.Array

__all__ = [
    "DEFAULT_KS",
    "default_ks",
    "retrieval_metrics",
]

# Gallery tile rows: at most this many; smaller galleries use one tile of their
# own (rounded-up) size. It must not depend on the number of devices.
_MAX_TILE = 4096
_TILE_ALIGN = 8
# Gallery items per block of the top-k pre-selection (`_block_candidates`).
# Tiles are a multiple of it.
_BLOCK = 32
# Query chunks are padded to a multiple of this (never a 1-row matrix-vector
# product, whose rounding differs from the matrix-matrix one).
_CHUNK_ALIGN = 8
_AXIS = "gallery"
# The mesh axis that the gallery's tiles are sharded over (the device
# programs of :mod:`circle_jax.evaluation.knn` use it too).
GALLERY_AXIS = _AXIS
_NO_INDEX = np.iinfo(np.int32).max


def _tile_rows(num_gallery: int) -> int:
  """Rows per gallery tile: a function of the gallery size only.

  The fewest tiles of at most ``_MAX_TILE`` rows, evened out so that padding
  stays small (e.g. 12,612 rows -> 4 tiles of 3,168, not 4 of 4,096).
  """
  num_tiles = -(-num_gallery // _MAX_TILE)
  return checks.round_up(-(-num_gallery // num_tiles),
                   math.lcm(_TILE_ALIGN, _BLOCK))


# ----------------------------------------------------------------------------
# The per-chunk device program.
# ----------------------------------------------------------------------------


def _topk_padded(values, k):
  """``top_k`` of the last axis, padding with ``-inf`` when it is short.

  Returns the values and their indices (padding entries get index 0 and
  value ``-inf``). Among equal values the lower index comes first.
  """
  n = values.shape[-1]
  if n < k:
    pad = [(0, 0)] * (values.ndim - 1) + [(0, k - n)]
    values = jnp.pad(values, pad, constant_values=-jnp.inf)
  top, idx = jax.lax.top_k(values, k)
  return top, jnp.where(idx < n, idx, 0)


def _merge_top(values, flags, k):
  """The top ``k`` of concatenated (gallery-ordered) lists, with their flags."""
  top, idx = _topk_padded(values, k)
  flags = jnp.take_along_axis(flags, idx, axis=-1) & (top > -jnp.inf)
  return top, flags


def _after(x, prev):
  """``x`` unchanged, but computed only once ``prev`` (an array) exists.

  Multiplying by exactly 1 orders two otherwise independent computations:
  XLA:CPU would run the tile matmuls of a chunk concurrently, each over the
  whole thread pool, which is slower. The factor goes through a comparison,
  so it is 1 even if ``prev`` overflowed to inf or NaN.
  """
  return x * (1.0 + 0.0 * (prev.reshape(-1)[0] > 0.0).astype(x.dtype))


def _block_max_and_count(s, gidx, b, bi, block):
  """One pass over a ``[C, T]`` tile: block maxima and items ahead of ``b``.

  Returns ``[C, T / block]`` float32 maxima of the blocks of ``block``
  consecutive items and ``[C]`` int32 counts of the items ranked before
  ``(b, bi)`` (higher similarity, or equal and a lower gallery index ``gidx
  [T]``). One variadic reduction computes both, so the tile is read once.
  """
  c, tile = s.shape
  shape = (c, tile // block, block)
  ahead = (s > b[:, None]) | ((s == b[:, None]) & (gidx[None, :] < bi[:, None]))
  bmax, count = jax.lax.reduce(
      (s.reshape(shape), ahead.astype(jnp.int32).reshape(shape)),
      (jnp.float32(-jnp.inf), jnp.int32(0)),
      lambda x, y: (jnp.maximum(x[0], y[0]), x[1] + y[1]),
      (2,))
  return bmax, jnp.sum(count, axis=1)


def _block_candidates(s_tiles, bmax_tiles, first_index, q_self, num_gallery,
                      k, extra, block):
  """The blocks that must hold the top ``k`` of a query's local similarities.

  ``s_tiles`` are the ``[C, T]`` raw similarity tiles of this device, in
  gallery order, starting at gallery index ``first_index``, and
  ``bmax_tiles`` their ``[C, T / block]`` block maxima (blocks of ``block``
  consecutive items). Order the items by (similarity descending,
  gallery index ascending), and the blocks by their best item. A block
  holding one of the top ``k`` items has fewer than ``k`` blocks ahead of it:
  each of those holds an item ahead of that top item, and fewer than ``k``
  items are. So the ``k`` best blocks by maximum (``top_k`` puts the lower
  block index first among equal maxima, which is the same order) hold the
  top ``k`` items. The raw tiles still contain the query's own entry and the
  padding, each of which can lift at most one block, hence ``extra`` more
  blocks.

  Returns ``(cand, cand_idx)``: ``[C, M]`` similarities with the excluded
  entries (the query's own, padding) set to ``-inf`` and ``-0.0`` made
  ``+0.0`` (so that ``top_k``, a total order, agrees with ``==`` on ties),
  and their ``[C, M]`` (or broadcastable) int32 gallery indices, in gallery
  order. When the blocks would cover the whole local gallery, every item is
  a candidate.
  """
  c, tile = s_tiles[0].shape
  nb = tile // block
  num_blocks = nb * len(s_tiles)
  kb = k + extra
  if kb >= num_blocks:
    cand = jnp.concatenate(s_tiles, axis=1)
    cand_idx = first_index + jnp.arange(cand.shape[1], dtype=jnp.int32)[None]
  else:
    block_start = first_index + block * jnp.arange(num_blocks,
                                                   dtype=jnp.int32)
    bmax = jnp.concatenate(bmax_tiles, axis=1)
    bmax = jnp.where(block_start[None, :] < num_gallery,
                     jnp.where(bmax == 0.0, 0.0, bmax), -jnp.inf)
    _, best = jax.lax.top_k(bmax, kb)
    best = jnp.sort(best, axis=1)                  # [C, kb], gallery order
    cand = jnp.zeros((c, kb, block), s_tiles[0].dtype)
    for t, s in enumerate(s_tiles):
      b = best - t * nb
      here = (b >= 0) & (b < nb)
      got = jnp.take_along_axis(s.reshape(c, nb, block),
                                jnp.where(here, b, 0)[:, :, None], axis=1)
      cand = jnp.where(here[:, :, None], got, cand)
    cand = cand.reshape(c, kb * block)
    cand_idx = (block_start[best][:, :, None]
                + jnp.arange(block, dtype=jnp.int32)).reshape(c, kb * block)
  valid = (cand_idx < num_gallery) & (cand_idx != q_self[:, None])
  cand = jnp.where(valid, jnp.where(cand == 0.0, 0.0, cand), -jnp.inf)
  return cand, cand_idx


def local_top(s_tiles, bmax_tiles, first, q_self, num_gallery, k, extra,
               block):
  """This device's exact top ``k``: ``([C, k] similarities, [C, k] int32
  gallery indices)``, best first, the lower index first among equal ones
  (``-inf`` where the local gallery has fewer than ``k`` items); through the
  block pre-selection of :func:`_block_candidates`."""
  cand, cand_idx = _block_candidates(s_tiles, bmax_tiles, first, q_self,
                                     num_gallery, k, extra, block)
  top, at = _topk_padded(cand, k)
  idx = jnp.take_along_axis(jnp.broadcast_to(cand_idx, cand.shape), at,
                            axis=1)
  return top, idx


def merge_device_tops(top, idx, k):
  """Each device's ``[C, k]`` top list (``top`` with ``idx``) merged into the
  global top ``k``, inside the gallery's ``shard_map``; device order is
  gallery order, so the lower index stays first among equal values."""
  top = jax.lax.all_gather(top, _AXIS, axis=1, tiled=True)     # [C, n*k]
  idx = jax.lax.all_gather(idx, _AXIS, axis=1, tiled=True)
  top, at = _topk_padded(top, k)
  return top, jnp.take_along_axis(idx, at, axis=1)


def scan_top(q, g, tile, q_self, num_gallery, k, extra, block):
  """This device's exact top ``k`` of ``q [C, D]`` against its gallery shard
  ``g [local_tiles, T, D]``, tile by tile in a ``lax.scan``.

  Each step computes one raw ``[C, T]`` similarity tile (the matmul of
  :func:`similarity_tiles`), takes its top ``k`` by :func:`local_top` and
  merges it into the running top ``k``. The running list holds lower gallery
  indices than the tile's and comes first in the merge, so equal
  similarities keep the lower index first: the result equals
  :func:`local_top` over all the tiles at once. The program (and its compile
  time) does not grow with the number of tiles, and a device holds one
  ``[C, T]`` tile at a time.

  Returns ``([C, k] float32 similarities, [C, k] int32 gallery indices)``,
  best first, ``-inf`` past the local gallery's items.
  """
  local_tiles, c = g.shape[0], q.shape[0]
  first = jax.lax.axis_index(_AXIS) * (local_tiles * tile)

  def step(carry, g_t_and_t):
    g_t, t = g_t_and_t
    s = jnp.matmul(q, g_t.T, precision=jax.lax.Precision.HIGHEST)
    bmax = jnp.max(s.reshape(c, tile // block, block), axis=2)
    top, idx = local_top([s], [bmax], first + t * tile, q_self, num_gallery,
                         k, extra, block)
    top, at = _topk_padded(jnp.concatenate([carry[0], top], axis=1), k)
    idx = jnp.take_along_axis(jnp.concatenate([carry[1], idx], axis=1), at,
                              axis=1)
    return (top, idx), None

  init = (jnp.full((c, k), -jnp.inf, jnp.float32),
          jnp.full((c, k), -1, jnp.int32))
  (top, idx), _ = jax.lax.scan(
      step, init, (g, jnp.arange(local_tiles, dtype=jnp.int32)))
  return top, idx


def similarity_tiles(q, g, tile):
  """This device's raw ``[C, T]`` similarity tiles of ``q`` and its tiles.

  ``g`` is the local ``[local_tiles, T, D]`` shard of the gallery. Returns the
  tiles (in gallery order), their ``[T]`` int32 gallery indices and the
  gallery index of this device's first row. The similarity tiles are raw (no
  masking pass over ``[C, T]``): the query's own entry and the padding are
  accounted for by the caller. The tiles are unrolled (their number is
  static; the metrics need them all at once, and a ``lax.scan`` would stack
  them into one zero-initialised ``[t, C, T]`` buffer with a
  dynamic-update-slice per step). A top-k search alone goes tile by tile
  instead (:func:`scan_top`).
  """
  local_tiles = g.shape[0]
  first = jax.lax.axis_index(_AXIS) * (local_tiles * tile)
  col = jnp.arange(tile, dtype=jnp.int32)
  s_tiles, gidx = [], []
  for t in range(local_tiles):
    # Each tile matmul waits for the previous one (see `_after`).
    g_t = _after(g[t], s_tiles[-1]) if s_tiles else g[t]
    s_tiles.append(
        jnp.matmul(q, g_t.T, precision=jax.lax.Precision.HIGHEST))
    gidx.append(first + t * tile + col)
  return s_tiles, gidx, first


@functools.lru_cache(maxsize=32)
def _chunk_fn(devices: Tuple[jax.Device, ...], tile: int, block: int,
              num_gallery: int, k: int, self_retrieval: bool):
  """Jitted ``(q, q_lab, q_self, q_pos, g, g_lab) -> (rank_first, rel)``.

  Shapes: ``q [C, D]``, ``q_lab [C]``, ``q_self [C]`` (gallery index to skip,
  or -1), ``q_pos [C, P]`` (the gallery indices of each query's relevant
  items, -1 padded), ``g [num_tiles, tile, D]`` (sharded over tiles; rows
  past ``num_gallery`` are zero), ``g_lab [num_tiles, tile]``. Outputs:
  ``rank_first [C]`` int32, the 1-based rank of the first relevant item (0
  where there is none) and ``rel [C, k]`` bool, the relevance of the top
  ``k`` items. ``block`` (a divisor of ``tile``) is the block size of the
  top-k pre-selection (see ``_block_candidates``).
  """
  mesh = Mesh(np.array(devices), (_AXIS,))
  # Blocks that the query's own entry and a part-padding block can lift.
  extra = int(self_retrieval) + int(num_gallery % block != 0)

  def body(q, q_lab, q_self, q_pos, g, g_lab):
    s_tiles, gidx, first = similarity_tiles(q, g, tile)
    # The relevant items' similarities (and the query's own) are gathered
    # from the tiles, the same numbers the ranking uses.
    pos_s = jnp.full(q_pos.shape, -jnp.inf, jnp.float32)
    self_s = jnp.full(q_self.shape, -jnp.inf, jnp.float32)
    for s, gidx_t in zip(s_tiles, gidx):
      start = gidx_t[0]
      here = (q_pos >= start) & (q_pos < start + tile)
      got = jnp.take_along_axis(s, jnp.where(here, q_pos - start, 0), axis=1)
      pos_s = jnp.where(here, got, pos_s)                        # [C, P]
      if self_retrieval:
        here = (q_self >= start) & (q_self < start + tile)
        got = jnp.take_along_axis(
            s, jnp.where(here, q_self - start, 0)[:, None], axis=1)[:, 0]
        self_s = jnp.where(here, got, self_s)                    # [C]

    # Best relevant item over devices; lowest index among ties.
    b = jax.lax.pmax(jnp.max(pos_s, axis=1), _AXIS)              # [C]
    bi = jnp.min(jnp.where(pos_s == b[:, None], q_pos, _NO_INDEX), axis=1)
    bi = jax.lax.pmin(bi, _AXIS)
    # Items ranked before it: higher similarity, or equal and lower index.
    # One pass over each tile gives its block maxima (for the top-k
    # pre-selection) and its items ranked before it.
    bmax, ahead = zip(*(_block_max_and_count(s, gidx_t, b, bi, block)
                        for s, gidx_t in zip(s_tiles, gidx)))
    ahead = sum(ahead)
    # Take back what the raw tiles counted for the query's own entry and
    # for the padding rows (zero vectors: similarity exactly 0, and an index
    # above every real item's).
    if self_retrieval:
      ahead -= ((self_s > b) | ((self_s == b) & (q_self < bi))).astype(
          jnp.int32)
    num_pad = sum(jnp.sum(gidx_t >= num_gallery, dtype=jnp.int32)
                  for gidx_t in gidx)
    ahead -= num_pad * (b < 0.0).astype(jnp.int32)
    rank_first = jnp.where(b > -jnp.inf, jax.lax.psum(ahead, _AXIS) + 1, 0)

    # This device's top k (exact, via the block pre-selection), then the
    # per-device lists merged (device order = gallery order).
    top, idx = local_top(s_tiles, bmax, first, q_self, num_gallery, k,
                          extra, block)
    idx = idx - first
    rel = (jnp.take(g_lab.reshape(-1), idx) == q_lab[:, None]) & (
        top > -jnp.inf)
    top = jax.lax.all_gather(top, _AXIS, axis=1, tiled=True)     # [C, n*k]
    rel = jax.lax.all_gather(rel, _AXIS, axis=1, tiled=True)
    _, rel = _merge_top(top, rel, k)
    return rank_first, rel

  fn = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(), P(), P(), P(), P(_AXIS), P(_AXIS)),
      out_specs=(P(), P()),
      check_vma=False,
  )
  jitted = jax.jit(fn)
  return (lambda q, q_lab, q_self, q_pos, *, g_dev, lab_dev:
          jitted(q, q_lab, q_self, q_pos, g_dev, lab_dev)), mesh


# ----------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------


def retrieval_metrics(
    query,
    query_labels,
    gallery=None,
    gallery_labels=None,
    *,
    ks: Sequence[int] = (1, 2, 4, 8),
    chunk_size: int = 1024,
    mesh: Optional[Mesh] = None,
    devices: Optional[Sequence[jax.Device]] = None,
) -> Dict[str, Union[float, int]]:
  """Exact Recall@K, P@1, R-Precision and MAP@R by cosine similarity.

  See the module docstring for the definitions, the tie-breaking rule and how
  the computation is laid out over devices.

  Args:
    query: ``[Q, D]`` float query embeddings (numpy or JAX; any float dtype,
      computed in float32). They need not be normalised.
    query_labels: ``[Q]`` integer class ids.
    gallery: ``[G, D]`` float gallery embeddings, or ``None`` to use the
      queries as their own gallery, leaving out each query's own entry.
    gallery_labels: ``[G]`` integer class ids; given exactly when ``gallery``
      is.
    ks: the cut-offs ``K`` of Recall@K (any positive ints; ``K`` may exceed
      the gallery size). See :func:`default_ks`.
    chunk_size: number of query rows per device step. Each device holds about
      ``4 * chunk_size * G / num_devices`` bytes of similarities.
    mesh: a ``jax.sharding.Mesh`` whose devices (all of its axes, flattened)
      share the gallery. Mutually exclusive with ``devices``.
    devices: the devices that share the gallery. Default (neither given):
      ``jax.local_devices()``, all local devices. The results do not depend on
      the number of devices.

  Returns:
    A dict with Python floats ``recall@K`` (one per ``K``), ``precision@1``,
    ``r_precision``, ``map@r``, each a mean over the queries with at least one
    relevant gallery item, and Python ints ``num_queries`` (``Q``) and
    ``num_queries_without_match`` (queries left out of the means). When no
    query has a match, every metric is 0.0.

  Raises:
    ValueError / TypeError: on inputs of the wrong rank, dtype or length, on
      NaN/inf embeddings, bad ``ks`` or ``chunk_size``.
  """
  ks = checks.check_ks(ks)
  chunk_size = checks.check_positive_int(chunk_size, "chunk_size")
  q = checks.check_embeddings(query, "query")
  q_lab = checks.check_labels(query_labels, q.shape[0], "query_labels", "query")
  if (gallery is None) != (gallery_labels is None):
    raise ValueError(
        "Pass both `gallery` and `gallery_labels`, or neither (then the "
        "queries are their own gallery)."
    )
  self_retrieval = gallery is None
  if self_retrieval:
    g, g_lab = q, q_lab
  else:
    g = checks.check_embeddings(gallery, "gallery")
    g_lab = checks.check_labels(gallery_labels, g.shape[0], "gallery_labels",
                          "gallery")
    if g.shape[1] != q.shape[1]:
      raise ValueError(
          f"`gallery` has dimension {g.shape[1]} but `query` has "
          f"{q.shape[1]}; they must match."
      )
  devs = checks.resolve_devices(mesh, devices)

  rank_first, rel, r = _rank_queries(q, q_lab, g, g_lab, self_retrieval,
                                     chunk_size, devs)
  return _metrics_from_ranks(rank_first, rel, r, ks)


def _class_ids(q_lab, g_lab, self_retrieval):
  """Dense int32 class ids of queries and gallery, and ``R`` of each query."""
  num_q = q_lab.shape[0]
  classes, inverse = np.unique(np.concatenate([q_lab, g_lab]),
                               return_inverse=True)
  inverse = inverse.astype(np.int32).reshape(-1)
  q_ids, g_ids = inverse[:num_q], inverse[num_q:]
  counts = np.bincount(g_ids, minlength=classes.size)
  r = counts[q_ids] - (1 if self_retrieval else 0)
  return q_ids, g_ids, r


def _relevant_indices(q_ids, g_ids, self_retrieval):
  """``[Q, P]`` int32: each query's relevant gallery indices, -1 padded.

  ``P`` is the largest gallery class size (at least 1). In self-retrieval the
  query's own index is left out (set to -1).
  """
  order = np.argsort(g_ids, kind="stable")
  counts = np.bincount(g_ids, minlength=int(max(q_ids.max(), g_ids.max())) + 1)
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
  cnt, st = counts[q_ids], starts[q_ids]
  width = max(1, int(cnt.max()))
  j = np.arange(width)[None, :]
  idx = order[np.minimum(st[:, None] + j, order.size - 1)]
  pos = np.where(j < cnt[:, None], idx, -1).astype(np.int32)
  if self_retrieval:
    pos[pos == np.arange(q_ids.shape[0])[:, None]] = -1
  return pos


def gallery_tiles(g, n_dev):
  """``([num_tiles, tile, D] float32, tile)``: the gallery L2-normalised and
  zero-padded to tiles of :func:`_tile_rows` rows, an equal number per device.

  Normalised on the host (cheap next to the search, and no program to
  compile); zero vectors stay zero.
  """
  num_g, dim = g.shape
  tile = _tile_rows(num_g)
  num_tiles = -(-num_g // (tile * n_dev)) * n_dev
  g_pad = np.zeros((num_tiles * tile, dim), np.float32)
  l2_normalize_rows(g, out=g_pad[:num_g])
  return g_pad.reshape(num_tiles, tile, dim), tile


def l2_normalize_rows(x, out=None) -> np.ndarray:
  """``x / ||x||`` row by row on the host, float32 (zero rows stay zero):
  the normalisation of the gallery in every ranking of this module."""
  x = np.asarray(x, np.float32)
  sq = np.einsum("ij,ij->i", x, x)
  return np.multiply(x, (1.0 / np.sqrt(np.maximum(sq, 1e-24)))[:, None],
                     out=out)


def run_chunks(fn, columns, chunk_size, sharding, on_chunk=None):
  """``fn`` over the queries in chunks of a fixed row count; its outputs
  concatenated over the chunks, cut to the number of queries.

  Args:
    fn: ``fn(*chunk_columns) -> tuple of [C, ...] arrays``, jitted.
    columns: ``[(host array [Q, ...], pad value)]``: the per-query inputs,
      each chunk padded with its pad value to ``C`` rows (one compilation;
      ``C`` a multiple of 8, never a 1-row matrix-vector product).
    chunk_size: ``C`` before rounding (at most ``Q`` rounded up).
    sharding: where the chunks are placed (replicated).
    on_chunk: called with the number of queries done after each chunk has
      been computed (for a progress bar); ``None`` dispatches all chunks
      asynchronously and waits once.

  Returns:
    A tuple of host numpy arrays ``[Q, ...]``.
  """
  num_q = columns[0][0].shape[0]
  c = checks.round_up(min(chunk_size, num_q), _CHUNK_ALIGN)
  outputs = []
  for lo in range(0, num_q, c):
    hi = min(lo + c, num_q)
    args = []
    for col, pad in columns:
      a = np.full((c,) + col.shape[1:], pad, col.dtype)
      a[: hi - lo] = col[lo:hi]
      args.append(jax.device_put(a, sharding))
    outputs.append(fn(*args))  # dispatched asynchronously
    if on_chunk is not None:
      outputs[-1] = jax.device_get(outputs[-1])
      on_chunk(hi)
  outputs = jax.device_get(outputs)
  return tuple(np.concatenate([o[i] for o in outputs])[:num_q]
               for i in range(len(outputs[0])))


def _rank_queries(q, q_lab, g, g_lab, self_retrieval, chunk_size, devs):
  """Per-query ranking facts, computed on device.

  Returns:
    ``(rank_first, rel, r)``: ``rank_first [Q]`` int64, the 1-based rank of
    each query's first relevant item (0 where ``r == 0``); ``rel
    [Q, k]`` bool, the relevance of the top ``k = max(1, max(r))`` items;
    ``r [Q]`` int64, the number of relevant gallery items of each query.
  """
  num_q = q.shape[0]
  num_g = g.shape[0]
  q_ids, g_ids, r = _class_ids(q_lab, g_lab, self_retrieval)
  q_pos = _relevant_indices(q_ids, g_ids, self_retrieval)
  # Top-k length: enough for every query's R (Recall@K does not need it).
  k = max(1, int(r.max()))

  g_tiles, tile = gallery_tiles(g, len(devs))
  lab_pad = np.full((g_tiles.shape[0] * tile,), -1, np.int32)
  lab_pad[:num_g] = g_ids

  fn, mesh = _chunk_fn(devs, tile, _BLOCK, num_g, k, self_retrieval)
  sharded = NamedSharding(mesh, P(_AXIS))
  replicated = NamedSharding(mesh, P())
  g_dev = jax.device_put(g_tiles, sharded)
  del g_tiles
  lab_dev = jax.device_put(lab_pad.reshape(-1, tile), sharded)

  own = (np.arange(num_q, dtype=np.int32) if self_retrieval
         else np.full((num_q,), -1, np.int32))
  rank_first, rel = run_chunks(
      functools.partial(fn, g_dev=g_dev, lab_dev=lab_dev),
      [(q, 0.0), (q_ids, -2), (own, -1), (q_pos, -1)], chunk_size,
      replicated)
  return rank_first.astype(np.int64), rel, r.astype(np.int64)


def _metrics_from_ranks(rank_first, rel, r, ks) -> Dict[str, Union[float, int]]:
  """The metric means (float64) over the queries with ``r > 0``."""
  num_q = r.shape[0]
  has_match = r > 0
  num_valid = int(has_match.sum())
  result: Dict[str, Union[float, int]] = {}
  if num_valid == 0:
    logging.warning(
        "retrieval_metrics: none of the %d queries has a relevant gallery "
        "item; all metrics are 0.", num_q)
    for k_ in ks:
      result[f"recall@{k_}"] = 0.0
    result.update({"precision@1": 0.0, "r_precision": 0.0, "map@r": 0.0})
  else:
    rank_first = rank_first[has_match]
    rel = rel[has_match].astype(np.float64)
    rv = r[has_match].astype(np.float64)
    k = rel.shape[1]
    positions = np.arange(1, k + 1, dtype=np.float64)[None, :]
    rel_r = rel * (positions <= rv[:, None])
    precision_at_i = np.cumsum(rel_r, axis=1) / positions
    for k_ in ks:
      result[f"recall@{k_}"] = float(np.mean(rank_first <= k_))
    result["precision@1"] = float(np.mean(rel[:, 0]))
    result["r_precision"] = float(np.mean(rel_r.sum(axis=1) / rv))
    result["map@r"] = float(
        np.mean((rel_r * precision_at_i).sum(axis=1) / rv))
  result["num_queries"] = int(num_q)
  result["num_queries_without_match"] = int(num_q - num_valid)
  return result
