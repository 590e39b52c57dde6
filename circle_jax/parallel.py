"""Device placement: where the state, the batches and the evaluation live.

One :class:`Placement` per parallelism mode, chosen once from
``config.parallelism`` by :func:`get_placement`; nothing else in the package
names a mode. Each placement knows how to

* put a host tree (identical on every process) on the devices
  (:meth:`~Placement.replicate`) and this process' slice of a global batch
  (:meth:`~Placement.shard_batch`),
* bring a replicated tree back to the host (:meth:`~Placement.to_host`) and
  take one copy of a step's metrics (:meth:`~Placement.first_replica`),
* compile the per-device train step (:meth:`~Placement.wrap_step`) and the
  eval-mode forward pass (:meth:`~Placement.embed_fn`), and gather its
  outputs on every process (:meth:`~Placement.gather`).

The modes:

* :class:`ShardMap` (``"shard_map"``, the default): the state replicated on a
  1-D mesh over all devices, the batch a global array sharded on its first
  axis; the step is ``jax.shard_map``. Parameters enter replicated, so the
  transpose of their implicit broadcast already sums the parameter gradients
  over devices (summing again would multiply them by the device count).
* :class:`Pmap` (``"pmap"``): every array with a leading local-device axis;
  the step is ``jax.pmap`` and ``psum``s the parameter gradients itself.
* :class:`SingleDevice` (``"none"``): the first local device, no axis.

State leaves may be *sharded* instead of replicated: split by rows over the
devices (each holds ``rows / n``), e.g. the cross-batch memory
(:mod:`circle_jax.train.xbm`) and a sharded class matrix with its optimiser
state (:mod:`circle_jax.train.class_rows`, whose parameter gradients the step
then neither sums nor expects summed). :meth:`~Placement.replicate`,
:meth:`~Placement.to_host` and :meth:`~Placement.wrap_step` take a
``sharded(key_path) -> bool`` predicate naming them (None: every leaf
replicated); the step then sees its device's rows, on one device all of them.

Evaluation uses the run's placement: a pmap run embeds with ``pmap``, a
one-device run on one device. ``tests/test_parallel.py`` checks the round
trips of each mode and that they embed alike; ``tests/train/test_step.py``
that their train steps reach the same parameters.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

PyTree = Any
# sharded(key path of a leaf) -> whether the leaf is split by rows.
Sharded = Optional[Callable[[Any], bool]]
AXIS = "data"
MODES = ("shard_map", "pmap", "none")


def _float32(apply_fn):
  def f(variables, images):
    return apply_fn(variables, images).astype(jnp.float32)
  return f


class Placement:
  """The interface of the three modes (see the module docstring).

  Attributes:
    mode: the ``config.parallelism`` name of this placement.
    axis_name: the device axis of collectives (losses, sync BN), or None.
    psum_grads: whether the step must ``psum`` the parameter gradients.
  """

  mode: str = ""
  axis_name: Optional[str] = AXIS
  psum_grads: bool = False

  @property
  def num_devices(self) -> int:
    """The devices a global batch is split over (all processes)."""
    raise NotImplementedError

  def replicate(self, tree: PyTree, sharded: Sharded = None) -> PyTree:
    """Places a host tree (identical on every process) for the step.

    Args:
      tree: host arrays.
      sharded: the leaves split by rows over the devices (see the module
        docstring; their first axis must be a multiple of the devices).
    """
    raise NotImplementedError

  def shard_batch(self, local_batch: PyTree) -> PyTree:
    """This process' slice of a global batch -> the step's batch argument.

    Process ``p`` holds examples ``p*n .. p*n+n-1`` of the global batch.
    """
    raise NotImplementedError

  def to_host(self, tree: PyTree, sharded: Sharded = None) -> PyTree:
    """One host (numpy) copy of a replicated tree, on every process.

    ``sharded`` leaves (see :meth:`replicate`) come back whole.
    """
    def get(path, x):
      if not isinstance(x, jax.Array):
        return np.asarray(x)
      if sharded is not None and sharded(path):
        return self._whole(x)
      return self._one_copy(np.asarray(x.addressable_data(0)))
    return jax.tree_util.tree_map_with_path(get, tree)

  def _one_copy(self, local: np.ndarray) -> np.ndarray:
    """The replica in a local device's shard of a replicated array."""
    return local

  def _whole(self, x: jax.Array) -> np.ndarray:
    """A row-sharded array, all rows, on every process."""
    if jax.process_count() > 1:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)

  def first_replica(self, tree: PyTree) -> PyTree:
    """A step's metrics as one copy (still on device, not fetched)."""
    return tree

  def wrap_step(self, fn: Callable, *, donate: bool = True,
                sharded: Sharded = None) -> Callable:
    """Compiles ``fn(state, batch, *, axis_name, psum_grads)`` for this mode.

    Returns ``step(state, batch)`` taking :meth:`replicate`'d states (with
    the same ``sharded``) and :meth:`shard_batch`'d batches; ``fn`` sees this
    device's rows of the ``sharded`` leaves.
    """
    raise NotImplementedError

  def embed_fn(self, apply_fn: Callable) -> Callable:
    """``(replicated variables, sharded images) -> outputs`` (float32).

    Args:
      apply_fn: ``apply_fn(variables, images) -> [b, ...]``, the model in
        eval mode (e.g. ``functools.partial(model.apply, train=False)``).
    """
    raise NotImplementedError

  def gather(self, out) -> np.ndarray:
    """The outputs of :meth:`embed_fn` for the whole global batch, as numpy,
    on every process."""
    if jax.process_count() > 1:
      return np.asarray(multihost_utils.process_allgather(out, tiled=True))
    return np.asarray(out)


class SingleDevice(Placement):
  """Everything on the first local device; the step has no device axis."""

  mode = "none"
  axis_name = None

  @property
  def num_devices(self) -> int:
    return 1

  def replicate(self, tree, sharded=None):
    return jax.device_put(tree, jax.local_devices()[0])

  def shard_batch(self, local_batch):
    return local_batch

  def wrap_step(self, fn, *, donate=True, sharded=None):
    fn = functools.partial(fn, axis_name=None, psum_grads=False)
    return jax.jit(fn, donate_argnums=(0,) if donate else ())

  def embed_fn(self, apply_fn):
    return jax.jit(_float32(apply_fn))


class ShardMap(Placement):
  """A 1-D mesh over ``devices`` (default: all global devices).

  Args:
    devices: the mesh's devices.
  """

  mode = "shard_map"

  def __init__(self, devices: Optional[Sequence[Any]] = None):
    devices = jax.devices() if devices is None else list(devices)
    self.mesh = Mesh(np.asarray(devices), (AXIS,))
    self._replicated = NamedSharding(self.mesh, P())
    self._sharded = NamedSharding(self.mesh, P(AXIS))

  @property
  def num_devices(self) -> int:
    return self.mesh.size

  def replicate(self, tree, sharded=None):
    def put(path, x):
      x = np.asarray(x)
      where = self._replicated
      if sharded is not None and sharded(path):
        where = self._sharded
      return jax.make_array_from_callback(x.shape, where, lambda idx: x[idx])
    return jax.tree_util.tree_map_with_path(put, tree)

  def _specs(self, tree, sharded):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: P(AXIS) if sharded is not None and sharded(path)
        else P(), tree)

  def shard_batch(self, local_batch):
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self._sharded, x),
        local_batch)

  def wrap_step(self, fn, *, donate=True, sharded=None):
    fn = functools.partial(fn, axis_name=AXIS, psum_grads=False)

    def step(state, batch):
      specs = self._specs(state, sharded)
      return jax.shard_map(fn, mesh=self.mesh, in_specs=(specs, P(AXIS)),
                           out_specs=(specs, P()))(state, batch)
    return jax.jit(step, donate_argnums=(0,) if donate else ())

  def embed_fn(self, apply_fn):
    return jax.jit(_float32(apply_fn),
                   in_shardings=(self._replicated, self._sharded),
                   out_shardings=self._sharded)


class Pmap(Placement):
  """``jax.pmap`` over the local devices: arrays carry a leading device axis."""

  mode = "pmap"
  psum_grads = True

  @property
  def num_devices(self) -> int:
    return jax.device_count()

  def replicate(self, tree, sharded=None):
    devices = jax.local_devices()
    n, first = len(devices), jax.process_index() * len(devices)
    on_devices = NamedSharding(Mesh(np.asarray(devices), ("_devices",)),
                               P("_devices"))

    def put(path, x):
      x = np.asarray(x)
      if sharded is not None and sharded(path):  # this process' devices' rows, one block each
        x = x.reshape((jax.device_count(), -1) + x.shape[1:])[first:first + n]
      else:
        x = np.stack([x] * n)
      return jax.device_put(x, on_devices)
    return jax.tree_util.tree_map_with_path(put, tree)

  def shard_batch(self, local_batch):
    n = jax.local_device_count()
    return jax.tree.map(lambda x: np.reshape(x, (n, -1) + np.shape(x)[1:]),
                        local_batch)

  def _one_copy(self, local):
    return local[0]

  def _whole(self, x):
    x = np.asarray(x)
    return super()._whole(x.reshape((-1,) + x.shape[2:]))

  def first_replica(self, tree):
    return jax.tree.map(lambda x: x[0], tree)

  def wrap_step(self, fn, *, donate=True, sharded=None):
    fn = functools.partial(fn, axis_name=AXIS, psum_grads=True)
    return jax.pmap(fn, axis_name=AXIS,
                    donate_argnums=(0,) if donate else ())

  def embed_fn(self, apply_fn):
    return jax.pmap(_float32(apply_fn))

  def gather(self, out):
    out = np.asarray(out)
    return super().gather(out.reshape((-1,) + out.shape[2:]))


_PLACEMENTS = {"shard_map": ShardMap, "pmap": Pmap, "none": SingleDevice}


def get_placement(mode) -> Placement:
  """The :class:`Placement` of a mode name (a Placement is returned as is).

  Raises:
    ValueError: an unknown mode, naming the valid ones.
  """
  if isinstance(mode, Placement):
    return mode
  if mode not in _PLACEMENTS:
    raise ValueError(f"Unknown `parallelism` {mode!r}; use one of {MODES}.")
  return _PLACEMENTS[mode]()


def from_config(config) -> Placement:
  """The placement of ``config.parallelism``."""
  return get_placement(config.parallelism)
