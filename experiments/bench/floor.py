"""The matmul floor of the loss benchmarks.

``FLOOR``: forward and backward of the bare similarity matmul ``S = X Y^T``
(3 matmuls: ``S``, ``dX = dS Y``, ``dY = dS^T X``, with ``dS = S`` so nothing
can be simplified away), in float32 like the losses' compute, jitted. A
loss's time over the floor's on the same inputs is the ratio the benchmarks
report (``experiments.bench.losses``, ``experiments.bench.contrastive``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def floor_fn(x, y):
  """0.5 ||X Y^T||^2 in float32: forward S = X Y^T, backward dS Y and dS^T X."""
  s = jnp.matmul(x.astype(jnp.float32), y.astype(jnp.float32).T,
                 precision=jax.lax.Precision.HIGHEST)
  return 0.5 * jnp.sum(s * s)


FLOOR = jax.jit(jax.value_and_grad(floor_fn, argnums=(0, 1)))
