"""Shared building blocks of the losses: trace-time input checks and the
(global batch) reductions of per-anchor terms.

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
  both ``jax.shard_map`` and ``jax.pmap`` (see :func:`circle_jax.ops.global_sum`).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from circle_jax import ops

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


# ----------------------------------------------------------------------------
# Global batch across devices.
# ----------------------------------------------------------------------------


def local_row_offset(local_batch: int, axis_name):
  """Index of this device's first anchor in the gathered global batch."""
  if axis_name is None:
    return 0
  return jax.lax.axis_index(axis_name) * local_batch


def mean_over_valid(per_anchor: Array, valid: Array, axis_name=None) -> Array:
  """Mean of ``per_anchor`` over valid anchors of the (global) batch; 0 if none."""
  valid = valid.astype(jnp.float32)
  total = ops.maybe_global_sum(jnp.sum(jnp.where(valid > 0, per_anchor, 0.0)), axis_name)
  count = jax.lax.stop_gradient(ops.maybe_global_sum(jnp.sum(valid), axis_name))
  return total / jnp.maximum(count, 1.0)


def sum_over_batch(per_anchor: Array, axis_name=None) -> Array:
  """Sum of ``per_anchor`` over the (global) batch divided by its size."""
  batch = per_anchor.shape[0]
  if axis_name is not None:
    batch = batch * jax.lax.psum(1, axis_name)
  return ops.maybe_global_sum(jnp.sum(per_anchor), axis_name) / batch


def ratio_of_sums(total: Array, count: Array, axis_name=None) -> Array:
  """(Global) ``sum(total) / max(sum(count), 1)``; the count has no gradient."""
  total = ops.maybe_global_sum(jnp.sum(total), axis_name)
  count = jax.lax.stop_gradient(
      ops.maybe_global_sum(jnp.sum(count.astype(jnp.float32)), axis_name))
  return total / jnp.maximum(count, 1.0)


def to_float32_scalar(x) -> Array:
  return jnp.asarray(x, jnp.float32).reshape(())

