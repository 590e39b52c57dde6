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

import itertools
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


def _label_vector(labels) -> np.ndarray:
  """``labels`` as a 1-D integer array, or one line naming the problem."""
  labels = np.asarray(labels)
  if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(f"`labels` must be a 1-D integer array; got shape "
                     f"{labels.shape} and dtype {labels.dtype}.")
  return labels


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
    labels = _label_vector(labels)
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


class HierarchicalSampler(_Sampler):
  """Batches of classes drawn from a few super-classes (PML's
  ``HierarchicalSampler``, as the SOP recipes of RS@k use it).

  An epoch is every tuple of ``S = super_classes_per_batch`` distinct
  super-classes (``itertools.combinations`` of the sorted super-labels),
  each ``batches_per_super_tuple`` times, in the order of a permutation drawn
  from ``numpy.random.default_rng([seed, 0, epoch])``; step ``s`` is entry
  ``s mod T`` of epoch ``s // T`` (``T`` the epoch's length). Its batch
  holds, for each super-class of its tuple in turn, ``batch_size / S``
  records: ``batch_size / (S K)`` distinct classes of that super-class drawn
  uniformly, ``K = samples_per_class`` records of each (without replacement
  when the class has at least ``K``, with replacement otherwise, as PML's
  ``safe_random_choice``), from ``default_rng([seed, 1, s])``. So the batch
  of a step depends on ``(seed, s)`` alone, like :class:`PKSampler`'s, and
  :meth:`local_indices` gives each process its contiguous share.

  Differences from PML 2.9, whose batches these otherwise equal in
  distribution: the batch stays super-class-major and class-major (PML
  shuffles the order of a batch's records, which no loss of the global
  batch sees) and the step order is a function of ``(seed, step)``, not of
  a global random state; ``samples_per_class='all'`` is refused (a batch
  must keep one shape), and so is a super-class with fewer than
  ``batch_size / (S K)`` classes (PML would return a short batch).

  Args:
    labels: int array ``[N, H]``: per record, its labels at each level of
      the hierarchy (e.g. class and super-class).
    batch_size: the global batch size, a multiple of ``S K``.
    samples_per_class: K.
    batches_per_super_tuple: batches per tuple of super-classes per epoch.
    super_classes_per_batch: S.
    inner_label: the column of ``labels`` holding the class.
    outer_label: the column holding the super-class.
    seed: non-negative int.
  """

  def __init__(self, labels, *, batch_size: int, samples_per_class: int,
               batches_per_super_tuple: int = 4,
               super_classes_per_batch: int = 2, inner_label: int = 0,
               outer_label: int = 1, seed: int = 0):
    labels = np.asarray(labels)
    if labels.ndim != 2 or not np.issubdtype(labels.dtype, np.integer):
      raise ValueError(
          f"`labels` must be a 2-D integer array [num_records, levels] (class"
          f" and super-class per record); got shape {labels.shape} and dtype "
          f"{labels.dtype}.")
    for name, col in (("inner_label", inner_label),
                      ("outer_label", outer_label)):
      if not 0 <= col < labels.shape[1]:
        raise ValueError(f"`{name}`={col} is not a column of `labels` "
                         f"(it has {labels.shape[1]}).")
    if samples_per_class == "all":
      raise ValueError("samples_per_class='all' gives batches of varying "
                       "size; pass K, the records per class.")
    s, k = super_classes_per_batch, samples_per_class
    for name, v in (("batch_size", batch_size), ("samples_per_class", k),
                    ("batches_per_super_tuple", batches_per_super_tuple),
                    ("super_classes_per_batch", s)):
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"`{name}` must be a positive int; got {v!r}.")
    if batch_size % (s * k):
      raise ValueError(
          f"`batch_size`={batch_size} must be a multiple of "
          f"super_classes_per_batch x samples_per_class = {s} x {k}.")
    if seed < 0:
      raise ValueError(f"`seed` must be >= 0; got {seed}.")
    inner, outer = labels[:, inner_label], labels[:, outer_label]
    self.super_labels = np.unique(outer)
    if s > self.super_labels.size:
      raise ValueError(
          f"`super_classes_per_batch`={s} but the labels have only "
          f"{self.super_labels.size} super-classes; lower it.")
    self.C = batch_size // (s * k)      # classes per super-class per batch
    # Records of each (super-class, class), both sorted.
    order = np.lexsort((inner, outer))
    pairs, starts, counts = np.unique(
        np.stack([outer[order], inner[order]], 1), axis=0, return_index=True,
        return_counts=True)
    self._order, self._starts, self._counts = order, starts, counts
    self._classes_of = {}
    for sup in self.super_labels:
      rows = np.flatnonzero(pairs[:, 0] == sup)
      if rows.size < self.C:
        raise ValueError(
            f"super-class {sup} has {rows.size} classes but each batch takes "
            f"{self.C} of it (batch_size / (super_classes_per_batch x "
            f"samples_per_class)); lower the batch size.")
      self._classes_of[int(sup)] = rows
    self.tuples = np.asarray(list(itertools.combinations(
        range(self.super_labels.size), s)), np.int64)
    self.batches_per_super_tuple = int(batches_per_super_tuple)
    self.S, self.K = int(s), int(k)
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.num_examples = int(labels.shape[0])

  @property
  def steps_per_epoch(self) -> int:
    """``T``: every tuple of super-classes ``batches_per_super_tuple``
    times."""
    return len(self.tuples) * self.batches_per_super_tuple

  def super_tuple(self, step: int) -> np.ndarray:
    """The super-labels ``[S]`` of the batch of `step`."""
    epoch, pos = divmod(_check_step(step), self.steps_per_epoch)
    perm = np.random.default_rng([self.seed, 0, epoch]).permutation(
        self.steps_per_epoch)
    return self.super_labels[self.tuples[perm[pos] % len(self.tuples)]]

  def indices(self, step: int) -> np.ndarray:
    """Record indices ``[batch_size]`` (int64) of the global batch of
    `step`: ``S`` blocks of ``C`` classes x ``K`` records."""
    rng = np.random.default_rng([self.seed, 1, _check_step(step)])
    out = np.empty((self.S, self.C, self.K), np.int64)
    for i, sup in enumerate(self.super_tuple(step)):
      rows = self._classes_of[int(sup)]
      for j, row in enumerate(rng.choice(rows, self.C, replace=False)):
        n = int(self._counts[row])
        pick = rng.choice(n, self.K, replace=n < self.K)
        out[i, j] = self._order[self._starts[row] + pick]
    return out.reshape(-1)


class FixedSetOfTriplets(_Sampler):
  """Batches of a fixed set of triplets (PML's ``FixedSetOfTriplets``): the
  only ground truth a fixed list of ``(anchor, positive, negative)``
  records, for experiments that train from triplets instead of labels.

  The ``T = num_triplets`` triplets are drawn once, as PML 2.9 draws them
  (for each: two distinct labels, anchor and negative label, in the order of
  first appearance; two records of the anchor's label, with replacement
  only when it has one; one record of the negative's), from
  ``numpy.random.RandomState(seed)``, so they equal PML's after
  ``numpy.random.seed(seed)``. The batches are those of a
  :class:`RandomSampler` over the triplets (epochs of permutations drawn
  from ``(seed, epoch)``, where PML reshuffles with numpy's global state),
  each triplet giving its three records in a row.

  Args:
    labels: int array ``[N]``, the label of every record.
    num_triplets: T >= 1.
    batch_size: the global batch size, a multiple of 3.
    seed: non-negative int.
  """

  def __init__(self, labels, *, num_triplets: int, batch_size: int,
               seed: int = 0):
    labels = _label_vector(labels)
    if num_triplets < 1 or batch_size < 3 or batch_size % 3:
      raise ValueError(
          f"`num_triplets` must be >= 1 and `batch_size` a positive multiple"
          f" of 3 (whole triplets); got {num_triplets} and {batch_size}.")
    by_label = {}
    for i, label in enumerate(labels.tolist()):
      by_label.setdefault(label, []).append(i)
    if len(by_label) < 2:
      raise ValueError("A triplet needs two labels; `labels` has "
                       f"{len(by_label)}.")
    rs = np.random.RandomState(seed)
    keys = list(by_label)
    triplets = np.empty((int(num_triplets), 3), np.int64)
    for t in range(len(triplets)):
      a_label, n_label = rs.choice(keys, size=2, replace=False)
      anchors = by_label[int(a_label)]
      a, p = rs.choice(anchors, size=2, replace=len(anchors) < 2)
      triplets[t] = (a, p, rs.choice(by_label[int(n_label)], replace=False))
    self.triplets = triplets
    self._order = RandomSampler(len(triplets), batch_size=batch_size // 3,
                                seed=seed)
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.num_examples = int(labels.size)

  def indices(self, step: int) -> np.ndarray:
    """Record indices ``[batch_size]`` (int64): ``batch_size / 3`` triplets,
    each ``anchor, positive, negative`` in a row."""
    return self.triplets[self._order.indices(step)].reshape(-1)


def weights_from_pairs(pos_mask, neg_mask) -> np.ndarray:
  """A record's weight from a miner's pairs over a pass of the dataset:
  how often it appears in them (as anchor or as partner), over the most
  frequent's count (PML's ``convert_to_weights``; all 1 without pairs).

  Args:
    pos_mask, neg_mask: bool ``[N, N]`` mined positive and negative pairs
      of the records (a miner of :mod:`circle_jax.losses.miners` on their
      embeddings, e.g. from :func:`circle_jax.evaluation.embedding.embed_split`).

  Returns:
    float64 ``[N]``.
  """
  pos, neg = np.asarray(pos_mask, bool), np.asarray(neg_mask, bool)
  if pos.ndim != 2 or pos.shape[0] != pos.shape[1] or neg.shape != pos.shape:
    raise ValueError(f"`pos_mask` and `neg_mask` must be square [N, N] "
                     f"masks of the same shape; got {pos.shape} and "
                     f"{neg.shape}.")
  counts = (pos.sum(0) + pos.sum(1) + neg.sum(0) + neg.sum(1)).astype(float)
  top = counts.max(initial=0.0)
  return counts / top if top > 0 else np.ones_like(counts)


class TuplesToWeightsSampler(_Sampler):
  """Records drawn with replacement in proportion to weights (PML's
  ``TuplesToWeightsSampler``, whose weights are a miner's pairs over a pass
  of the dataset: :func:`weights_from_pairs`).

  PML embeds and mines inside the sampler at the start of each epoch; here
  the pass is the caller's (embed, mine, :func:`weights_from_pairs`) and the
  sampler draws batch ``s`` from ``numpy.random.default_rng([seed, s])``,
  so a batch is a function of ``(weights, seed, step)``. Records outside a
  mined subset keep weight 0, as PML's.

  Args:
    weights: float ``[N]``, non-negative, not all 0.
    batch_size: the global batch size.
    seed: non-negative int.
  """

  def __init__(self, weights, *, batch_size: int, seed: int = 0):
    weights = np.asarray(weights, np.float64)
    if (weights.ndim != 1 or not np.all(np.isfinite(weights))
        or np.any(weights < 0) or not weights.sum() > 0):
      raise ValueError("`weights` must be a 1-D array of finite non-negative"
                       " weights, not all 0 (weights_from_pairs gives them).")
    if batch_size < 1 or seed < 0:
      raise ValueError(f"`batch_size` must be >= 1 and `seed` >= 0; got "
                       f"{batch_size} and {seed}.")
    self.probabilities = weights / weights.sum()
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.num_examples = int(weights.size)

  def indices(self, step: int) -> np.ndarray:
    """Record indices ``[batch_size]`` (int64), drawn with replacement."""
    rng = np.random.default_rng([self.seed, _check_step(step)])
    return rng.choice(self.num_examples, self.batch_size,
                      p=self.probabilities).astype(np.int64)
