"""Reductions of per-anchor terms over the (global) batch.

With ``axis_name`` every sum runs over the devices with exact gradients
(:func:`circle_jax.ops.maybe_global_sum`): the value is that of the global
batch on every device and the gradient with respect to the local terms that
of the single-device loss on the concatenated batch. Counts carry no
gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from circle_jax import ops

Array = jax.Array


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

