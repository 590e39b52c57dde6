"""Exact k-nearest-neighbour search by cosine similarity, on the devices.

The search of :mod:`circle_jax.search` and the retrieval figures rank a
gallery exactly as :func:`circle_jax.evaluation.retrieval_metrics` does, with
the same device program's parts (:mod:`circle_jax.evaluation.tiled_ranking`):

* the gallery is L2-normalised, zero-padded and split into tiles of at most
  4096 rows, sharded over the devices (:func:`shard_gallery`, done once and
  reused by every search);
* the queries are processed in chunks of a fixed row count; each device
  goes over its gallery tiles in a ``lax.scan`` (one program whatever the
  gallery's size: compile time does not grow with it): it computes each
  ``[chunk, T]`` similarity tile with a float32 ``HIGHEST``-precision
  matmul, picks the tile's exact top ``k`` through the block-maximum
  pre-selection and merges it into a running top ``k``
  (:func:`circle_jax.evaluation.tiled_ranking.scan_top`); the per-device lists
  are then merged;
* equal similarities are ranked by gallery index (the lower first), so the
  result is deterministic and does not depend on the number of devices.

The scores are cosine similarities: the queries are L2-normalised too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from circle_jax.evaluation import checks
from circle_jax.evaluation import tiled_ranking

__all__ = ["ShardedGallery", "shard_gallery", "nearest_neighbors"]

# Items per block of the top-k pre-selection: larger blocks mean fewer block
# maxima to select from (XLA's TopK is slow), more items per chosen block.
# A divisor of every tile (tiles are multiples of 32 rows).
_BLOCK = 32
# A chunk's similarity tile held at once on one device, at most (bytes): the
# chunk is made smaller for large tiles.
_MAX_CHUNK_BYTES = 1 << 29


@dataclasses.dataclass(frozen=True)
class ShardedGallery:
  """A gallery laid out on the devices for :func:`nearest_neighbors`.

  Attributes:
    tiles: ``[num_tiles, tile, D]`` float32, L2-normalised rows, zero padding,
      sharded over ``mesh``'s gallery axis.
    num_items: the gallery's size ``G``.
    dim: the embedding size ``D``.
    tile: rows per tile.
    mesh: the devices that share it.
  """

  tiles: jax.Array
  num_items: int
  dim: int
  tile: int
  mesh: Mesh


def shard_gallery(gallery, *, mesh: Optional[Mesh] = None,
                  devices: Optional[Sequence[jax.Device]] = None
                  ) -> ShardedGallery:
  """Normalises, pads and shards ``gallery [G, D]`` over the devices.

  Args:
    gallery: ``[G, D]`` float embeddings (numpy or JAX), finite, ``G > 0``.
    mesh: a mesh whose devices (all axes, flattened) share the gallery.
    devices: the devices instead (default: all local devices).
  """
  g = checks.check_embeddings(gallery, "gallery")
  devs = checks.resolve_devices(mesh, devices)
  mesh = Mesh(np.array(devs), (tiled_ranking.GALLERY_AXIS,))
  tiles, tile = tiled_ranking.gallery_tiles(g, len(devs))
  placed = jax.device_put(
      tiles, NamedSharding(mesh, P(tiled_ranking.GALLERY_AXIS)))
  return ShardedGallery(placed, g.shape[0], g.shape[1], tile, mesh)


@functools.lru_cache(maxsize=32)
def _topk_fn(mesh: Mesh, tile: int, block: int, num_gallery: int, k: int,
             self_retrieval: bool):
  """Jitted ``(q [C, D], q_self [C], tiles) -> (top [C, k], idx [C, k])``.

  ``top`` are float32 similarities, best first, ``idx`` int32 gallery
  indices (-1 and ``top = -inf`` past the gallery's size); ``q_self`` the
  gallery index each query leaves out (-1: none).
  """
  # Blocks that the query's own entry and a part-padding block can lift.
  extra = int(self_retrieval) + int(num_gallery % block != 0)

  def body(q, q_self, g):
    top, idx = tiled_ranking.scan_top(q, g, tile, q_self, num_gallery, k, extra,
                                  block)
    top, idx = tiled_ranking.merge_device_tops(top, idx, k)
    return top, jnp.where(top > -jnp.inf, idx, -1)

  axis = tiled_ranking.GALLERY_AXIS
  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(axis)),
                     out_specs=(P(), P()), check_vma=False)
  return jax.jit(fn)


def nearest_neighbors(
    query,
    gallery,
    *,
    k: int,
    exclude_self: bool = False,
    chunk_size: int = 1024,
    mesh: Optional[Mesh] = None,
    devices: Optional[Sequence[jax.Device]] = None,
    on_chunk: Optional[Callable[[int], None]] = None,
) -> Tuple[np.ndarray, np.ndarray]:
  """The exact ``k`` nearest gallery items of each query by cosine similarity.

  Args:
    query: ``[Q, D]`` float embeddings (normalised here).
    gallery: ``[G, D]`` float embeddings or a :class:`ShardedGallery` (then
      ``mesh`` / ``devices`` are its own).
    k: neighbours per query (``k > G`` pads with index -1, score ``-inf``).
    exclude_self: the queries are the gallery (``Q == G``); leave each
      query's own entry out of its ranking.
    chunk_size: query rows per device step (made smaller where a chunk's
      similarity tile would exceed 512 MiB).
    mesh / devices: where to shard a gallery given as an array.
    on_chunk: called with the number of queries done after each chunk.

  Returns:
    ``(scores [Q, k] float32, indices [Q, k] int64)``, best first; equal
    scores in gallery order.
  """
  k = checks.check_positive_int(k, "k")
  chunk_size = checks.check_positive_int(chunk_size, "chunk_size")
  if not isinstance(gallery, ShardedGallery):
    gallery = shard_gallery(gallery, mesh=mesh, devices=devices)
  elif mesh is not None or devices is not None:
    raise ValueError("A ShardedGallery has its own devices; do not pass "
                     "`mesh` or `devices`.")
  q = checks.check_embeddings(query, "query")
  if q.shape[1] != gallery.dim:
    raise ValueError(f"`query` has dimension {q.shape[1]} but the gallery "
                     f"has {gallery.dim}; they must match.")
  if exclude_self and q.shape[0] != gallery.num_items:
    raise ValueError("`exclude_self` needs the queries to be the gallery "
                     f"({q.shape[0]} queries, {gallery.num_items} items).")
  q = tiled_ranking.l2_normalize_rows(q)
  chunk_size = max(1, min(chunk_size,
                          _MAX_CHUNK_BYTES // (4 * gallery.tile)))
  block = math.gcd(gallery.tile, _BLOCK)
  fn = _topk_fn(gallery.mesh, gallery.tile, block, gallery.num_items, k,
                exclude_self)
  own = (np.arange(q.shape[0], dtype=np.int32) if exclude_self
         else np.full((q.shape[0],), -1, np.int32))
  top, idx = checks.run_chunks(
      lambda qc, sc: fn(qc, sc, gallery.tiles), [(q, 0.0), (own, -1)],
      chunk_size, NamedSharding(gallery.mesh, P()), on_chunk)
  return top.astype(np.float32), idx.astype(np.int64)
