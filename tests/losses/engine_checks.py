"""Shared checks of a loss on the engines: values and gradients under
``jit``, on 8 simulated devices under ``jax.shard_map``, central-difference
float64 gradients, and the tolerance that engines agree to.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from circle_jax import losses


def grad_ref(f, x, eps=1e-6):
  """Central differences of a float64 function of ``x``."""
  x = np.asarray(x, np.float64)
  g = np.zeros_like(x)
  for idx in np.ndindex(*x.shape):
    d = np.zeros_like(x)
    d[idx] = eps
    g[idx] = (f(x + d) - f(x - d)) / (2 * eps)
  return g


def mesh():
  """All devices on one axis, ``"d"``."""
  return Mesh(np.array(jax.devices()), ("d",))


def vg(fn, x, labels, **kw):
  """``jit(value_and_grad)`` of ``fn(x, labels, **kw)`` in ``x``."""
  return jax.jit(jax.value_and_grad(lambda x: fn(x, labels, **kw)))(x)


def sharded_vg(fn, x, labels, *masks, **kw):
  """:func:`vg` with ``axis_name="d"``, the batch (and the rows of the
  ``(pos_mask, neg_mask)`` given) split over the devices."""
  def local(x, labels, *masks):
    mk = dict(zip(("pos_mask", "neg_mask"), masks))
    return jax.value_and_grad(
        lambda x: fn(x, labels, axis_name="d", **mk, **kw))(x)
  return jax.jit(jax.shard_map(
      local, mesh=mesh(), in_specs=(P("d"),) * (2 + len(masks)),
      out_specs=(P(), P("d"))))(x, labels, *masks)


def with_references(fn, x, labels, mem, mem_labels, **hyper):
  """``(dense, blockwise, ring)``: the value and the gradients in ``x`` and
  ``mem`` of ``fn`` with ``ref=Candidates(mem, mem_labels)``, on one device
  (block size 3 for the blockwise engine) and on the ring of all devices."""
  def run(x, labels, mem, mem_labels, **kw):
    return jax.value_and_grad(lambda x, mem: fn(
        x, labels, ref=losses.Candidates(mem, mem_labels), **hyper, **kw),
        argnums=(0, 1))(x, mem)

  args = (x, labels, jnp.asarray(mem), jnp.asarray(mem_labels))
  ring = jax.shard_map(
      functools.partial(run, axis_name="d", collective="ring", block_size=3),
      mesh=mesh(), in_specs=(P("d"),) * 4,
      out_specs=(P(), (P("d"), P("d"))))
  return (jax.jit(run)(*args),
          jax.jit(functools.partial(run, block_size=3))(*args),
          jax.jit(ring)(*args))


def close(got, want, rtol=2e-5, grad_atol=5e-5):
  """Two ``(value, gradient)`` pairs agree to float32 rounding (the
  gradient's ``atol`` relative to its largest entry)."""
  scale = float(np.max(np.abs(np.asarray(want[1])))) or 1.0
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=rtol,
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]),
                             rtol=1e-4, atol=grad_atol * scale)


def jitted(fn):
  """``fn`` compiled as one program (keyword arguments closed over): far
  cheaper than op-by-op eager execution on the shared CI cores."""
  def call(*args, **kwargs):
    return jax.jit(lambda *a: fn(*a, **kwargs))(*args)
  return call
