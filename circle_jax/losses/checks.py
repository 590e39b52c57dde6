"""The losses' input checks: trace-time shape and dtype checks, and the
host-side label check.

Conventions used by every loss in :mod:`circle_jax.losses`:

* Embeddings are ``[B, D]`` float arrays (float32 or bfloat16). They are cast to
  float32 and L2-normalised inside (``l2_normalize`` is safe for zero vectors).
* Labels are integer arrays ``[B]``; the pair losses also take multi-hot
  ``[B, L]`` label sets (bool or 0/1), a pair then positive when the two
  sets intersect (:func:`circle_jax.losses.engine.tiles.same_labels`, the
  one comparison); the class-matrix losses refuse them
  (:func:`require_class_ids`).
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

Trace-time checks (``check_*``) are chex assertions re-raised as the
ValueError / TypeError that names the fix. The label check of the proxy and
class-level losses, :func:`validate_labels`, runs on the host: under ``jit`` a loss sees labels only as traced values, so it cannot raise on
a label outside ``[0, num_classes)``: such a label silently gives a wrong
result (``jnp`` indexing clamps or wraps it; the proxy losses' one-hot masks
drop the sample). :func:`validate_labels` is the
host-side (NumPy) check the data pipeline runs on every batch or once on the
whole label set, before the labels enter a compiled step.
"""

from __future__ import annotations

import numbers

import chex
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

_MAX_REPORTED = 10


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


def check_labels(labels, batch_size: int, name: str = "labels", *,
                 multi_hot: bool = False) -> Array:
  """Checks the labels of ``batch_size`` samples.

  Args:
    labels: ``[batch_size]`` integer class ids or, with ``multi_hot``, also
      ``[batch_size, L]`` multi-hot label sets (bool, or 0/1 integers).
    batch_size: the number of samples.
    name: the argument's name, for the messages.
    multi_hot: whether multi-hot labels are accepted (the pair losses';
      their pairs are compared by
      :func:`circle_jax.losses.engine.tiles.same_labels`). Without it a
      ``[B, L]`` array is refused by :func:`require_class_ids`.

  Returns:
    int32 ``[B]``, or bool ``[B, L]`` (multi-hot).
  """
  labels = jnp.asarray(labels)
  if labels.ndim == 2:
    if not multi_hot:
      require_class_ids(labels, "this loss", name)
    return _check_multi_hot(labels, batch_size, name)
  check_rank(labels, 1, f"`{name}` must have rank 1 ([batch]"
                        f"{', or [batch, L] multi-hot' if multi_hot else ''}); "
                        f"got shape {labels.shape}.")
  _check_integer(labels,
                 f"`{name}` must be an integer array of class ids; got dtype "
                 f"{labels.dtype}. Cast it with `.astype(jnp.int32)`.")
  _check_dim(labels, 0, batch_size,
             f"`{name}` has length {labels.shape[0]} but there are "
             f"{batch_size} embeddings; they must match.")
  return labels.astype(jnp.int32)


def is_multi_hot(labels) -> bool:
  """Whether checked labels are multi-hot ``[B, L]`` (not class ids)."""
  return jnp.ndim(labels) == 2


def require_class_ids(labels, what: str, name: str = "labels") -> None:
  """Refuses multi-hot labels where ``what`` needs one class per sample.

  A class-matrix loss (proxies, class weights, a per-class ``beta``) looks
  up one row per sample: a sample with several classes has no one row, and
  pytorch-metric-learning 2.9 defines no multi-label form of these losses.
  """
  if is_multi_hot(labels):
    raise ValueError(
        f"`{name}` is multi-hot {tuple(jnp.shape(labels))}, but {what} needs "
        "one class id per sample ([batch] ints: it reads one class row per "
        "sample); multi-hot labels are for the pair losses.")


def _check_multi_hot(labels, batch_size: int, name: str) -> Array:
  """A ``[B, L]`` bool or 0/1 integer label-set array, as bool."""
  if labels.dtype != jnp.bool_ and labels.shape[1] == 1:
    raise ValueError(
        f"`{name}` has shape {labels.shape}: an integer column reads as class "
        f"ids, not as one label set; pass `{name}[:, 0]` ([batch] class ids), "
        "or a bool [batch, 1] array for multi-hot label sets.")
  if labels.dtype != jnp.bool_:
    _check_integer(labels, f"`{name}` is [batch, L] multi-hot and must be "
                           f"bool or 0/1 integers; got dtype {labels.dtype}.")
    if not isinstance(labels, jax.core.Tracer):
      values = np.unique(np.asarray(labels)).tolist()
      if set(values) - {0, 1}:
        raise ValueError(
            f"`{name}` is [batch, L] multi-hot and must hold only 0 and 1; "
            f"got values {values[:5]}. Pass class ids as a [batch] vector.")
  _check_dim(labels, 0, batch_size,
             f"`{name}` has {labels.shape[0]} rows but there are {batch_size} "
             "embeddings; they must match.")
  if labels.shape[1] < 1:
    raise ValueError(f"`{name}` is multi-hot with no classes (shape "
                     f"{labels.shape}); give at least one column.")
  return labels.astype(bool)


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
  labels = check_labels(labels, similarity.shape[0], multi_hot=True)
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
# Host-side label check.
# ----------------------------------------------------------------------------


def validate_labels(labels, num_classes: int) -> np.ndarray:
  """Checks on the host that integer labels lie in ``[0, num_classes)``.

  Args:
    labels: an integer array of any shape (NumPy, JAX or a sequence), e.g.
      ``[B]`` or ``[devices, B]``. Must be concrete: call this outside
      ``jit``, in the data pipeline.
    num_classes: ``C``, the number of classes (rows of the proxies or class
      weights).

  Returns:
    The labels as a NumPy integer array (same shape), so the call can be
    chained: ``labels = validate_labels(labels, C)``.

  Raises:
    TypeError: ``labels`` is traced (inside ``jit``), or not of an integer
      dtype, or ``num_classes`` is not an integer.
    ValueError: ``num_classes`` < 1, or some labels are out of range; the
      message names the offending values and their positions.
  """
  if isinstance(labels, jax.core.Tracer):
    raise TypeError(
        "validate_labels is a host-side check and got a traced value; call it "
        "outside jit (in the data pipeline) on concrete labels."
    )
  if isinstance(num_classes, (bool, np.bool_)) or not isinstance(
      num_classes, numbers.Integral):
    raise TypeError(f"`num_classes` must be an int; got {num_classes!r}.")
  if num_classes < 1:
    raise ValueError(f"`num_classes` must be >= 1; got {num_classes}.")
  labels = np.asarray(labels)
  if labels.dtype == np.bool_ or not np.issubdtype(labels.dtype, np.integer):
    raise TypeError(
        f"`labels` must be an integer array of class ids; got dtype "
        f"{labels.dtype}. Cast it with `.astype(np.int32)`."
    )
  bad = (labels < 0) | (labels >= num_classes)
  if np.any(bad):
    positions = np.argwhere(bad)
    values = labels[bad]
    shown = min(len(values), _MAX_REPORTED)
    where = [tuple(int(i) for i in pos) if labels.ndim != 1 else int(pos[0])
             for pos in positions[:shown]]
    more = f" (and {len(values) - shown} more)" if len(values) > shown else ""
    raise ValueError(
        f"`labels` must lie in [0, {num_classes}); found {len(values)} "
        f"out-of-range label(s): values {sorted(set(values.tolist()))[:shown]} "
        f"at positions {where}{more}. Remap the labels to 0..{num_classes - 1} "
        f"or pass the right num_classes."
    )
  return labels
