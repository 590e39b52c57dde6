"""Batch samplers: deterministic functions of ``(seed, step)``.

A sampler maps a training step to the record indices of the *global* batch.
Nothing is stateful: the batch of step ``s`` is computed from ``(seed, s)``
alone, so a run restarted at step ``s`` continues exactly as if it had never
stopped, whatever the number of processes or workers. In a multi-process
(multi-host) job, process ``p`` of ``n`` takes the contiguous slice
``[p * B/n, (p + 1) * B/n)`` of the global batch (:meth:`local_indices`),
which is the layout ``jax.make_array_from_process_local_data`` expects for a
batch axis sharded over a mesh of the processes' devices in order.
"""

from __future__ import annotations

import threading
from typing import Tuple

import numpy as np


def _check_shard(batch_size: int, process_index: int, process_count: int):
  if process_count <= 0 or not 0 <= process_index < process_count:
    raise ValueError(f"Need 0 <= process_index < process_count; got "
                     f"process_index={process_index}, "
                     f"process_count={process_count}.")
  if batch_size % process_count:
    raise ValueError(
        f"The global batch size {batch_size} is not divisible by the number "
        f"of processes {process_count}; change the batch size.")
  local = batch_size // process_count
  return process_index * local, (process_index + 1) * local


class _Sampler:
  """Shared API: `indices(step)`, `local_indices(...)`, `batch_size`, `seed`."""

  batch_size: int
  seed: int

  def indices(self, step: int) -> np.ndarray:
    raise NotImplementedError

  def label(self, record_label: int, index: int) -> int:
    """The train label of record ``index`` (whose label is
    ``record_label``): its class, except for :class:`ViewSampler`."""
    del index
    return int(record_label)

  def local_indices(self, step: int, process_index: int = 0,
                    process_count: int = 1) -> Tuple[np.ndarray, np.ndarray]:
    """This process's contiguous share of the global batch of `step`.

    Returns:
      `(indices, positions)`: int64 record indices ``[B / process_count]``
      and their positions in the global batch.
    """
    lo, hi = _check_shard(self.batch_size, process_index, process_count)
    return self.indices(step)[lo:hi], np.arange(lo, hi, dtype=np.int64)


def _check_step(step) -> int:
  step = int(step)
  if step < 0:
    raise ValueError(f"`step` must be >= 0; got {step}.")
  return step


class PKSampler(_Sampler):
  """Class-balanced batches of P classes x K images each.

  Step ``s`` draws P distinct classes uniformly (among the classes that have
  at least one image), then K images of each class: without replacement
  when the class has at least K images, **with replacement** when it has
  fewer (so a batch may hold the same image twice; such duplicates are
  positive pairs of identical images). Every batch is drawn independently
  from ``numpy.random.default_rng([seed, s])``: batches are i.i.d. across
  steps rather than epochs of the dataset, as in the Multi-Similarity and
  Circle-loss training code. The batch is class-major: positions
  ``[i*K, (i+1)*K)`` hold the K images of the i-th class.

  Args:
    labels: int array ``[N]``, the label of every record of the split
      (:func:`circle_jax.data.split_labels`).
    classes_per_batch: P.
    images_per_class: K.
    seed: non-negative int.
  """

  def __init__(self, labels, *, classes_per_batch: int, images_per_class: int,
               seed: int = 0):
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
      raise ValueError(f"`labels` must be a 1-D integer array; got shape "
                       f"{labels.shape} and dtype {labels.dtype}.")
    if labels.size and labels.min() < 0:
      raise ValueError("`labels` must be non-negative class ids.")
    if classes_per_batch < 1 or images_per_class < 1:
      raise ValueError(
          f"`classes_per_batch` (P) and `images_per_class` (K) must be >= 1; "
          f"got P={classes_per_batch}, K={images_per_class}.")
    if seed < 0:
      raise ValueError(f"`seed` must be >= 0; got {seed}.")
    counts = np.bincount(labels) if labels.size else np.zeros(0, np.int64)
    self.classes = np.flatnonzero(counts)
    if classes_per_batch > len(self.classes):
      raise ValueError(
          f"`classes_per_batch`={classes_per_batch} but the split has only "
          f"{len(self.classes)} classes; lower P.")
    order = np.argsort(labels, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    self._order = order
    self._starts = starts[self.classes]
    self._counts = counts[self.classes]
    self.P, self.K = int(classes_per_batch), int(images_per_class)
    self.batch_size = self.P * self.K
    self.seed = int(seed)
    self.num_examples = int(labels.size)

  @property
  def num_classes_with_fewer_than_k(self) -> int:
    """Classes that are sampled with replacement (fewer than K images)."""
    return int((self._counts < self.K).sum())

  def indices(self, step: int) -> np.ndarray:
    """Record indices ``[P * K]`` (int64) of the global batch of `step`."""
    rng = np.random.default_rng([self.seed, _check_step(step)])
    chosen = rng.choice(len(self.classes), self.P, replace=False)
    out = np.empty((self.P, self.K), np.int64)
    for row, c in enumerate(chosen):
      n = int(self._counts[c])
      pick = rng.choice(n, self.K, replace=n < self.K)
      out[row] = self._order[self._starts[c] + pick]
    return out.reshape(-1)


class RandomSampler(_Sampler):
  """Plain random batches: epochs of random permutations, concatenated.

  The stream of examples is ``perm_0, perm_1, ...`` where ``perm_e`` is a
  permutation of ``range(N)`` drawn from ``numpy.random.default_rng([seed,
  e])``; step ``s`` takes positions ``[s * B, (s + 1) * B)`` of that stream.
  Every example is seen exactly once per epoch and batches run across epoch
  boundaries (nothing is dropped), as for Proxy-Anchor's shuffled loader.

  Args:
    num_examples: N, the number of records of the split.
    batch_size: B, the global batch size.
    seed: non-negative int.
  """

  def __init__(self, num_examples: int, *, batch_size: int, seed: int = 0):
    if num_examples < 1 or batch_size < 1:
      raise ValueError(f"`num_examples` and `batch_size` must be >= 1; got "
                       f"{num_examples} and {batch_size}.")
    if seed < 0:
      raise ValueError(f"`seed` must be >= 0; got {seed}.")
    self.num_examples = int(num_examples)
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self._cache = {}
    self._lock = threading.Lock()

  def __getstate__(self):  # Picklable for multiprocessing workers.
    state = dict(self.__dict__)
    state["_cache"], state["_lock"] = {}, None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def permutation(self, epoch: int) -> np.ndarray:
    """The permutation of epoch `epoch` (a few recent ones are cached)."""
    with self._lock:
      perm = self._cache.get(epoch)
    if perm is None:
      perm = np.random.default_rng([self.seed, epoch]).permutation(
          self.num_examples)
      with self._lock:
        if len(self._cache) >= 4:
          self._cache.pop(next(iter(self._cache)))
        self._cache[epoch] = perm
    return perm

  def indices(self, step: int) -> np.ndarray:
    """Record indices ``[B]`` (int64) of the global batch of `step`."""
    start = _check_step(step) * self.batch_size
    pos = np.arange(start, start + self.batch_size, dtype=np.int64)
    epochs, offsets = np.divmod(pos, self.num_examples)
    out = np.empty(self.batch_size, np.int64)
    for e in np.unique(epochs):
      sel = epochs == e
      out[sel] = self.permutation(int(e))[offsets[sel]]
    return out


class ViewSampler(_Sampler):
  """Instance discrimination: V augmented views of each of N images.

  Step ``s`` draws N distinct records uniformly from
  ``numpy.random.default_rng([seed, s])`` and puts each V times in the
  batch (instance-major: positions ``[i*V, (i+1)*V)`` hold the views of the
  i-th image). Every position gets its own augmentation (the pipeline's
  per-position generator), so the copies are different views, and
  :meth:`label` gives each image its record index as the label: an image's
  other views are its only positives, every other image (of its class or
  not) a negative, as in SimCLR's NT-Xent (Chen, Kornblith, Norouzi, Hinton,
  "A Simple Framework for Contrastive Learning of Visual Representations",
  ICML 2020), where the batch holds two views of each of N images.

  Args:
    num_examples: the number of records of the split.
    images_per_batch: N (``config.batch.classes_per_batch``).
    views: V >= 2 (``config.batch.images_per_class``).
    seed: non-negative int.
  """

  def __init__(self, num_examples: int, *, images_per_batch: int,
               views: int = 2, seed: int = 0):
    if views < 2:
      raise ValueError(f"`views` must be >= 2 (an image's views are its "
                       f"positives); got {views}.")
    if images_per_batch < 1 or images_per_batch > num_examples:
      raise ValueError(
          f"`images_per_batch` must be in [1, {num_examples}] (the split's "
          f"records); got {images_per_batch}.")
    if seed < 0:
      raise ValueError(f"`seed` must be >= 0; got {seed}.")
    self.num_examples = int(num_examples)
    self.N, self.V = int(images_per_batch), int(views)
    self.batch_size = self.N * self.V
    self.seed = int(seed)

  def indices(self, step: int) -> np.ndarray:
    """Record indices ``[N * V]`` (int64): each image V times in a row."""
    rng = np.random.default_rng([self.seed, _check_step(step)])
    chosen = rng.choice(self.num_examples, self.N, replace=False)
    return np.repeat(chosen.astype(np.int64), self.V)

  def label(self, record_label: int, index: int) -> int:
    """The record index: the views of one image share it."""
    del record_label
    return int(index)
