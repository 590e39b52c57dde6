"""Cross-batch memory (XBM): a FIFO of past embeddings in the train state.

Wang, Zhang, Huang and Scott, "Cross-Batch Memory for Embedding Learning",
CVPR 2020. Embeddings drift slowly once the network has warmed up, so the
embeddings of the last few hundred or thousand train images, kept without
gradient, are good enough candidates to mine far more pairs than one batch
holds. Each step (from ``config.xbm.start_step`` on):

1. the global batch's embeddings (``stop_gradient``) and labels are written
   over the oldest rows of the memory (enqueue and dequeue: a FIFO of ``M``
   rows, ``M`` a multiple of the global batch ``B``, so one step replaces
   exactly the ``B`` oldest rows);
2. the loss is ``L(batch, batch) + weight * L(batch, memory)``, the second
   term through the loss API's reference embeddings: the batch's anchors
   meet every filled memory row (empty rows take no part: the
   ``valid`` of its ``circle_jax.losses.Candidates``).

The memory is read *after* the enqueue, as in the authors' code, so it holds
the batch itself; its own copies are no pairs: memory row ``r`` has the id
``r`` (its global slot index) and each anchor the id of the row it was just
written to, so the loss drops exactly the anchor-with-its-own-copy pairs
(the candidates' ``ids`` / ``anchor_ids``). Before ``start_step`` nothing is written, the memory
stays empty and the memory term is zero.

Placement: the rows are split over the devices like the batch
(:func:`is_sharded`, used by :mod:`circle_jax.parallel`): with ``n`` devices
each holds ``M / n`` rows and writes its own ``B / n`` batch rows into them,
so enqueueing needs no communication; the loss gathers the memory over
``axis_name``, so every anchor meets all ``M`` rows. Global row ``d * M/n +
j`` is row ``j`` of device ``d``. On one device the memory is one ``[M, D]``
array. The memory is part of the checkpoint (a resumed run continues with
the same memory, bitwise).

Empty rows have the label ``-1`` (train labels are ``>= 0``), so which rows
are filled is stored with the rows themselves and does not depend on how
they are split over devices.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from circle_jax import losses as losses_lib

Array = jax.Array
EMPTY = -1  # the label of an empty row
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The memory's arrays (saved with the state), and those split over devices.
ARRAY_FIELDS = ("embeddings", "labels", "position", "filled")
ROW_FIELDS = ("embeddings", "labels")


@flax.struct.dataclass
class Memory:
  """The memory of a run (a leaf group of the :class:`TrainState`).

  Attributes:
    embeddings: ``[M, D]`` rows in the storage dtype (inside the step:
      this device's ``[M/n, D]``).
    labels: ``[M]`` int32, ``-1`` for an empty row (inside the step:
      ``[M/n]``).
    position: int32 scalar, the global FIFO index of the next write: a
      multiple of the global batch in ``[0, M)``; device ``d`` writes its
      rows at ``position / n`` of its shard.
    filled: int32 scalar, the number of rows holding an embedding (``<= M``).
    start_step: the first step that enqueues (static).
    weight: the weight of the memory term (static).
  """

  embeddings: Array
  labels: Array
  position: Array
  filled: Array
  start_step: int = flax.struct.field(pytree_node=False, default=0)
  weight: float = flax.struct.field(pytree_node=False, default=1.0)


def init_memory(size: int, dim: int, *, dtype: str = "float32",
                start_step: int = 0, weight: float = 1.0) -> Memory:
  """An empty memory of ``size`` rows of ``dim`` (host numpy arrays).

  Args:
    size: ``M``, the number of rows (> 0).
    dim: ``D``, the embedding size.
    dtype: storage dtype of the rows, ``float32`` or ``bfloat16``.
    start_step: the first step that enqueues.
    weight: the weight of the memory term.
  """
  if dtype not in DTYPES:
    raise ValueError(f"XBM dtype must be one of {sorted(DTYPES)}; got "
                     f"{dtype!r}.")
  return Memory(
      embeddings=np.zeros((size, dim), DTYPES[dtype]),
      labels=np.full((size,), EMPTY, np.int32),
      position=np.zeros((), np.int32), filled=np.zeros((), np.int32),
      start_step=int(start_step), weight=float(weight))


def from_config(config) -> Optional[Memory]:
  """The empty memory of ``config.xbm`` (None when ``xbm.size`` is 0)."""
  if not config.xbm.size:
    return None
  return init_memory(config.xbm.size, config.model.embedding_dim,
                     dtype=config.xbm.dtype, start_step=config.xbm.start_step,
                     weight=config.xbm.weight)


def key_names(path) -> list:
  """The dict keys / attribute names of a leaf's key path (None for a
  sequence index)."""
  return [getattr(k, "key", getattr(k, "name", None)) for k in path]


def is_sharded(path) -> bool:
  """Whether a state leaf (by its key path) is split over the devices.

  True for the memory's rows (``...xbm.embeddings``, ``...xbm.labels``) in
  a :class:`TrainState` or in its tree (:func:`state_to_tree`): the
  ``sharded`` argument of :mod:`circle_jax.parallel`'s placements.
  """
  names = key_names(path)
  return len(names) >= 2 and names[-2] == "xbm" and names[-1] in ROW_FIELDS


def bytes_per_device(size: int, dim: int, dtype: str,
                     num_devices: int) -> int:
  """The memory's footprint on one device: ``M/n x (D x bytes + 4)``."""
  row = dim * jnp.dtype(DTYPES[dtype]).itemsize + np.dtype(np.int32).itemsize
  return size // num_devices * row


def _axis(axis_name) -> Tuple[Any, int]:
  """``(this device's index, the device count)`` on ``axis_name``."""
  if axis_name is None:
    return 0, 1
  return jax.lax.axis_index(axis_name), jax.lax.axis_size(axis_name)


def enqueue(memory: Memory, embeddings: Array, labels: Array, *, step,
            axis_name=None) -> Tuple[Memory, Array]:
  """Writes the batch over the oldest rows (from ``start_step`` on).

  Args:
    memory: this device's memory (rows ``[M/n, D]``).
    embeddings: ``[b, D]`` this device's batch slice (gradients stopped
      here).
    labels: ``[b]`` its labels.
    step: the step being taken (``state.step``).
    axis_name: the device axis (None on one device).

  Returns:
    ``(new memory, ids [b])``: ``ids`` are the global rows the anchors were
    written to (the ids of their own copies).
  """
  device, n = _axis(axis_name)
  rows, b = memory.labels.shape[0], labels.shape[0]
  if rows % b:
    raise ValueError(
        f"The XBM memory's {rows} rows per device are not a multiple of the "
        f"{b}-row batch slice: make xbm.size a multiple of the global batch.")
  local = memory.position // n
  active = step >= memory.start_step
  stored = jax.lax.stop_gradient(embeddings).astype(memory.embeddings.dtype)
  written = memory.replace(
      embeddings=jax.lax.dynamic_update_slice(memory.embeddings, stored,
                                              (local, 0)),
      labels=jax.lax.dynamic_update_slice(
          memory.labels, labels.astype(jnp.int32), (local,)),
      position=(memory.position + b * n) % (rows * n),
      filled=jnp.minimum(memory.filled + b * n, rows * n))
  new = jax.tree.map(lambda w, old: jnp.where(active, w, old), written,
                     memory)
  ids = device * rows + local + jnp.arange(b, dtype=jnp.int32)
  return new, ids


def loss_with_memory(loss_fn: Callable, memory: Memory, embeddings: Array,
                     labels: Array, loss_params, *, key, step,
                     axis_name=None) -> Tuple[Array, Memory]:
  """``L(batch, batch) + weight * L(batch, memory)`` after the enqueue.

  Args:
    loss_fn: the step's loss (``circle_jax.train.step.make_loss_fn``),
      forwarding the reference keywords of the loss API.
    memory: this device's memory.
    embeddings: ``[b, D]`` this device's embeddings (with gradient).
    labels: ``[b]``.
    loss_params: the loss' parameters.
    key: the step's loss key (the memory term gets ``fold_in(key, 1)``).
    step: ``state.step``.
    axis_name: the device axis (None on one device).

  Returns:
    ``(loss of the global batch, new memory)``.
  """
  memory, ids = enqueue(memory, embeddings, labels, step=step,
                        axis_name=axis_name)
  device, _ = _axis(axis_name)
  rows = memory.labels.shape[0]
  batch_loss = loss_fn(embeddings, labels, loss_params, key=key,
                       axis_name=axis_name)
  memory_loss = loss_fn(
      embeddings, labels, loss_params, key=jax.random.fold_in(key, 1),
      axis_name=axis_name, ref=losses_lib.Candidates(
          memory.embeddings.astype(jnp.float32), memory.labels,
          valid=memory.labels != EMPTY,
          ids=device * rows + jnp.arange(rows, dtype=jnp.int32),
          anchor_ids=ids))
  return batch_loss + memory.weight * memory_loss, memory
