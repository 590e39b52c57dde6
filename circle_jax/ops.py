"""Shared numerical building blocks of circle_jax (public).

The losses, the embedding head, the clustering metrics and the training step
use these instead of their own copies:

* :func:`l2_normalize` and :func:`cosine_similarity`: float32, safe for zero
  vectors and for norms whose square overflows;
* :func:`euclidean_from_cosine` / :func:`safe_sqrt`: distances between unit
  vectors with a finite gradient at 0;
* masked reductions (:func:`masked_logsumexp`, :func:`log1p_sum_exp`,
  :func:`masked_mean`) that never exponentiate a masked-out entry and give 0
  gradient on empty sets, and :func:`nonpositive` for the shifted logits
  they exponentiate, and :func:`two_set_exp` (both label sets of each row
  in one ``exp`` pass);
* the global batch across devices: :func:`global_sum` (a ``psum`` whose
  backward pass is the identity, exact under ``jax.shard_map`` and
  ``jax.pmap``) and :func:`gather_global`.
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
# Normalisation, similarities and distances.
# ----------------------------------------------------------------------------


def l2_normalize(x: Array, axis: int = -1) -> Array:
  """L2-normalises along ``axis`` in float32; zero vectors stay zero (finite grad).

  The vector is first divided by its largest absolute entry (a constant for
  differentiation: the result does not depend on it), so huge norms whose
  square would overflow float32 keep their direction.

  Args:
    x: float array of any shape.
    axis: the axis of the vectors.

  Returns:
    float32 array of ``x``'s shape with unit (or zero) vectors along ``axis``.
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
# Numerically safe masked reductions.
# ----------------------------------------------------------------------------


def nonpositive(d: Array) -> Array:
  """``min(d, 0)`` in value, with the gradient of ``d`` (straight-through).

  A logit minus its set's maximum is ``<= 0`` mathematically, but XLA may
  compute the maximum and the logit in different fusions with different
  rounding (e.g. a contracted multiply-add in one of them), so the
  difference can be positive by a few ulps of the logit: about ``600`` for
  a logit of ``1e10``, and ``exp`` overflows. Clamping the value at 0 bounds
  every shifted ``exp`` by 1 and is exact whenever ``d <= 0``; the gradient
  is ``d``'s, so a clamped entry still gets its softmax weight.

  Args:
    d: shifted logits (any shape).

  Returns:
    ``d - stop_gradient(max(d, 0))``.
  """
  return d - jax.lax.stop_gradient(jnp.maximum(d, 0.0))


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


def masked_logsumexp(x: Array, mask: Array, axis: int = -1,
                     axis_name=None) -> Array:
  """``log(sum(mask * exp(x)))`` along ``axis``; ``-inf`` (zero grad) if empty.

  Max-shifted, and never evaluates ``exp`` of a masked-out entry, so masked
  entries may hold any value without affecting the value or the gradient.

  With ``axis_name`` the reduced axis is split over that mapped axis (each
  device holds some of the entries, e.g. its rows of a sharded class matrix):
  the shift is the global maximum (``pmax``, no gradient) and the shifted
  sums are added with :func:`global_sum`, so the result is the log-sum-exp of
  all devices' entries, the same on every device, with exact gradients for
  each device's own entries (the model-parallel softmax of PartialFC).
  """
  x = x.astype(jnp.float32)
  m = jnp.max(jnp.where(mask, x, -jnp.inf), axis=axis, keepdims=True)
  m = jax.lax.stop_gradient(m)
  if axis_name is not None:
    m = jax.lax.pmax(m, axis_name)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  shifted = jnp.where(mask, nonpositive(x - m), -jnp.inf)
  s = maybe_global_sum(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True),
                       axis_name)
  return jnp.squeeze(log_of_shifted_sum(s, m), axis=axis)


def log1p_sum_exp(x: Array, mask: Array, axis: int = -1) -> Array:
  """``log(1 + sum(mask * exp(x)))``: 0 with zero gradient when empty."""
  return jnp.logaddexp(0.0, masked_logsumexp(x, mask, axis=axis))


def masked_mean(x: Array, mask: Array, axis: int = -1) -> Array:
  """Mean of the masked entries along ``axis``; 0 (zero grad) when empty."""
  mask = mask.astype(jnp.float32)
  total = jnp.sum(jnp.where(mask > 0, x, 0.0) * mask, axis=axis)
  count = jnp.sum(mask, axis=axis)
  return total / jnp.maximum(count, 1.0)


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


# ----------------------------------------------------------------------------
# Global batch across devices.
# ----------------------------------------------------------------------------


def axis_names(axis_name) -> Tuple:
  """``axis_name`` as a tuple of axis names (one name, or several)."""
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _global_sum(x, axis_name, varying_axes):
  del varying_axes
  return jax.lax.psum(x, axis_name)


def _global_sum_fwd(x, axis_name, varying_axes):
  del varying_axes
  return jax.lax.psum(x, axis_name), None


def _global_sum_bwd(axis_name, varying_axes, _, ct):
  del axis_name
  # The cotangent of x has x's type: varying over the axes x varied over.
  if varying_axes:
    ct = jax.lax.pcast(ct, varying_axes, to="varying")
  return (ct,)


_global_sum.defvjp(_global_sum_fwd, _global_sum_bwd)


def varying_axes(x) -> frozenset:
  """The mapped axes over which ``x``'s type says it varies (shard_map;
  empty under pmap and outside a mapped function)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if manual is not None:
    return manual.varying
  return getattr(aval, "vma", frozenset())  # earlier jax


def vary_as(x: Array, *refs: Array) -> Array:
  """``x`` typed device-varying over every mapped axis that any of ``refs``
  varies over (``jax.lax.pcast``, whose transpose sums the cotangent over
  those axes).

  Autodiff inserts this cast itself where an invariant value meets a
  varying one; a ``custom_vjp`` must receive its inputs already cast,
  since its backward pass has to return each cotangent with its input's
  type. Under ``jax.pmap`` and outside a mapped function nothing varies and
  ``x`` is returned as is.
  """
  varying = frozenset().union(*(varying_axes(r) for r in refs))
  missing = tuple(sorted(varying - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def global_sum(x: Array, axis_name) -> Array:
  """``psum`` over ``axis_name`` whose backward pass is the identity.

  The loss of the global batch is ``sum_d l_d`` over devices. Its gradient
  with respect to ``l_d`` is 1 on every device; a plain ``psum`` transposes to
  another ``psum`` under ``jax.pmap`` (scaling gradients by the device count),
  while this one gives exact gradients under both ``jax.pmap`` and
  ``jax.shard_map``.

  The context is read from ``x``'s type at trace time, not probed: inside
  ``jax.shard_map`` (with its default type checking) ``x`` is device-varying
  over the mapped axes and the backward pass casts the cotangent back to
  varying over exactly those axes; under ``jax.pmap`` (or
  ``shard_map(check_vma=False)``) the type records no varying axis and the
  cotangent is returned as is.

  Args:
    x: this device's partial value.
    axis_name: the mapped axis name (or a tuple of names).

  Returns:
    The sum over the axis, identical on every device.
  """
  varying = varying_axes(x)
  return _global_sum(x, axis_name,
                     tuple(a for a in axis_names(axis_name) if a in varying))


def maybe_global_sum(x: Array, axis_name) -> Array:
  """:func:`global_sum` over ``axis_name``, or ``x`` itself when it is None."""
  return x if axis_name is None else global_sum(x, axis_name)


def gather_global(x: Array, axis_name) -> Array:
  """All-gathers ``x`` along its leading axis (no-op without ``axis_name``).

  The gradient flows back to every device's shard (all_gather transposes to
  a reduce-scatter), so the global loss is differentiated exactly.
  """
  if axis_name is None:
    return x
  return jax.lax.all_gather(x, axis_name, axis=0, tiled=True)
