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

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

Array = jax.Array

# Euclidean distances below sqrt(_SQRT_EPS) are reported as 0 with a zero
# gradient, instead of the infinite derivative of sqrt at 0.
_SQRT_EPS = 1e-12
_NORM_EPS = 1e-12


# ----------------------------------------------------------------------------
# Trace-time input checks.
# ----------------------------------------------------------------------------


def check_embeddings(embeddings, name: str = "embeddings") -> Array:
  """Checks a ``[B, D]`` float array and returns it cast to float32."""
  embeddings = jnp.asarray(embeddings)
  if embeddings.ndim != 2:
    raise ValueError(
        f"`{name}` must have rank 2 ([batch, dim]); got shape "
        f"{embeddings.shape}. Reshape it to [batch, dim]."
    )
  if not jnp.issubdtype(embeddings.dtype, jnp.floating):
    raise TypeError(
        f"`{name}` must be a floating array (float32 or bfloat16); got dtype "
        f"{embeddings.dtype}. Cast it with `.astype(jnp.float32)`."
    )
  return embeddings.astype(jnp.float32)


def check_labels(labels, batch_size: int, name: str = "labels") -> Array:
  """Checks an integer ``[batch_size]`` label vector and returns it as int32."""
  labels = jnp.asarray(labels)
  if labels.ndim != 1:
    raise ValueError(
        f"`{name}` must have rank 1 ([batch]); got shape {labels.shape}."
    )
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(
        f"`{name}` must be an integer array of class ids; got dtype "
        f"{labels.dtype}. Cast it with `.astype(jnp.int32)`."
    )
  if labels.shape[0] != batch_size:
    raise ValueError(
        f"`{name}` has length {labels.shape[0]} but the batch has "
        f"{batch_size} embeddings; they must match."
    )
  return labels.astype(jnp.int32)


def check_class_vectors(vectors, dim: int, name: str = "proxies") -> Array:
  """Checks a ``[C, D]`` float array of proxies / class weights / centers."""
  vectors = jnp.asarray(vectors)
  if vectors.ndim != 2:
    raise ValueError(
        f"`{name}` must have rank 2 ([num_classes, dim]); got shape "
        f"{vectors.shape}."
    )
  if not jnp.issubdtype(vectors.dtype, jnp.floating):
    raise TypeError(f"`{name}` must be a floating array; got {vectors.dtype}.")
  if vectors.shape[1] != dim:
    raise ValueError(
        f"`{name}` has dimension {vectors.shape[1]} but the embeddings have "
        f"dimension {dim}; they must match."
    )
  return vectors.astype(jnp.float32)


def check_similarity(similarity, labels, name: str = "similarity"):
  """Checks a square ``[B, B]`` similarity matrix and its ``[B]`` labels."""
  similarity = jnp.asarray(similarity)
  if similarity.ndim != 2 or similarity.shape[0] != similarity.shape[1]:
    raise ValueError(
        f"`{name}` must be a square [batch, batch] matrix; got shape "
        f"{similarity.shape}."
    )
  if not jnp.issubdtype(similarity.dtype, jnp.floating):
    raise TypeError(f"`{name}` must be a floating array; got {similarity.dtype}.")
  labels = check_labels(labels, similarity.shape[0])
  return similarity.astype(jnp.float32), labels


def check_mask(mask, shape, name: str):
  """Checks an optional ``[M, N]`` pair mask and returns it as bool (or None)."""
  if mask is None:
    return None
  mask = jnp.asarray(mask)
  if mask.shape != tuple(shape):
    raise ValueError(
        f"`{name}` must have the shape of the similarity matrix {tuple(shape)};"
        f" got {mask.shape}."
    )
  return mask.astype(bool)


def check_positive(value, name: str):
  """Checks (when concrete) that a hyperparameter is > 0."""
  if isinstance(value, (int, float)) and not value > 0:
    raise ValueError(f"`{name}` must be > 0; got {value}.")


# ----------------------------------------------------------------------------
# Similarities and distances.
# ----------------------------------------------------------------------------


def l2_normalize(x: Array, axis: int = -1) -> Array:
  """L2-normalises along ``axis`` in float32; zero vectors stay zero (finite grad).

  The vector is first divided by its largest absolute entry (a constant for
  differentiation: the result does not depend on it), so huge norms whose
  square would overflow float32 keep their direction.
  """
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  scale = jax.lax.stop_gradient(jnp.where(scale > 0, scale, 1.0))
  # Two steps: XLA may rewrite x / scale as x * (1 / scale), and 1 / scale is
  # flushed to zero for scale above ~8.5e37; 1 / sqrt(scale) never is.
  root = jnp.sqrt(scale)
  x = x / root / root
  sq = jnp.sum(x * x, axis=axis, keepdims=True)
  return x * jax.lax.rsqrt(jnp.maximum(sq, _NORM_EPS**2))


def cosine_similarity(a: Array, b: Array) -> Array:
  """``[M, D] x [N, D] -> [M, N]`` cosine similarities, float32."""
  return jnp.matmul(
      l2_normalize(a), l2_normalize(b).T, precision=jax.lax.Precision.HIGHEST
  )


def safe_sqrt(x: Array) -> Array:
  """sqrt with value 0 and gradient 0 at (numerically) zero arguments."""
  positive = x > _SQRT_EPS
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), 0.0)


def euclidean_from_cosine(similarity: Array) -> Array:
  """Euclidean distance between unit vectors: ``sqrt(2 - 2 cos)``."""
  return safe_sqrt(jnp.maximum(2.0 - 2.0 * similarity, 0.0))


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


def masked_logsumexp(x: Array, mask: Array, axis: int = -1) -> Array:
  """``log(sum(mask * exp(x)))`` along ``axis``; ``-inf`` (zero grad) if empty.

  Max-shifted, and never evaluates ``exp`` of a masked-out entry, so masked
  entries may hold any value (even inf or NaN-free huge numbers) without
  affecting the value or the gradient.
  """
  x = x.astype(jnp.float32)
  m = jnp.max(jnp.where(mask, x, -jnp.inf), axis=axis, keepdims=True)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  shifted = jnp.where(mask, x - m, -jnp.inf)
  s = jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True)
  return jnp.squeeze(log_of_shifted_sum(s, m), axis=axis)


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
      passes. Non-finite entries (empty sets) are replaced by 0.
    axis: the axis of the sets (default the last; Proxy-Anchor uses 0).

  Returns:
    ``(e, m_p, m_n)``: ``e`` has the shape of the logits, ``exp(logit - m)``
    with the maximum ``m`` of the entry's set, and 0 outside ``pos | neg``
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
  e = jnp.exp(jnp.where(pos | neg, z - jnp.where(pos, m_p, m_n), -jnp.inf))
  return e, m_p, m_n


def log_of_shifted_sum(s: Array, m: Array) -> Array:
  """``log(s) + m``; ``-inf`` (zero grad) for an empty set (``s == 0``).

  A non-empty set has ``s`` of about 1 or more: its maximum contributes
  ``exp(0)``, or slightly less when XLA recomputes that logit with other
  rounding (visible at large temperatures), so emptiness is tested as
  ``s == 0``, not against 1. A NaN sum stays NaN, so non-finite inputs are
  never mistaken for an empty set.
  """
  empty = s == 0
  return jnp.where(empty, -jnp.inf, jnp.log(jnp.where(empty, 1.0, s)) + m)


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


def log1p_sum_exp(x: Array, mask: Array, axis: int = -1) -> Array:
  """``log(1 + sum(mask * exp(x)))``: 0 with zero gradient when empty."""
  return jnp.logaddexp(0.0, masked_logsumexp(x, mask, axis=axis))


def masked_mean(x: Array, mask: Array, axis: int = -1) -> Array:
  """Mean of the masked entries along ``axis``; 0 (zero grad) when empty."""
  mask = mask.astype(jnp.float32)
  total = jnp.sum(jnp.where(mask > 0, x, 0.0) * mask, axis=axis)
  count = jnp.sum(mask, axis=axis)
  return total / jnp.maximum(count, 1.0)


# ----------------------------------------------------------------------------
# Global batch across devices.
# ----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def global_sum(x: Array, axis_name) -> Array:
  """``psum`` over ``axis_name`` whose backward pass is the identity.

  The loss of the global batch is ``sum_d l_d`` over devices. Its gradient with
  respect to ``l_d`` is 1 on every device; a plain ``psum`` transposes to
  another ``psum`` under ``jax.pmap`` (scaling gradients by the device count),
  while this one gives exact gradients under both ``pmap`` and ``shard_map``.
  """
  return jax.lax.psum(x, axis_name)


def _global_sum_fwd(x, axis_name):
  return jax.lax.psum(x, axis_name), None


def _global_sum_bwd(axis_name, _, ct):
  try:
    ct = jax.lax.pcast(ct, axis_name, to="varying")
  except (ValueError, TypeError, NotImplementedError):  # pmap: already varying
    pass
  return (ct,)


global_sum.defvjp(_global_sum_fwd, _global_sum_bwd)


def maybe_global_sum(x: Array, axis_name) -> Array:
  return x if axis_name is None else global_sum(x, axis_name)


def gather_global(x: Array, axis_name) -> Array:
  """All-gathers ``x`` along its leading axis (no-op without ``axis_name``).

  The gradient flows back to every device's shard (all_gather transposes to
  a reduce-scatter), so the global loss is differentiated exactly.
  """
  if axis_name is None:
    return x
  return jax.lax.all_gather(x, axis_name, axis=0, tiled=True)


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

