"""The exact ranking of :mod:`circle_jax.evaluation.retrieval` on device:
gallery tiles sharded over the devices, each query's rank of its first
relevant item, the top ``k`` and its relevance (:func:`rank_queries`), and
the tiled top-k search that :mod:`circle_jax.evaluation.knn` reuses.

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
* MRR is ``1 / rank`` of that first relevant item. mAP needs the rank of
  every relevant item: the same count, once per item of the largest class
  (a ``lax.map`` over the columns of the relevant indices), so it is
  computed only when asked for.
* Every matmul has the same ``[chunk, T]`` shape whatever the number of
  devices, so one device and eight give bitwise identical similarities and
  identical metrics (XLA's matmul results can depend on the operand shapes).

The query vectors are not normalised: dividing all of a query's similarities
by its (positive) norm does not change its ranking, and skipping it avoids
creating ties by rounding.
"""

from __future__ import annotations

import functools
import math
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from circle_jax.evaluation import checks
from circle_jax.evaluation import relevance

# Gallery tile rows: at most this many; smaller galleries use one tile of their
# own (rounded-up) size. It must not depend on the number of devices.
_MAX_TILE = 4096
_TILE_ALIGN = 8
# Gallery items per block of the top-k pre-selection (`_block_candidates`).
# Tiles are a multiple of it.
_BLOCK = 32
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


def _count_ahead(s_tiles, gidx, b, bi):
  """``[C]`` int32: the items of the raw tiles ranked before ``(b, bi)``
  (higher similarity, or equal and a lower gallery index), without the
  block maxima of :func:`_block_max_and_count`."""
  return sum(jnp.sum((s > b[:, None]) | ((s == b[:, None])
                                         & (g[None, :] < bi[:, None])),
                     axis=1, dtype=jnp.int32)
             for s, g in zip(s_tiles, gidx))


def _uncount_excluded(ahead, b, bi, self_s, q_self, num_pad):
  """``ahead`` (local counts of the items before ``(b, bi)``, any shape
  ``b`` has) less what the raw tiles counted for the query's own entry
  (similarity ``self_s``, index ``q_self``; ``None`` outside self-retrieval)
  and for the ``num_pad`` padding rows (zero vectors: similarity exactly 0,
  and an index above every real item's)."""
  if self_s is not None:
    ahead -= ((self_s > b) | ((self_s == b) & (q_self < bi))).astype(
        jnp.int32)
  return ahead - num_pad * (b < 0.0).astype(jnp.int32)


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
              num_gallery: int, k: int, self_retrieval: bool,
              by_label: bool = True, all_ranks: bool = False):
  """Jitted ``(q, q_lab, q_self, q_pos, g, g_lab) -> (rank_first, rel)``
  (``+ (ranks,)`` with ``all_ranks``).

  Shapes: ``q [C, D]``, ``q_lab [C]``, ``q_self [C]`` (gallery index to skip,
  or -1), ``q_pos [C, P]`` (the gallery indices of each query's relevant
  items, -1 padded), ``g [num_tiles, tile, D]`` (sharded over tiles; rows
  past ``num_gallery`` are zero), ``g_lab [num_tiles, tile]``. Outputs:
  ``rank_first [C]`` int32, the 1-based rank of the first relevant item (0
  where there is none) and ``rel [C, k]`` bool, the relevance of the top
  ``k`` items. ``block`` (a divisor of ``tile``) is the block size of the
  top-k pre-selection (see ``_block_candidates``). ``by_label``: an item is
  relevant when its label equals the query's; otherwise when ``q_pos`` lists
  it (any relation; ``q_lab`` and ``g_lab`` unused). ``all_ranks`` adds
  ``ranks [C, P]`` int32, the 1-based rank of each of ``q_pos``'s items (0
  for padding): one more counting pass over the similarities per column of
  ``q_pos``.
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
    # Take back what the raw tiles counted for the query's own entry and
    # for the padding rows.
    num_pad = sum(jnp.sum(gidx_t >= num_gallery, dtype=jnp.int32)
                  for gidx_t in gidx)
    if not self_retrieval:
      self_s = None
    ahead = _uncount_excluded(sum(ahead), b, bi, self_s, q_self, num_pad)
    rank_first = jnp.where(b > -jnp.inf, jax.lax.psum(ahead, _AXIS) + 1, 0)
    extra_out = ()
    if all_ranks:
      # Every relevant item's rank (average precision over the whole
      # ranking): one counting pass per column of q_pos.
      pos_all = jax.lax.pmax(pos_s, _AXIS)                       # [C, P]
      counts = jax.lax.map(lambda a: _count_ahead(s_tiles, gidx, *a),
                           (pos_all.T, q_pos.T)).T
      counts = _uncount_excluded(
          counts, pos_all, q_pos, None if self_s is None else self_s[:, None],
          q_self[:, None], num_pad)
      extra_out = (jnp.where(q_pos >= 0, jax.lax.psum(counts, _AXIS) + 1,
                             0),)

    # This device's top k (exact, via the block pre-selection), then the
    # per-device lists merged (device order = gallery order).
    top, idx = local_top(s_tiles, bmax, first, q_self, num_gallery, k,
                          extra, block)
    if by_label:
      rel = jnp.take(g_lab.reshape(-1), idx - first) == q_lab[:, None]
    else:
      rel = jnp.any(idx[:, :, None] == q_pos[:, None, :], axis=2)
    rel &= top > -jnp.inf
    top = jax.lax.all_gather(top, _AXIS, axis=1, tiled=True)     # [C, n*k]
    rel = jax.lax.all_gather(rel, _AXIS, axis=1, tiled=True)
    _, rel = _merge_top(top, rel, k)
    return (rank_first, rel) + extra_out

  fn = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(), P(), P(), P(), P(_AXIS), P(_AXIS)),
      out_specs=(P(),) * (3 if all_ranks else 2),
      check_vma=False,
  )
  jitted = jax.jit(fn)
  return (lambda q, q_lab, q_self, q_pos, *, g_dev, lab_dev:
          jitted(q, q_lab, q_self, q_pos, g_dev, lab_dev)), mesh


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


def rank_queries(q, q_lab, g, g_lab, self_retrieval, chunk_size, devs, *,
                  compare=None, all_ranks=False):
  """Per-query ranking facts, computed on device.

  ``compare``: ``None`` (labels are class ids, compared for equality) or the
  label relation of :func:`relevance.relevant_by`. ``all_ranks``: also the rank of
  every relevant item.

  Returns:
    ``(rank_first, rel, r, ranks)``: ``rank_first [Q]`` int64, the 1-based
    rank of each query's first relevant item (0 where ``r == 0``); ``rel
    [Q, k]`` bool, the relevance of the top ``k = max(1, max(r))`` items;
    ``r [Q]`` int64, the number of relevant gallery items of each query;
    ``ranks [Q, P]`` int64, the 1-based ranks of the relevant items (0 for
    padding), or ``None`` without ``all_ranks``.
  """
  num_q = q.shape[0]
  num_g = g.shape[0]
  if compare is None:
    q_ids, g_ids, r = relevance.class_ids(q_lab, g_lab, self_retrieval)
    q_pos = relevance.relevant_indices(q_ids, g_ids, self_retrieval)
  else:
    q_pos, r = relevance.relevant_by(compare, q_lab, g_lab, self_retrieval)
    q_ids = np.zeros(num_q, np.int32)   # unused: relevance from q_pos
    g_ids = np.zeros(num_g, np.int32)
  # Top-k length: enough for every query's R (Recall@K does not need it).
  k = max(1, int(r.max()))

  g_tiles, tile = gallery_tiles(g, len(devs))
  lab_pad = np.full((g_tiles.shape[0] * tile,), -1, np.int32)
  lab_pad[:num_g] = g_ids

  fn, mesh = _chunk_fn(devs, tile, _BLOCK, num_g, k, self_retrieval,
                       compare is None, bool(all_ranks))
  sharded = NamedSharding(mesh, P(_AXIS))
  replicated = NamedSharding(mesh, P())
  g_dev = jax.device_put(g_tiles, sharded)
  del g_tiles
  lab_dev = jax.device_put(lab_pad.reshape(-1, tile), sharded)

  own = (np.arange(num_q, dtype=np.int32) if self_retrieval
         else np.full((num_q,), -1, np.int32))
  out = checks.run_chunks(
      functools.partial(fn, g_dev=g_dev, lab_dev=lab_dev),
      [(q, 0.0), (q_ids, -2), (own, -1), (q_pos, -1)], chunk_size,
      replicated)
  ranks = out[2].astype(np.int64) if all_ranks else None
  return out[0].astype(np.int64), out[1], r.astype(np.int64), ranks
