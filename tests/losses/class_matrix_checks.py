"""Shared checks of the class-matrix losses added for issue #40: the class
matrix sharded over 8 simulated devices (with padding rows, classes absent
from the batch) and the batch alone sharded both equal the whole loss on one
device, in value and in the gradients w.r.t. the embeddings and the class
rows; and PML 2.9's value and gradients against ours."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from circle_jax import losses

N = 8             # simulated devices (tests/conftest.py)
B, D = 16, 8      # global batch: 2 samples per device
C = 13            # ceil(13 / 8) = 2 rows per device, 3 padding rows
LABELS = np.array([0, 0, 1, 2, 2, 4, 5, 5, 6, 8, 8, 9, 10, 12, 12, 1],
                  np.int32)  # classes 3, 7 and 11 absent
X = np.random.default_rng(0).normal(size=(B, D)).astype(np.float32)
W = np.random.default_rng(1).normal(size=(C, D)).astype(np.float32)


def _grads(fn, hyper):
  return jax.value_and_grad(functools.partial(fn, **hyper), argnums=(0, 2))


def check_sharded_equals_whole(fn, **hyper):
  """``fn`` with ``shard_classes`` (shard_map) and with the batch alone
  sharded (pmap) equals ``fn`` on one device with the whole matrix."""
  ref_v, (ref_gx, ref_gw) = jax.jit(_grads(fn, hyper))(X, LABELS, W)
  assert np.abs(ref_gw).max() > 0 and np.abs(ref_gx).max() > 0
  mesh = Mesh(np.array(jax.devices()), ("d",))
  rows = losses.pad_rows(jnp.asarray(W), N)  # [8, 2, D]
  local = _grads(fn, dict(hyper, axis_name="d", shard_classes=True,
                          num_classes=C))
  v, (gx, gw) = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P("d"), P("d"), P("d")),
      out_specs=(P(), (P("d"), P("d")))))(X, LABELS, rows.reshape(-1, D))
  np.testing.assert_allclose(v, ref_v, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(gx, ref_gx, rtol=1e-4, atol=1e-6)
  want = np.asarray(losses.pad_rows(ref_gw, N))
  np.testing.assert_allclose(np.asarray(gw).reshape(want.shape), want,
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(gw)[-3:], 0.0)  # padding rows
  batch = _grads(fn, dict(hyper, axis_name="d"))
  v, (gx, gw) = jax.pmap(batch, axis_name="d", in_axes=(0, 0, None))(
      X.reshape(N, -1, D), LABELS.reshape(N, -1), W)
  np.testing.assert_array_equal(v, np.full(N, v[0]))
  np.testing.assert_allclose(v[0], ref_v, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(gx).reshape(B, D), ref_gx,
                             rtol=1e-4, atol=1e-6)
  # Under pmap each device holds its share of the replicated rows' gradient.
  np.testing.assert_allclose(np.asarray(gw).sum(0), ref_gw, rtol=1e-4,
                             atol=1e-6)


def pml_value_and_grads(loss, x, labels, weight, weight_attr="W"):
  """PML's value and gradients in float64: ``loss`` a PML loss whose ``[D,
  C]`` matrix ``weight_attr`` is set to ``weight.T`` (``weight`` [C, D])."""
  import torch  # pylint: disable=import-outside-toplevel
  loss = loss.double()
  getattr(loss, weight_attr).data = torch.tensor(
      np.asarray(weight, np.float64).T.copy())
  xt = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
  value = loss(xt, torch.tensor(np.asarray(labels, np.int64)))
  value.backward()
  gw = getattr(loss, weight_attr).grad.numpy().T
  return value.item(), xt.grad.numpy(), gw


def ours_value_and_grads(fn, x, labels, weight, **hyper):
  """Our value and gradients w.r.t. the embeddings and the class matrix."""
  v, (gx, gw) = jax.jit(_grads(fn, hyper))(
      jnp.asarray(x, jnp.float32), jnp.asarray(labels, jnp.int32),
      jnp.asarray(weight, jnp.float32))
  return float(v), np.asarray(gx), np.asarray(gw)


def assert_close_to_pml(ours, pml, rtol):
  """Values to ``rtol``; gradients to ``rtol`` of their largest entry."""
  np.testing.assert_allclose(ours[0], pml[0], rtol=rtol)
  for a, b in zip(ours[1:], pml[1:]):
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * np.abs(b).max())
