"""A global-batch pair loss over simulated devices, compiled and measured.

:func:`program`: ``jit(shard_map(value_and_grad(loss)))`` of a rule-based
loss with ``axis_name`` over the first ``devices`` devices (``B / devices``
anchors per device), the ``collective`` (``"all_gather"`` or ``"ring"``) and
engine (``block_size``) given; :func:`measure`: its per-device memory from
XLA's memory analysis (compiled only) and, when asked, its wall time.
Importing this module gives JAX 8 simulated CPU devices
(:mod:`experiments.bench.simulated_devices`). Used by
``experiments.bench.ring_memory`` and ``experiments.bench.contrastive``.
"""

from __future__ import annotations

from experiments.bench import simulated_devices  # noqa: F401  (before jax)

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import circle_jax.losses as cj
from experiments.bench import timing


def program(loss, collective, block_size, devices):
  """The jitted per-device forward+backward over ``devices``."""
  fn = getattr(cj, f"{loss}_loss")

  def local(x, labels):
    return jax.value_and_grad(lambda x: fn(
        x, labels, axis_name="d", block_size=block_size,
        collective=collective))(x)

  mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P("d")),
                               out_specs=(P(), P("d"))))


def measure(loss, batch, dim, collective, block_size, devices=8,
            run=False, repeats=3) -> dict:
  """Compiles one case (and runs it when ``run``); returns its figures."""
  shapes = (jax.ShapeDtypeStruct((batch, dim), jnp.float32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))
  f = program(loss, collective, block_size, devices)
  compiled = f.lower(*shapes).compile()
  mem = timing.compiled_memory(compiled)
  out = dict(loss=loss, batch=batch, dim=dim, collective=collective,
             block_size=block_size, devices=devices, peak=mem["peak"],
             temp=mem["temp"], run_s=None)
  if run:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, dim)), jnp.float32)
    labels = jnp.asarray(rng.permutation(np.arange(batch) // 4), jnp.int32)
    out["run_s"] = timing.median_s(lambda: compiled(x, labels), 1, repeats)
  return out
