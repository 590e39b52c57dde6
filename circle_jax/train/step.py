"""The per-device train step with a named axis, and its parallel wrappers.

One function, :func:`train_step`, is written for one device holding a slice of
the global batch. The loss receives ``axis_name`` and returns the loss of the
*global* batch on every device, with exact gradients w.r.t. the local
embeddings (``circle_jax.ops.global_sum``). What differs between
the wrappers is how gradients w.r.t. the replicated parameters come out:

* ``jax.shard_map`` (the default) tracks which values vary across devices.
  Parameters enter replicated (``P()``); the transpose of their implicit
  broadcast to the per-device computation is a ``psum``, so the parameter
  gradient is already the sum over devices. Summing again would multiply it
  by the device count.
* ``jax.pmap`` has no such tracking: each device holds its own partial
  gradient, and the step ``psum``s it.

``tests/train/test_step.py`` checks numerically that one device, ``shard_map``
and ``pmap`` reach the same parameters after several steps on the same global
batch.

BatchNorm statistics are computed per device (like PyTorch without SyncBN) and
averaged over devices after each step, so the stored statistics stay
replicated.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import flax.jax_utils
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from circle_jax import ops
from circle_jax.train.state import TrainState

PyTree = Any
AXIS = "data"
MODES = ("shard_map", "pmap", "none")

# loss_fn(embeddings [b, D], labels [b], loss_params, *, key, axis_name) -> scalar
LossFn = Callable[..., jax.Array]


def make_loss_fn(entry, hyper: Optional[dict] = None) -> LossFn:
  """Adapts a ``circle_jax.losses`` registry entry to the step's loss signature.

  Args:
    entry: a ``circle_jax.losses.LossEntry`` (``apply``, ``param_name``,
      ``supports_axis_name``).
    hyper: the loss hyperparameters (keyword arguments of ``entry.apply``).

  Returns:
    ``loss_fn(embeddings, labels, loss_params, *, key, axis_name)``. Losses
    that cannot see the global batch are averaged over devices (the gradient
    of that mean is exact under both wrappers, via ``global_sum``).
  """
  hyper = dict(hyper or {})

  def loss_fn(embeddings, labels, loss_params, *, key, axis_name):
    params = None
    if entry.param_name is not None:
      params = loss_params[entry.param_name]
    if entry.supports_axis_name or axis_name is None:
      return entry.apply(embeddings, labels, params, key=key,
                         axis_name=axis_name, **hyper)
    local = entry.apply(embeddings, labels, params, key=key, **hyper)
    return ops.global_sum(local, axis_name) / jax.lax.psum(1, axis_name)

  return loss_fn


def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.stack(leaves).all() if leaves else jnp.array(True)


def train_step(
    state: TrainState,
    batch: dict,
    *,
    loss_fn: LossFn,
    base_key: jax.Array,
    axis_name: Optional[str] = None,
    psum_grads: bool = False,
):
  """One optimisation step on this device's slice of the global batch.

  Args:
    state: the (replicated) :class:`TrainState`.
    batch: ``{'image': [b, H, W, C], 'label': [b] int}``, this device's slice.
    loss_fn: see :func:`make_loss_fn`.
    base_key: PRNG key; the loss key of step ``t`` is ``fold_in(base_key, t)``,
      the same on every device.
    axis_name: the device axis (None on one device).
    psum_grads: sum parameter gradients over ``axis_name`` (``pmap`` only; see
      the module docstring).

  Returns:
    ``(new_state, metrics)`` with scalar metrics ``loss`` (global batch),
    ``grad_norm`` and ``finite`` (loss and all gradients finite). The state is
    updated even when ``finite`` is False; the loop stops at the next check
    and never saves it.
  """
  key = jax.random.fold_in(base_key, state.step)

  def objective(params):
    variables = {"params": params["model"]}
    if state.batch_stats:
      variables["batch_stats"] = state.batch_stats
      embeddings, updates = state.apply_fn(
          variables, batch["image"], train=True, mutable=["batch_stats"])
      new_stats = updates.get("batch_stats", state.batch_stats)
    else:
      embeddings = state.apply_fn(variables, batch["image"], train=True)
      new_stats = state.batch_stats
    loss = loss_fn(embeddings, batch["label"], params["loss"], key=key,
                   axis_name=axis_name)
    return loss, new_stats

  (loss, new_stats), grads = jax.value_and_grad(objective, has_aux=True)(
      state.params)
  if axis_name is not None:
    if psum_grads:
      grads = jax.lax.psum(grads, axis_name)
    new_stats = jax.lax.pmean(new_stats, axis_name)
  finite = jnp.isfinite(loss) & _all_finite(grads)
  new_state = state.apply_gradients(grads=grads, batch_stats=new_stats)
  metrics = {
      "loss": loss.astype(jnp.float32),
      "grad_norm": optax.global_norm(grads),
      "finite": finite,
  }
  return new_state, metrics


# ----------------------------------------------------------------------------
# Parallel wrappers.
# ----------------------------------------------------------------------------


def make_mesh(devices=None) -> Mesh:
  """A 1-D mesh over all (global) devices with axis ``'data'``."""
  devices = jax.devices() if devices is None else devices
  return Mesh(np.asarray(devices), (AXIS,))


def make_train_step(loss_fn: LossFn, *, mode: str, base_key: jax.Array,
                    mesh: Optional[Mesh] = None, donate: bool = True):
  """The compiled step for a parallelism ``mode``.

  Args:
    loss_fn: see :func:`make_loss_fn`.
    mode: ``shard_map`` (state replicated on ``mesh``, batch a global array
      sharded on its first axis), ``pmap`` (state with a leading device axis,
      batch ``[local_devices, b, ...]``) or ``none`` (one device, no axis).
    base_key: PRNG key of the loss (see :func:`train_step`).
    mesh: the 1-D mesh for ``shard_map`` (default: all devices).
    donate: donate the input state's buffers.

  Returns:
    ``step(state, batch) -> (state, metrics)``.
  """
  if mode not in MODES:
    raise ValueError(f"Unknown `parallelism` {mode!r}; use one of {MODES}.")
  donate_argnums = (0,) if donate else ()
  if mode == "none":
    fn = functools.partial(train_step, loss_fn=loss_fn, base_key=base_key)
    return jax.jit(fn, donate_argnums=donate_argnums)
  if mode == "pmap":
    fn = functools.partial(train_step, loss_fn=loss_fn, base_key=base_key,
                           axis_name=AXIS, psum_grads=True)
    return jax.pmap(fn, axis_name=AXIS, donate_argnums=donate_argnums)
  mesh = make_mesh() if mesh is None else mesh
  fn = functools.partial(train_step, loss_fn=loss_fn, base_key=base_key,
                         axis_name=AXIS, psum_grads=False)
  fn = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(AXIS)),
                     out_specs=(P(), P()))
  return jax.jit(fn, donate_argnums=donate_argnums)


def embed_fn(apply_fn, *, mesh: Optional[Mesh] = None):
  """Jitted ``(variables, images) -> embeddings`` in eval mode (float32).

  With ``mesh``, images are a global array sharded on the batch axis and the
  variables replicated; XLA partitions the forward pass over the devices.
  """
  def f(variables, images):
    return apply_fn(variables, images, train=False).astype(jnp.float32)

  if mesh is None:
    return jax.jit(f)
  return jax.jit(
      f, in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))),
      out_shardings=NamedSharding(mesh, P(AXIS)))


# ----------------------------------------------------------------------------
# Placement of the state and the batches for each mode.
# ----------------------------------------------------------------------------


def replicate(tree: PyTree, *, mode: str, mesh: Optional[Mesh] = None):
  """Places a host tree (identical on every process) for ``mode``'s step."""
  if mode == "none":
    return jax.device_put(tree, jax.local_devices()[0])
  if mode == "pmap":
    return flax.jax_utils.replicate(jax.tree.map(np.asarray, tree))
  sharding = NamedSharding(make_mesh() if mesh is None else mesh, P())

  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  return jax.tree.map(put, tree)


def to_host(tree: PyTree, *, mode: str) -> PyTree:
  """One host (numpy) copy of a replicated tree, on every process."""
  def get(x):
    if not isinstance(x, jax.Array):
      return np.asarray(x)
    local = np.asarray(x.addressable_data(0))
    return local[0] if mode == "pmap" else local

  return jax.tree.map(get, tree)


def shard_batch(local_batch: dict, *, mode: str, mesh: Optional[Mesh] = None):
  """This process' slice of the global batch -> the step's batch argument.

  Args:
    local_batch: numpy arrays with this process' ``global_batch /
      process_count`` examples (process ``p`` holds examples ``p*n .. p*n+n-1``).
    mode: the parallelism mode.
    mesh: the ``shard_map`` mesh.

  Returns:
    ``shard_map``: global ``jax.Array``s sharded on the batch axis;
    ``pmap``: numpy ``[local_devices, n / local_devices, ...]``;
    ``none``: the numpy batch itself.
  """
  if mode == "none":
    return local_batch
  if mode == "pmap":
    n = jax.local_device_count()
    return jax.tree.map(lambda x: x.reshape((n, -1) + x.shape[1:]),
                        local_batch)
  sharding = NamedSharding(make_mesh() if mesh is None else mesh, P(AXIS))
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, x),
      local_batch)


def first_replica(tree: PyTree, *, mode: str) -> PyTree:
  """The metrics of a step as one copy (still on device, not fetched)."""
  if mode == "pmap":
    return jax.tree.map(lambda x: x[0], tree)
  return tree
