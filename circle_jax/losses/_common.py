"""Shared building blocks of the losses: input checks, similarity matrices,
pair masks, numerically safe reductions and cross-device (global batch) helpers.

Conventions used by every loss in :mod:`circle_jax.losses`:

* Embeddings are ``[B, D]`` float arrays (float32 or bfloat16). They are cast to
  float32 and L2-normalised inside (``l2_normalize`` is safe for zero vectors).
* Labels are integer arrays ``[B]``.
* A pair-based loss is written as a function of a similarity (or distance)
  matrix of shape ``[M, N]``: ``M`` anchor rows against ``N`` candidate columns.
  In the single-device case ``M == N == B``; with ``axis_name`` the rows are the
  local anchors and the columns the global batch gathered over devices.
* ``pos_mask`` / ``neg_mask`` are boolean ``[M, N]`` masks of the pairs a loss
  may use. They are always intersected with the label masks (same label and not
  the same sample / different label), so a miner can only remove pairs.
* With ``axis_name`` every pair-based loss returns the loss of the *global*
  batch (identical on every device) and its gradient with respect to the local
  embeddings equals the single-device gradient on the concatenated batch, under
  both ``jax.shard_map`` and ``jax.pmap`` (see :func:`global_sum`).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional, Tuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

# The public building blocks live in circle_jax.ops; the losses use them
# through this module's namespace.
from circle_jax.ops import (  # noqa: F401  (re-exported for the losses)
    cosine_similarity,
    euclidean_from_cosine,
    gather_global,
    global_sum,
    l2_normalize,
    log1p_sum_exp,
    log_of_shifted_sum,
    masked_logsumexp,
    masked_mean,
    maybe_global_sum,
    nonpositive,
    safe_sqrt,
)

Array = jax.Array


# ----------------------------------------------------------------------------
# Trace-time input checks (chex assertions, re-raised as the ValueError /
# TypeError that names the fix).
# ----------------------------------------------------------------------------


def _require(assertion, error, message: str) -> None:
  """Runs a chex ``assertion``; raises ``error(message)`` if it fails."""
  try:
    assertion()
  except AssertionError as e:
    raise error(f"{message} ({e})") from None


def check_rank(x, rank: int, message: str) -> None:
  _require(lambda: chex.assert_rank(x, rank), ValueError, message)


def check_floating(x, message: str) -> None:
  _require(lambda: chex.assert_type(x, float), TypeError, message)


def _check_integer(x, message: str) -> None:
  _require(lambda: chex.assert_type(x, int), TypeError, message)


def _check_dim(x, axis: int, size: int, message: str) -> None:
  _require(lambda: chex.assert_axis_dimension(x, axis, size), ValueError,
           message)


def check_matrix(matrix, name: str, what: str, fix: str = "") -> Array:
  """Checks a rank-2 float matrix and returns it as float32.

  Args:
    matrix: the array.
    name: its argument name.
    what: its axes in words, e.g. ``"[batch, dim]"``.
    fix: an extra hint for a wrong rank.
  """
  matrix = jnp.asarray(matrix)
  check_rank(matrix, 2, f"`{name}` must have rank 2 ({what}); got shape "
                        f"{matrix.shape}.{fix}")
  check_floating(matrix, f"`{name}` must be a floating array (float32 or "
                         f"bfloat16); got dtype {matrix.dtype}. Cast it with "
                         "`.astype(jnp.float32)`.")
  return matrix.astype(jnp.float32)


def check_embeddings(embeddings, name: str = "embeddings") -> Array:
  """Checks a ``[B, D]`` float array and returns it cast to float32."""
  return check_matrix(embeddings, name, "[batch, dim]",
                      " Reshape it to [batch, dim].")


def check_labels(labels, batch_size: int, name: str = "labels") -> Array:
  """Checks an integer ``[batch_size]`` label vector and returns it as int32."""
  labels = jnp.asarray(labels)
  check_rank(labels, 1, f"`{name}` must have rank 1 ([batch]); got shape "
                        f"{labels.shape}.")
  _check_integer(labels,
                 f"`{name}` must be an integer array of class ids; got dtype "
                 f"{labels.dtype}. Cast it with `.astype(jnp.int32)`.")
  _check_dim(labels, 0, batch_size,
             f"`{name}` has length {labels.shape[0]} but the batch has "
             f"{batch_size} embeddings; they must match.")
  return labels.astype(jnp.int32)


def check_class_vectors(vectors, dim: int, name: str = "proxies") -> Array:
  """Checks a ``[C, D]`` float array of proxies / class weights / centers."""
  vectors = check_matrix(vectors, name, "[num_classes, dim]")
  _check_dim(vectors, 1, dim,
             f"`{name}` has dimension {vectors.shape[1]} but the embeddings "
             f"have dimension {dim}; they must match.")
  return vectors


def check_similarity(similarity, labels, name: str = "similarity"):
  """Checks a square ``[B, B]`` similarity matrix and its ``[B]`` labels."""
  similarity = check_matrix(similarity, name, "[batch, batch]")
  _check_dim(similarity, 1, similarity.shape[0],
             f"`{name}` must be a square [batch, batch] matrix; got shape "
             f"{similarity.shape}.")
  labels = check_labels(labels, similarity.shape[0])
  return similarity, labels


def check_shape(x, shape, message: str):
  """Checks that ``x`` has ``shape`` (ValueError ``message`` otherwise)."""
  x = jnp.asarray(x)
  _require(lambda: chex.assert_shape(x, tuple(shape)), ValueError, message)
  return x


def check_mask(mask, shape, name: str):
  """Checks an optional ``[M, N]`` pair mask and returns it as bool (or None)."""
  if mask is None:
    return None
  mask = check_shape(mask, shape,
                     f"`{name}` must have the shape of the similarity matrix "
                     f"{tuple(shape)}; got {jnp.shape(mask)}.")
  return mask.astype(bool)


def check_positive(value, name: str):
  """Checks (when concrete) that a hyperparameter is > 0."""
  if isinstance(value, (int, float)) and not value > 0:
    raise ValueError(f"`{name}` must be > 0; got {value}.")


def check_nonnegative(value, name: str, why: str = ""):
  """Checks (when concrete) that a hyperparameter is >= 0."""
  if isinstance(value, (int, float)) and not value >= 0:
    raise ValueError(f"`{name}` must be >= 0{why}; got {value}.")


class HyperRange(NamedTuple):
  """The documented range of a hyperparameter: an interval of the reals.

  Attributes:
    low, high: the bounds (``-inf`` / ``inf`` for none).
    low_inclusive, high_inclusive: whether the bounds belong to the range.
  """

  low: float
  high: float
  low_inclusive: bool = True
  high_inclusive: bool = True

  def contains(self, value) -> bool:
    above = value >= self.low if self.low_inclusive else value > self.low
    below = value <= self.high if self.high_inclusive else value < self.high
    return bool(above and below)

  def describe(self) -> str:
    """E.g. ``"[1e-06, 10000]"`` or ``"(0, inf)"``."""
    return (f"{'[' if self.low_inclusive else '('}{self.low:g}, "
            f"{self.high:g}{']' if self.high_inclusive else ')'}")

  def __str__(self) -> str:
    return self.describe()


# Scales and temperatures multiply a similarity (or a distance of unit
# vectors) inside an ``exp``. A recomputed similarity differs from the first
# by float32 rounding (about 1e-7 for D up to a few hundred), which the scale
# turns into a logit error: up to 1e4 it stays around 1e-3, so the softmax
# weights (and dense / blockwise, jit / eager results) agree to ~0.1%; at 1e8
# they can differ by 100%. Scales that divide a loss term (Multi-Similarity's
# 1 / alpha) are kept >= 1e-6.
SCALE_RANGE = HyperRange(1e-6, 1e4)
TEMPERATURE_RANGE = HyperRange(0.0, 1e4)  # 0: a plain mean
# Margins and thresholds compared with cosine similarities (in [-1, 1]) or
# added to them.
SIMILARITY_MARGIN_RANGE = HyperRange(-1.0, 1.0)
# Boundaries and margins of Euclidean distances of unit vectors (in [0, 2]).
DISTANCE_MARGIN_RANGE = HyperRange(0.0, 2.0)
NONNEGATIVE_RANGE = HyperRange(0.0, float("inf"), True, False)
UNIT_INTERVAL = HyperRange(0.0, 1.0)


def _concrete_number(value):
  """``value`` as a float when it is a concrete real scalar, else None."""
  if isinstance(value, (bool, np.bool_)):
    return None
  if isinstance(value, (int, float, np.integer, np.floating)):
    return float(value)
  return None  # traced (or array) values are not checked


def check_range(value, name: str, valid: HyperRange, owner: str = ""):
  """Checks (when concrete) that a hyperparameter lies in its range.

  Args:
    value: the hyperparameter (Python / NumPy number; traced values pass).
    name: its name, for the message.
    valid: its documented range.
    owner: what it belongs to, for the message (e.g. ``"the Circle loss"``).

  Raises:
    ValueError: naming the parameter, its range and the value (NaN is never
      in a range).
  """
  number = _concrete_number(value)
  if number is not None and not valid.contains(number):
    where = f" of {owner}" if owner else ""
    raise ValueError(
        f"`{name}`{where} must be in {valid}; got {value}. Outside this "
        "range the loss is not accurate in float32 (or not meaningful for "
        "cosine similarities / distances of unit vectors); see the "
        "loss's docstring.")


def check_ranges(values: Mapping[str, Any], ranges: Mapping[str, HyperRange],
                 owner: str = ""):
  """:func:`check_range` for every ``ranges`` entry present in ``values``."""
  for name, valid in ranges.items():
    if name in values:
      check_range(values[name], name, valid, owner)


# ----------------------------------------------------------------------------
# Pair masks.
# ----------------------------------------------------------------------------


def pair_masks(
    row_labels: Array,
    col_labels: Array,
    row_offset=0,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Tuple[Array, Array]:
  """Positive and negative pair masks ``[M, N]``.

  Args:
    row_labels: ``[M]`` labels of the anchors.
    col_labels: ``[N]`` labels of the candidates.
    row_offset: index of the first anchor among the columns (anchors are
      columns ``row_offset .. row_offset + M - 1``); used to exclude self-pairs.
      Pass ``None`` when rows and columns are different sets (e.g. proxies).
    pos_mask, neg_mask: optional ``[M, N]`` masks from a miner, intersected
      with the label masks.

  Returns:
    ``(pos, neg)``: ``pos[i, j]`` is True when ``j`` has the label of ``i`` and
    is not ``i`` itself; ``neg[i, j]`` when the labels differ.
  """
  same = row_labels[:, None] == col_labels[None, :]
  pos = same
  if row_offset is not None:
    rows = jnp.arange(row_labels.shape[0]) + row_offset
    cols = jnp.arange(col_labels.shape[0])
    pos = pos & (rows[:, None] != cols[None, :])
  neg = ~same
  shape = same.shape
  pos_mask = check_mask(pos_mask, shape, "pos_mask")
  neg_mask = check_mask(neg_mask, shape, "neg_mask")
  if pos_mask is not None:
    pos = pos & pos_mask
  if neg_mask is not None:
    neg = neg & neg_mask
  return pos, neg


# ----------------------------------------------------------------------------
# Numerically safe masked reductions.
# ----------------------------------------------------------------------------


def two_set_exp(
    logit_p: Array,
    logit_n: Array,
    pos: Array,
    neg: Array,
    shift: Optional[Tuple[Array, Array]] = None,
    axis: int = -1,
) -> Tuple[Array, Array, Array]:
  """Max-shifted ``exp`` over two disjoint sets of each row, one pass.

  The pair losses need, for every anchor row, a logsumexp (or softmax
  weights) over its positives and another over its negatives. Doing them
  separately costs two ``exp`` passes over the whole ``[M, N]`` block; here
  the two logits are merged entry-wise (``where(pos, logit_p, logit_n)``),
  each set is shifted by its own row maximum, and ``exp`` runs once per entry.

  Args:
    logit_p: ``[..., N]`` logits of the positive set (read where ``pos``).
    logit_n: ``[..., N]`` logits of the negative set (read where ``neg``).
    pos: ``[..., N]`` bool; must not overlap ``neg``.
    neg: ``[..., N]`` bool.
    shift: optional ``(m_p, m_n)``, each ``[..., 1]``: the row maxima of the
      two sets when the caller already has them (e.g. Multi-Similarity's
      mining statistics, or maxima over devices), which saves the two max
      passes; a shift above the maximum is also exact (short of underflow),
      one below it by rounding clamps the entries above it to ``exp(0)``
      (:func:`circle_jax.ops.nonpositive`). Non-finite entries (empty sets)
      are replaced by 0.
    axis: the axis of the sets (default the last; Proxy-Anchor uses 0).

  Returns:
    ``(e, m_p, m_n)``: ``e`` has the shape of the logits,
    ``exp(min(logit - m, 0))`` with the maximum ``m`` of the entry's set, and 0 outside ``pos | neg``
    (so a non-empty set sums to about 1 or more, and only an empty set to
    exactly 0); ``m_p`` and ``m_n`` have size 1 along
    ``axis``: the maxima of each set (0 for an empty set), without gradient.
  """
  z = jnp.where(pos, logit_p, logit_n).astype(jnp.float32)
  if shift is None:
    m_p = jnp.max(jnp.where(pos, z, -jnp.inf), axis=axis, keepdims=True)
    m_n = jnp.max(jnp.where(neg, z, -jnp.inf), axis=axis, keepdims=True)
  else:
    m_p, m_n = (jnp.asarray(m, jnp.float32) for m in shift)
  m_p = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m_p), m_p, 0.0))
  m_n = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m_n), m_n, 0.0))
  # The shift may exceed a recomputed logit's maximum by its rounding (or a
  # caller's shift be slightly off): the clamp keeps every term <= 1.
  e = jnp.exp(jnp.where(pos | neg, nonpositive(z - jnp.where(pos, m_p, m_n)),
                        -jnp.inf))
  return e, m_p, m_n


def two_set_logsumexp(
    logit_p: Array,
    logit_n: Array,
    pos: Array,
    neg: Array,
    shift: Optional[Tuple[Array, Array]] = None,
) -> Tuple[Array, Array]:
  """Masked logsumexps over two disjoint sets of each row, one ``exp`` pass.

  Equal to ``(masked_logsumexp(logit_p, pos), masked_logsumexp(logit_n,
  neg))`` along the last axis (``-inf`` with a zero gradient for an empty
  set), at half the ``exp`` cost; see :func:`two_set_exp`.

  Returns:
    ``(lse_p, lse_n)``, each ``[...]`` float32.
  """
  e, m_p, m_n = two_set_exp(logit_p, logit_n, pos, neg, shift)
  s_p = jnp.sum(jnp.where(pos, e, 0.0), axis=-1, keepdims=True)
  s_n = jnp.sum(jnp.where(neg, e, 0.0), axis=-1, keepdims=True)
  return (jnp.squeeze(log_of_shifted_sum(s_p, m_p), -1),
          jnp.squeeze(log_of_shifted_sum(s_n, m_n), -1))


# ----------------------------------------------------------------------------
# Global batch across devices.
# ----------------------------------------------------------------------------


def local_row_offset(local_batch: int, axis_name):
  """Index of this device's first anchor in the gathered global batch."""
  if axis_name is None:
    return 0
  return jax.lax.axis_index(axis_name) * local_batch


def gathered_batch(embeddings: Array, labels: Array, axis_name):
  """Returns ``(all_embeddings, all_labels, row_offset)`` for a local batch."""
  return (
      gather_global(embeddings, axis_name),
      gather_global(labels, axis_name),
      local_row_offset(embeddings.shape[0], axis_name),
  )


def pair_block(embeddings, labels, axis_name=None, pos_mask=None,
               neg_mask=None):
  """The cosine-similarity block of a pair-based loss and its pair masks.

  Checks the inputs, gathers the global batch over ``axis_name`` and compares
  the local anchors with it.

  Returns:
    ``(similarity [M, N], pos [M, N], neg [M, N], row_offset)``.
  """
  embeddings = check_embeddings(embeddings)
  labels = check_labels(labels, embeddings.shape[0])
  all_embeddings, all_labels, row_offset = gathered_batch(
      embeddings, labels, axis_name)
  similarity = cosine_similarity(embeddings, all_embeddings)
  pos, neg = pair_masks(labels, all_labels, row_offset, pos_mask, neg_mask)
  return similarity, pos, neg, row_offset


def mean_over_valid(per_anchor: Array, valid: Array, axis_name=None) -> Array:
  """Mean of ``per_anchor`` over valid anchors of the (global) batch; 0 if none."""
  valid = valid.astype(jnp.float32)
  total = maybe_global_sum(jnp.sum(jnp.where(valid > 0, per_anchor, 0.0)), axis_name)
  count = jax.lax.stop_gradient(maybe_global_sum(jnp.sum(valid), axis_name))
  return total / jnp.maximum(count, 1.0)


def sum_over_batch(per_anchor: Array, axis_name=None) -> Array:
  """Sum of ``per_anchor`` over the (global) batch divided by its size."""
  batch = per_anchor.shape[0]
  if axis_name is not None:
    batch = batch * jax.lax.psum(1, axis_name)
  return maybe_global_sum(jnp.sum(per_anchor), axis_name) / batch


def to_float32_scalar(x) -> Array:
  return jnp.asarray(x, jnp.float32).reshape(())

