"""Shared checks of the losses ported from pytorch-metric-learning 2.9 (PML):
PML's float64 value and gradients, ours on every engine, random batches.

PML is a test-only dependency: a test module that uses these imports it
with ``pytest.importorskip``.
"""

import functools

import jax.numpy as jnp
import numpy as np

from tests.losses import engine_checks

# 16 samples (2 on each of the 8 simulated devices): 5 classes of 3 and a
# singleton, so one anchor has no positive.
LABELS = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5])


def batch(seed=0, n=16, d=8):
  """A random float64 ``[n, d]`` batch."""
  return np.random.default_rng(seed).normal(size=(n, d))


def pml_vg(loss, x, labels, ref=None, ref_labels=None, indices_tuple=None):
  """PML's float64 value and gradients: ``(value, dx)`` or, with ``ref``,
  ``(value, (dx, dref))``."""
  import torch
  xt = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
  yt = torch.tensor(np.asarray(labels), dtype=torch.int64)
  kw = {}
  if ref is not None:
    rt = torch.tensor(np.asarray(ref, np.float64), requires_grad=True)
    kw = {"ref_emb": rt,
          "ref_labels": torch.tensor(np.asarray(ref_labels),
                                     dtype=torch.int64)}
  value = loss(xt, yt, indices_tuple, **kw)
  if value.requires_grad:
    value.backward()
  dx = (xt.grad if xt.grad is not None else torch.zeros_like(xt)).numpy()
  if ref is None:
    return float(value.detach()), dx
  dr = (rt.grad if rt.grad is not None else torch.zeros_like(rt)).numpy()
  return float(value.detach()), (dx, dr)


def vg(fn, x, labels, **kw):
  """Our jitted value and gradient in ``x`` (float32 compute)."""
  return engine_checks.vg(fn, jnp.asarray(x, jnp.float32),
                          jnp.asarray(labels), **kw)


def close(got, want, rtol=2e-5, grad_atol=5e-5):
  """:func:`engine_checks.close` for ``(value, gradient)`` pairs whose
  gradient may be a tuple of arrays."""
  gg, gw = got[1], want[1]
  if not isinstance(gw, tuple):
    gg, gw = (gg,), (gw,)
  for a, b in zip(gg, gw, strict=True):
    engine_checks.close((got[0], a), (want[0], b), rtol=rtol,
                        grad_atol=grad_atol)


def engines(fn, x, labels, **hyper):
  """``{engine: (value, dx)}``: dense, blockwise (block 3), and on 8 devices
  with all-gathered columns and on the ring (blockwise inside)."""
  x, labels = jnp.asarray(x, jnp.float32), jnp.asarray(labels)
  return {
      "dense": engine_checks.vg(fn, x, labels, **hyper),
      "blockwise": engine_checks.vg(fn, x, labels, block_size=3, **hyper),
      "all_gather": engine_checks.sharded_vg(fn, x, labels, **hyper),
      "ring": engine_checks.sharded_vg(fn, x, labels, collective="ring",
                                       block_size=3, **hyper),
  }


def masked(fn, x, labels, pos_mask, neg_mask, **hyper):
  """``(dense, blockwise, 8 devices on the ring)`` with miner masks."""
  x, labels = jnp.asarray(x, jnp.float32), jnp.asarray(labels)
  pm, nm = jnp.asarray(pos_mask), jnp.asarray(neg_mask)
  run = functools.partial(engine_checks.vg, fn, x, labels, pos_mask=pm,
                          neg_mask=nm, **hyper)
  return (run(), run(block_size=3),
          engine_checks.sharded_vg(fn, x, labels, pm, nm, collective="ring",
                                   block_size=3, **hyper))


def with_references(fn, x, labels, mem, mem_labels, **hyper):
  """:func:`engine_checks.with_references` on float32 inputs."""
  return engine_checks.with_references(
      fn, jnp.asarray(x, jnp.float32), jnp.asarray(labels),
      jnp.asarray(mem, jnp.float32), jnp.asarray(mem_labels), **hyper)


def sharded_dense(fn, x, labels, **hyper):
  """A dense-only loss on 8 devices with all-gathered columns."""
  return engine_checks.sharded_vg(fn, jnp.asarray(x, jnp.float32),
                                  jnp.asarray(labels), **hyper)


def pairs_of(pos_mask, neg_mask):
  """PML's ``indices_tuple`` ``(a1, p, a2, n)`` of two boolean masks."""
  import torch
  a1, p = np.nonzero(pos_mask)
  a2, n = np.nonzero(neg_mask)
  return tuple(torch.tensor(v, dtype=torch.int64) for v in (a1, p, a2, n))


def zero_everywhere(fn, x, labels, **hyper):
  """Asserts value 0 and gradient 0 on every engine."""
  for name, (value, grad) in engines(fn, x, labels, **hyper).items():
    assert float(value) == 0.0, name
    np.testing.assert_array_equal(np.asarray(grad), 0.0, err_msg=name)



def ball_distances(x, ball):
  """Float64 Poincaré distances of ``x`` on ``ball`` (Hyp-ViT's Möbius
  formula, as tests/losses/engine/test_geometry.py)."""
  from tests.losses.reference import mobius_distance_ref
  from tests.losses.reference import poincare_ref
  z = poincare_ref(np.asarray(x, np.float32), ball.c, ball.r)
  d = mobius_distance_ref(z, z, ball.c)
  np.fill_diagonal(d, 0.0)
  return d
