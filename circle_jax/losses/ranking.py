"""What the ranking surrogates (Smooth-AP, FastAP) share: their block and
the tiling of its columns.

A ranking surrogate scores each anchor's whole ranked list of candidates, so
it is not a pair rule (:mod:`circle_jax.losses.engine.rule`: per-anchor set
statistics of independent pairs): Smooth-AP compares every positive with
every candidate (a ``[B, B, B]`` tensor if formed at once), FastAP bins
every candidate's distance into a per-anchor histogram. Both take the pair
losses' ``**options`` (:func:`circle_jax.losses.engine.embedding_loss`):
:func:`ranking_block` forms the ``[M, N]`` similarities of the local anchors
and the candidates (gathered over ``axis_name``, or the references ``ref``)
with the pair masks, and the losses walk its columns in tiles of
``block_size`` (:func:`column_tiles`). The device ring is refused (one
``ValueError``): the tiles need the whole row of similarities.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from circle_jax.losses.engine import reductions
from circle_jax.losses import engine

Array = jax.Array

# The tile size when `block_size` is None: rows x columns of one tile.
DEFAULT_BLOCK = 128


class RankingBlock(NamedTuple):
  """The block of a ranking loss.

  Attributes:
    s: ``[M, N]`` float32 similarities (anchors x candidates).
    pos: ``[M, N]`` bool positive pairs ``P_i``.
    cand: ``[M, N]`` bool candidates ``Omega_i`` (positives and negatives;
      never the anchor itself, a masked-out pair or an invalid reference).
    block: the tile size (rows and columns), at most ``max(M, N)``.
    labels: ``[M]`` the anchors' labels.
    reduction: ``None`` (the loss's own) or the ``reduction`` option's
      :class:`circle_jax.losses.engine.Reduction` (:func:`anchor_loss`).
  """

  s: Array
  pos: Array
  cand: Array
  block: int
  labels: Optional[Array] = None
  reduction: Optional[engine.Reduction] = None


def ranking_block(embeddings, labels, *, loss: str, geometry=None,
                  axis_name=None, pos_mask=None, neg_mask=None,
                  block_size: Optional[int] = None,
                  collective: str = "all_gather",
                  ref: Optional[engine.Candidates] = None,
                  reduction=None) -> RankingBlock:
  """The checked block of a ranking loss from the pair options.

  Args:
    embeddings, labels: ``[B, D]`` float, ``[B]`` int.
    loss: the loss's name, for messages.
    geometry: the similarity (default: cosine, ``engine.COSINE``).
    axis_name, pos_mask, neg_mask, collective, ref: the pair options
      (:func:`circle_jax.losses.engine.embedding_loss`); ``collective="ring"``
      with ``axis_name`` is refused.
    block_size: the tile size (``None``: :data:`DEFAULT_BLOCK`).
    reduction: the ``reduction`` option, kept in the block
      (:func:`anchor_loss`).

  Returns:
    :class:`RankingBlock`.
  """
  if (engine.check_collective(collective) == "ring"
      and axis_name is not None):
    raise ValueError(
        f"The {loss} has no device-ring form (each anchor's ranked list needs "
        "all of its similarities at once, so the column shards would travel "
        "twice); use collective=\"all_gather\".")
  block = (DEFAULT_BLOCK if block_size is None
           else engine.check_block_size(block_size))
  rows, _, s, pos, neg = engine.pair_block(
      embeddings, labels, axis_name=axis_name, pos_mask=pos_mask,
      neg_mask=neg_mask, ref=ref,
      geometry=engine.resolve_geometry(geometry) or engine.COSINE)
  return RankingBlock(s, pos, pos | neg, min(block, max(s.shape)),
                      rows.labels, engine.as_reduction(reduction))


def pad_to(x: Array, axis: int, multiple: int, value=0) -> Array:
  """``x`` padded with ``value`` along ``axis`` to a multiple of ``multiple``."""
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def column_tiles(x: Array, block: int) -> Array:
  """``[M, N]`` -> ``[T, M, block]``: the column tiles (zero / False padded)."""
  x = pad_to(x, 1, block)
  m = x.shape[0]
  return jnp.moveaxis(x.reshape(m, -1, block), 1, 0)


def row_blocks(x: Array, block: int) -> Array:
  """``[M, ...]`` -> ``[T, block, ...]``: the row blocks (zero / False
  padded)."""
  x = pad_to(x, 0, block)
  return x.reshape((-1, block) + x.shape[1:])


def mean_loss(per_anchor: Array, valid: Array, axis_name=None) -> Array:
  """The mean of ``per_anchor`` over the (global) anchors with a positive."""
  return reductions.to_float32_scalar(
      reductions.mean_over_valid(per_anchor, valid, axis_name))


def anchor_loss(per_anchor: Array, valid: Array, block,
                axis_name=None) -> Array:
  """The mean of ``per_anchor`` over the (global) ``valid`` anchors or,
  with ``block.reduction`` (a :func:`ranking_block`'s), that reduction of
  the terms of the valid anchors (the elements; ``"none"``: ``[M]``, 0 for
  the others)."""
  if block.reduction is None:
    return mean_loss(per_anchor, valid, axis_name)
  out = reductions.reduce_terms(per_anchor, valid, block.reduction,
                                labels=block.labels, axis_name=axis_name)
  return out if block.reduction.kind == "none" else (
      reductions.to_float32_scalar(out))


def ap_loss(ap: Array, block, axis_name=None) -> Array:
  """``1 - AP``, the mean over the (global) anchors of ``block`` (a
  :func:`ranking_block`) with a positive of their per-anchor ``ap`` (or
  ``block.reduction`` of those terms, :func:`anchor_loss`)."""
  return anchor_loss(1.0 - ap, jnp.any(block.pos, axis=1), block, axis_name)
