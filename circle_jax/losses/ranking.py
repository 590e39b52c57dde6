"""What the ranking surrogates (Smooth-AP, FastAP, RS@k, PNP) share: their
block, the tiling of its columns, the anchors' self-similarity and the
reduction.

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


def sigmoid_tile(s_rows: Array, s_cols: Array, tau) -> Array:
  """``sigma((s_k - s_j) / tau)`` of a block: ``[R, N]`` x ``[R, K]`` ->
  ``[R, N, K]`` (``j`` the ranked candidate, ``k`` the compared one)."""
  return jax.nn.sigmoid((s_cols[:, None, :] - s_rows[:, :, None]) / tau)


def scan_tiles(body, init, s: Array, masks: tuple, tau, k_block: int):
  """``lax.scan`` of ``body(carry, s_k, *mask_tiles, sigma_k)`` over the
  column tiles of one block of anchors ``s`` ``[R, N]`` and its ``[R, N]``
  ``masks`` (``sigma_k``: :func:`sigmoid_tile` of ``s`` and the tile)."""
  tiles = tuple(column_tiles(v, k_block) for v in (s,) + tuple(masks))

  def step(carry, tile):
    return body(carry, *tile, sigmoid_tile(s, tile[0], tau))

  return jax.lax.scan(step, init, tiles)


def block_ranks(s: Array, masks: tuple, tau, k_block: int) -> tuple:
  """The smoothed ranks of one block of anchors within each mask: for each
  ``[R, N]`` mask ``S``, ``1/2 + sum_{k in S} sigma((s_k - s_j) / tau)``
  ``[R, N]`` (for ``j`` in ``S``: ``1 + sum_{k in S, k != j}``, since
  ``sigma(0) = 1/2``)."""
  def body(carry, s_k, *rest):
    del s_k
    *mask_tiles, sig = rest
    return tuple(
        c + jnp.sum(jnp.where(m[:, None, :], sig, 0.0), axis=-1)
        for c, m in zip(carry, mask_tiles)), None

  init = tuple(jnp.full_like(s, 0.5) for _ in masks)  # the k = j term
  ranks, _ = scan_tiles(body, init, s, masks, tau, k_block)
  return ranks


def block_rank_grad(s: Array, masks: tuple, weights: tuple, tau,
                    k_block: int):
  """The gradient of ``sum_m sum_j weights_m[j] rank_m[j]`` (``rank_m`` of
  :func:`block_ranks`) for one block: ``(d/ds [R, N], d/dtau [R])``.

  With ``t_jk = sum_m weights_m[j] [k in S_m] sigma'_jk / tau`` (``sigma'``
  the sigmoid's derivative at ``(s_k - s_j) / tau``): ``d/ds_c = sum_j
  t_jc - sum_k t_ck`` (``c`` as the compared candidate, then as the ranked
  one) and ``d/dtau = -sum_jk t_jk (s_k - s_j) / tau``."""
  def body(carry, s_k, *rest):
    ds_j, dtau = carry
    *mask_tiles, sig = rest
    w = sum(jnp.where(m[:, None, :], v[:, :, None], 0.0)
            for m, v in zip(mask_tiles, weights))
    t = w * sig * (1.0 - sig) / tau
    diff = s_k[:, None, :] - s[:, :, None]
    dtau = dtau - jnp.sum(t * diff, axis=(1, 2)) / tau
    return (ds_j - jnp.sum(t, axis=2), dtau), jnp.sum(t, axis=1)

  init = (jnp.zeros_like(s), jnp.zeros_like(s[:, 0]))
  (ds_j, dtau), ds_k = scan_tiles(body, init, s, masks, tau, k_block)
  m = s.shape[0]
  ds_k = jnp.moveaxis(ds_k, 0, 1).reshape(m, -1)[:, :s.shape[1]]
  return ds_j + ds_k, dtau


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


# The registry's reduction of the losses that end in ap_loss (their
# ``reduction`` fact, written once beside the code it describes).
AP_REDUCTION = "mean over anchors with >= 1 positive"


def ap_loss(ap: Array, block, axis_name=None) -> Array:
  """``1 - AP``, the mean over the (global) anchors of ``block`` (a
  :func:`ranking_block`) with a positive of their per-anchor ``ap`` (or
  ``block.reduction`` of those terms, :func:`anchor_loss`); ``ap`` may be
  any per-anchor score in [0, 1] that a positive makes meaningful (RS@k's
  smoothed recall)."""
  return anchor_loss(1.0 - ap, jnp.any(block.pos, axis=1), block, axis_name)


def varying_scalar(x, block: RankingBlock) -> Array:
  """The hyperparameter ``x`` as a float32 scalar typed like ``block.s``:
  device-varying under ``jax.shard_map``, so autodiff sums its cotangent
  (one per device) over the devices (Smooth-AP's ``tau``, RS@k's
  ``tau1``)."""
  return jnp.asarray(x, jnp.float32) + jnp.zeros_like(block.s[0, 0])


def self_similarity(embeddings, geometry=None) -> Array:
  """``s_ii`` ``[B]``: each anchor's similarity with itself in float32
  under ``geometry`` (a loss's ``geometry`` option; default cosine), as the
  block's tiles compute it (the anchor's own entry, which
  :func:`ranking_block` leaves out of the candidates)."""
  geometry = engine.resolve_geometry(geometry) or engine.COSINE
  z = geometry.embed(jnp.asarray(embeddings, jnp.float32))
  return jax.vmap(lambda r: geometry.tile(r[None], r[None])[0, 0])(z)
