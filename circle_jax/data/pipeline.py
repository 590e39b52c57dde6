"""grain input pipelines: train batches from a sampler, padded eval batches.

Both pipelines are grain ``MapDataset`` s over *batch numbers*: element ``s``
of the train pipeline is the (per-process share of the) batch of step ``s``,
read with one batched random-access call to the data source, then decoded
and augmented with PIL. grain prefetches several batches in parallel threads
(``num_threads``, PIL releases the GIL while decoding and resizing) and,
with ``num_workers > 0``, in that many worker processes.

Determinism: the records of a batch come from the sampler (a function of
``(seed, step)``) and the augmentation of the image at global batch position
``j`` uses ``numpy.random.default_rng([seed, 1, step, j])``, so a batch is a
pure function of ``(seed, step)`` -- the same for any number of threads,
workers or processes, and after a restart. The iterator state that a trainer
checkpoints is therefore just the next step (:meth:`TrainIterator.get_state`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterator, Optional

from absl import flags
import grain
import jax
import numpy as np

from circle_jax.data import augment

# A MapDataset needs a length; train pipelines are this long (never reached).
_ENDLESS = 2**62


def _mp_prefetch(ds, num_workers: int):
  """``ds.mp_prefetch`` with `num_workers` processes (0: unchanged)."""
  if not num_workers:
    return ds
  # grain's worker processes read absl flags; outside an absl app (pytest,
  # notebooks) they are unparsed, so accept their defaults.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return ds.mp_prefetch(grain.multiprocessing.MultiprocessingOptions(
      num_workers=num_workers))


def _records(source, indices):
  """Reads records with one batched call when the source supports it."""
  keys = [int(i) for i in indices]
  getitems = getattr(source, "__getitems__", None)
  if getitems is not None:
    return getitems(keys)
  return [source[k] for k in keys]


def _path(record, index) -> str:
  path = record.get("path", record.get("file_name"))
  if path is None:
    return f"record {index}"
  if isinstance(path, (bytes, np.bytes_)):
    path = bytes(path).decode("utf-8", "replace")
  return f"'{path}' (record {index})"


def _checked_process(preprocess, process_index, process_count, *, train):
  """``(process_index, process_count)``, JAX's where ``None``, once
  ``preprocess`` is known to be a preset (TypeError naming the
  ``get_preprocess(name, train=...)`` call that makes one)."""
  if process_index is None:
    process_index = jax.process_index()
  if process_count is None:
    process_count = jax.process_count()
  if not isinstance(preprocess, augment.Preprocess):
    raise TypeError("`preprocess` must be a circle_jax.data.augment.Preprocess "
                    f"(use get_preprocess(name, train={train})); got "
                    f"{type(preprocess).__name__}.")
  return process_index, process_count


@dataclasses.dataclass(frozen=True)
class _TrainBatch:
  """Step -> this process's batch (a picklable grain map function)."""

  source: Any
  sampler: Any
  preprocess: augment.Preprocess
  process_index: int
  process_count: int

  def __call__(self, step) -> Dict[str, np.ndarray]:
    step = int(step)
    indices, positions = self.sampler.local_indices(
        step, self.process_index, self.process_count)
    records = _records(self.source, indices)
    images = np.empty((len(indices),) + self.preprocess.output_shape,
                      np.float32)
    labels = np.empty(len(indices), np.int32)
    for k, (rec, idx, pos) in enumerate(zip(records, indices, positions)):
      rng = np.random.default_rng([self.sampler.seed, 1, step, int(pos)])
      images[k] = self.preprocess(rec["image"], rng, _path(rec, idx))
      labels[k] = self.sampler.label(rec["label"], idx)
    return {"image": images, "label": labels,
            "index": np.asarray(indices, np.int64)}


class TrainIterator(Iterator[Dict[str, np.ndarray]]):
  """Endless iterator of per-process train batches, restartable by step.

  Each ``next()`` returns ``{'image': float32 [b, H, W, C], 'label': int32
  [b], 'index': int64 [b]}`` with ``b = sampler.batch_size //
  process_count`` ('index' is the record index in the split).

  Checkpointing: ``get_state()`` returns ``{'step': next_step}`` (JSON
  serialisable; save it e.g. with ``orbax.checkpoint.args.JsonSave``) and
  ``set_state(state)`` restarts the pipeline at that step. Since batches are
  functions of the step, restoring a state taken at step ``s`` yields exactly
  the batches an uninterrupted run would have produced from ``s`` on.
  """

  def __init__(self, source, *, sampler, preprocess, start_step: int = 0,
               num_workers: int = 0, num_threads: int = 8,
               prefetch: int = 4, process_index: Optional[int] = None,
               process_count: Optional[int] = None):
    process_index, process_count = _checked_process(
        preprocess, process_index, process_count, train=True)
    if num_workers < 0 or num_threads < 0:
      raise ValueError("`num_workers` and `num_threads` must be >= 0.")
    # Validates the shard now rather than in a worker.
    sampler.local_indices(0, process_index, process_count)
    self._fn = _TrainBatch(source, sampler, preprocess, int(process_index),
                           int(process_count))
    self._num_workers = int(num_workers)
    self._read = grain.ReadOptions(num_threads=int(num_threads),
                                   prefetch_buffer_size=max(int(prefetch), int(num_threads), 1))
    self._it = None
    self._start(int(start_step))

  def _start(self, step: int):
    if step < 0:
      raise ValueError(f"`start_step` must be >= 0; got {step}.")
    self.close()
    ds = grain.MapDataset.range(step, _ENDLESS).map(self._fn)
    ds = _mp_prefetch(ds.to_iter_dataset(self._read), self._num_workers)
    self._it = iter(ds)
    self._step = step

  @property
  def step(self) -> int:
    """The step of the batch the next ``next()`` returns."""
    return self._step

  def __iter__(self):
    return self

  def __next__(self) -> Dict[str, np.ndarray]:
    if self._it is None:
      raise RuntimeError("The iterator was closed; set_state() restarts it.")
    batch = next(self._it)
    self._step += 1
    return batch

  def get_state(self) -> Dict[str, int]:
    return {"step": self._step}

  def set_state(self, state: Dict[str, int]) -> None:
    if not isinstance(state, dict) or "step" not in state:
      raise ValueError(f"Expected a state {{'step': int}} from get_state(); "
                       f"got {state!r}.")
    self._start(int(state["step"]))

  def close(self) -> None:
    """Stops prefetching threads/processes."""
    it, self._it = getattr(self, "_it", None), None
    if it is not None and hasattr(it, "close"):
      it.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass


def train_iterator(source, *, sampler, preprocess, start_step: int = 0,
                   num_workers: int = 0, num_threads: int = 8,
                   prefetch: int = 4, process_index: Optional[int] = None,
                   process_count: Optional[int] = None) -> TrainIterator:
  """Per-process train batches of `sampler` from `source`, from `start_step`.

  Args:
    source: random-access source of ``{'image': bytes, 'label': int,
      'path': ...}`` records (:func:`circle_jax.data.load_split`).
    sampler: :class:`~circle_jax.data.PKSampler` or
      :class:`~circle_jax.data.RandomSampler` (global batch indices).
    preprocess: a train preset from :func:`circle_jax.data.get_preprocess`.
    start_step: step of the first batch (resume).
    num_workers: worker processes (0: threads of this process only).
    num_threads: threads per process preparing batches in parallel.
    prefetch: batches buffered ahead per process.
    process_index: this process (default ``jax.process_index()``).
    process_count: number of processes (default ``jax.process_count()``).

  Returns:
    A :class:`TrainIterator` of ``{'image': float32 [b, H, W, C],
    'label': int32 [b], 'index': int64 [b]}`` with ``b = B / process_count``.
  """
  return TrainIterator(source, sampler=sampler, preprocess=preprocess,
                       start_step=start_step, num_workers=num_workers,
                       num_threads=num_threads, prefetch=prefetch,
                       process_index=process_index,
                       process_count=process_count)


@dataclasses.dataclass(frozen=True)
class _EvalBatch:
  """Batch number -> padded per-process eval batch."""

  source: Any
  preprocess: augment.Preprocess
  batch_size: int
  process_index: int
  process_count: int

  def __call__(self, b) -> Dict[str, np.ndarray]:
    local = self.batch_size // self.process_count
    start = int(b) * self.batch_size + self.process_index * local
    idx = np.arange(start, start + local, dtype=np.int64)
    mask = idx < len(self.source)
    valid = idx[mask]
    images = np.zeros((local,) + self.preprocess.output_shape, np.float32)
    labels = np.full(local, -1, np.int32)
    for k, (rec, i) in enumerate(zip(_records(self.source, valid), valid)):
      images[k] = self.preprocess(rec["image"], None, _path(rec, i))
      labels[k] = rec["label"]
    return {"image": images, "label": labels, "mask": mask,
            "index": np.where(mask, idx, -1)}


class EvalIterable:
  """One pass over a split in padded batches (iterate it once or many times).

  ``len()`` is the number of batches, ``ceil(N / batch_size)``, the same in
  every process.
  """

  def __init__(self, fn: _EvalBatch, num_batches: int, read, num_workers):
    self._fn, self._num_batches = fn, num_batches
    self._read, self._num_workers = read, num_workers

  def __len__(self):
    return self._num_batches

  def __iter__(self):
    ds = grain.MapDataset.range(self._num_batches).map(self._fn)
    return iter(_mp_prefetch(ds.to_iter_dataset(self._read),
                             self._num_workers))


def eval_iterator(source, *, preprocess, batch_size: int,
                  num_workers: int = 0, num_threads: int = 8,
                  prefetch: int = 4, process_index: Optional[int] = None,
                  process_count: Optional[int] = None) -> EvalIterable:
  """The whole split once, in order, in padded batches with a mask.

  Global batch ``b`` holds records ``[b * batch_size, (b + 1) *
  batch_size)``; process ``p`` gets the ``p``-th contiguous share. Positions
  past the end of the split are padding: ``mask`` False, image zeros, label
  -1, index -1. No record is dropped or repeated: the records with
  ``mask`` True over all batches and processes are exactly ``0..N-1``.

  Args:
    source: random-access source (:func:`circle_jax.data.load_split`).
    preprocess: an eval preset (``get_preprocess(name, train=False)``).
    batch_size: global batch size (divisible by `process_count`).
    num_workers, num_threads, prefetch, process_index, process_count: as in
      :func:`train_iterator`.

  Returns:
    An :class:`EvalIterable` of ``{'image': float32 [b, H, W, C], 'label':
    int32 [b], 'mask': bool [b], 'index': int64 [b]}``.
  """
  process_index, process_count = _checked_process(
      preprocess, process_index, process_count, train=False)
  if preprocess.train:
    raise ValueError("eval_iterator needs the eval variant of the preset: "
                     "get_preprocess(name, train=False).")
  if batch_size < 1 or batch_size % process_count:
    raise ValueError(f"`batch_size` ({batch_size}) must be positive and "
                     f"divisible by the number of processes ({process_count}).")
  if not 0 <= process_index < process_count:
    raise ValueError(f"Need 0 <= process_index < process_count; got "
                     f"{process_index}, {process_count}.")
  fn = _EvalBatch(source, preprocess, int(batch_size), int(process_index),
                  int(process_count))
  read = grain.ReadOptions(num_threads=int(num_threads),
                           prefetch_buffer_size=max(int(prefetch), int(num_threads), 1))
  return EvalIterable(fn, math.ceil(len(source) / batch_size), read,
                      int(num_workers))


def global_batch(local_batch, sharding):
  """Assembles per-process batches into global, sharded ``jax.Array`` s.

  Args:
    local_batch: pytree of numpy arrays with the per-process batch on axis 0
      (from :func:`train_iterator` / :func:`eval_iterator`).
    sharding: a ``jax.sharding.Sharding`` whose mesh covers every process's
      devices and whose spec shards axis 0 (e.g. ``NamedSharding(mesh,
      PartitionSpec('data'))``); the global batch axis is
      ``process_count x`` the local one, in process order.

  Returns:
    The same pytree of global ``jax.Array`` s
    (``jax.make_array_from_process_local_data``).
  """
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
      local_batch)
