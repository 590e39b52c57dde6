"""The two sides of a pair loss: the anchors (rows) and the candidates
(columns), as :class:`circle_jax.losses.engine.tiles.PairSide` s.

Without references the candidates are the batch gathered over ``axis_name``
(ids: the global row indices, so an anchor is not its own positive). With a
:class:`Candidates` value ``ref`` (pytorch-metric-learning's ``ref_emb``:
e.g. a cross-batch memory, Wang et al., CVPR 2020) the candidates are its
embeddings gathered over ``axis_name`` instead: anchors come from the batch,
positives and negatives from the references. References are just other
columns, so every rule and engine runs on them unchanged.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import checks
from circle_jax.losses.engine import reductions
from circle_jax.losses.engine import geometry as geometry_lib
from circle_jax.losses.engine import tiles

Array = jax.Array


class Candidates(NamedTuple):
  """Reference embeddings the anchors meet instead of the batch (a pytree).

  Attributes:
    embeddings: ``[K, D]`` float references (this device's shard under
      ``axis_name``; the shards are gathered, or travel on the ring).
    labels: ``[K]`` int labels of the references, or ``[K, L]`` multi-hot
      (the batch's kind, over the same ``L`` classes).
    valid: optional ``[K]`` bool; an invalid reference takes no part in any
      pair (an empty memory slot). ``None``: all valid.
    ids: optional ``[K]`` int sample ids of the references.
    anchor_ids: optional ``[B]`` int sample ids of the anchors (both or
      neither of ``ids`` and ``anchor_ids``): an anchor and a reference with
      the same id are the same sample and never a pair. Without ids no pair
      is a self pair, unless ``embeddings`` *is* the batch's array, when both
      default to the global row indices.
  """

  embeddings: Array
  labels: Array
  valid: Optional[Array] = None
  ids: Optional[Array] = None
  anchor_ids: Optional[Array] = None


def _vector(x, length: int, name: str, kind: str):
  """Checks a ``[length]`` vector of ``kind`` (``"int"`` or ``"bool"``)."""
  x = jnp.asarray(x)
  if x.shape != (length,):
    raise ValueError(
        f"`{name}` must have shape ({length},), one entry per "
        f"{'anchor' if name == 'ref.anchor_ids' else 'reference'}; got "
        f"{x.shape}.")
  if kind == "bool" and x.dtype != jnp.bool_:
    raise ValueError(f"`{name}` must be a bool array; got dtype {x.dtype}. "
                     "Cast it with `.astype(bool)`.")
  if kind == "int" and not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"`{name}` must be an integer array; got dtype "
                     f"{x.dtype}. Cast it with `.astype(jnp.int32)`.")
  return x.astype(jnp.int32) if kind == "int" else x


def _reference_side(ref: Candidates, embeddings, x, labels, row_index, gather,
                    embed):
  """``(row ids, columns)`` of the references ``ref`` (checked)."""
  if not isinstance(ref, Candidates):
    raise TypeError(
        "`ref` must be a circle_jax.losses.Candidates(embeddings, labels, "
        f"valid=None, ids=None, anchor_ids=None); got {type(ref).__name__}.")
  if ref.labels is None:
    raise ValueError("`ref` needs its `labels`, the [K] integer (or [K, L] "
                     "multi-hot) labels of the reference embeddings.")
  r = checks.check_embeddings(ref.embeddings, "ref.embeddings")
  if r.shape[1] != x.shape[1]:
    raise ValueError(
        f"`ref.embeddings` has dimension {r.shape[1]} but the embeddings have "
        f"dimension {x.shape[1]}; they must match.")
  m, k = x.shape[0], r.shape[0]
  ref_labels = checks.check_labels(ref.labels, k, "ref.labels",
                                   multi_hot=True)
  if ref_labels.shape[1:] != labels.shape[1:]:
    raise ValueError(
        f"`ref.labels` has shape {ref_labels.shape} but the batch's labels "
        f"{labels.shape}: give both class ids or both multi-hot over the "
        "same classes.")
  valid = ref.valid
  if valid is not None:
    valid = gather(_vector(valid, k, "ref.valid", "bool"))
  if (ref.ids is None) != (ref.anchor_ids is None):
    raise ValueError("Pass both `ref.ids` and `ref.anchor_ids` (the sample "
                     "ids of the references and of the anchors), or neither.")
  if ref.ids is not None:
    ids = _vector(ref.anchor_ids, m, "ref.anchor_ids", "int")
    ref_ids = _vector(ref.ids, k, "ref.ids", "int")
  elif ref.embeddings is embeddings:  # the batch itself: self pairs by row
    ids = ref_ids = row_index
  else:  # ids that never match: every anchor-reference pair counts
    ids = jnp.full((m,), -1, jnp.int32)
    ref_ids = jnp.full((k,), -2, jnp.int32)
  cols = tiles.PairSide(embed(gather(r)), gather(ref_labels), gather(ref_ids),
                        valid)
  return ids, cols


def pair_sides(embeddings, labels, *, axis_name=None,
               ref: Optional[Candidates] = None,
               geometry: geometry_lib.Geometry = geometry_lib.COSINE,
               gather_columns: bool = True
               ) -> Tuple[tiles.PairSide, tiles.PairSide]:
  """The rows (local anchors) and columns (candidates) of a pair loss.

  Args:
    embeddings: ``[B, D]`` float (the local anchors).
    labels: ``[B]`` int, or ``[B, L]`` multi-hot (bool or 0/1).
    axis_name: optional mapped axis.
    ref: optional :class:`Candidates` (module docstring).
    geometry: its ``embed`` maps both sides (cosine: L2 normalisation).
    gather_columns: gather the columns over ``axis_name`` (False: each
      device keeps its shard, with global ids, for the ring engine).

  Returns:
    ``(rows, cols)``; ``cols.valid`` is ``None`` when all columns are valid.

  Raises:
    ValueError / TypeError: a ``ref`` that is not a :class:`Candidates`,
      mismatched dimensions or lengths, non-integer labels or ids, a
      non-bool ``valid``, or only one of ``ids`` / ``anchor_ids``.
  """
  x = checks.check_embeddings(embeddings)
  labels = checks.check_labels(labels, x.shape[0], multi_hot=True)
  m = x.shape[0]
  embed = geometry.embed
  row_index = (jnp.arange(m, dtype=jnp.int32)
               + jnp.asarray(reductions.local_row_offset(m, axis_name), jnp.int32))
  if gather_columns:
    gather = functools.partial(ops.gather_global, axis_name=axis_name)
  else:
    gather = lambda v: v
  if ref is not None:
    ids, cols = _reference_side(ref, embeddings, x, labels, row_index, gather,
                                embed)
    return tiles.PairSide(embed(x), labels, ids), cols
  if not gather_columns:
    z = embed(x)
    return (tiles.PairSide(z, labels, row_index),
            tiles.PairSide(z, labels, row_index))
  x_all = gather(x)
  return (tiles.PairSide(embed(x), labels, row_index),
          tiles.PairSide(embed(x_all), gather(labels),
                         jnp.arange(x_all.shape[0], dtype=jnp.int32)))


def pair_block(embeddings, labels, *, axis_name=None, pos_mask=None,
               neg_mask=None, ref: Optional[Candidates] = None,
               geometry: geometry_lib.Geometry = geometry_lib.COSINE):
  """The whole ``[M, N]`` block of a pair loss: sides, similarities, masks.

  Args:
    embeddings, labels, axis_name, ref, geometry: as :func:`pair_sides`.
    pos_mask, neg_mask: optional ``[M, N]`` bool miner masks (checked).

  Returns:
    ``(rows, cols, s, pos, neg)``: the sides, the ``[M, N]`` similarities
    and pair masks.
  """
  rows, cols = pair_sides(embeddings, labels, axis_name=axis_name, ref=ref,
                          geometry=geometry)
  s = geometry.tile(rows.z, cols.z)
  pos, neg = checked_pair_masks(rows, cols, s.shape, pos_mask, neg_mask)
  return rows, cols, s, pos, neg


def checked_pair_masks(rows, cols, shape, pos_mask, neg_mask):
  """The block's pair masks with the checked ``[M, N]`` miner masks."""
  return tiles.side_pair_masks(
      rows, cols, checks.check_mask(pos_mask, shape, "pos_mask"),
      checks.check_mask(neg_mask, shape, "neg_mask"))


def square_block(matrix, labels, pos_mask=None, neg_mask=None,
                 name: str = "similarity"):
  """A checked square ``[B, B]`` matrix, its labels and its pair masks."""
  matrix, labels = checks.check_similarity(matrix, labels, name=name)
  ids = jnp.arange(labels.shape[0], dtype=jnp.int32)
  shape = matrix.shape
  pos, neg = tiles.pair_masks(
      labels, ids, labels, ids, None,
      checks.check_mask(pos_mask, shape, "pos_mask"),
      checks.check_mask(neg_mask, shape, "neg_mask"))
  return matrix, labels, pos, neg
