"""A class-disjoint validation split carved from the train classes.

Zero-shot retrieval is evaluated on classes never seen in training, so a
model-selection split must be too: :func:`split_classes` holds out a fraction
of the *train* classes, and :class:`ClassSubset` gives random-access views of
the records of the kept classes (for training) and of the held-out ones (for
validation), each with labels renumbered ``0 .. C' - 1`` so that proxies and
class weights get exactly one row per trained class.

Which classes are held out depends only on ``(number of classes, fraction,
seed)``, not on the run's seed, so every seed of a comparison validates on the
same classes.
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import numpy as np

from circle_jax.data import builders


def num_holdout_classes(num_classes: int, fraction: float) -> int:
  """``round(fraction * C)`` held-out classes, at least 2 when ``fraction > 0``.

  Raises:
    ValueError: ``fraction`` outside ``[0, 1)``, or fewer than 2 classes would
      be left on either side (retrieval needs 2 classes to rank).
  """
  if not 0.0 <= fraction < 1.0:
    raise ValueError(f"validation fraction must be in [0, 1); got {fraction}.")
  if fraction == 0.0:
    return 0
  n = max(2, int(round(fraction * num_classes)))
  if num_classes - n < 2:
    raise ValueError(
        f"validation fraction {fraction} of {num_classes} train classes "
        f"holds out {n} and leaves {num_classes - n} to train on; lower it "
        "(both sides need at least 2 classes).")
  return n


def holdout_classes(num_classes: int, fraction: float,
                    seed: int = 0) -> np.ndarray:
  """The sorted class ids held out for validation (a seeded random choice)."""
  n = num_holdout_classes(num_classes, fraction)
  rng = np.random.default_rng([int(seed), 7919])
  return np.sort(rng.permutation(num_classes)[:n]).astype(np.int64)


class ClassSubset:
  """Random-access view of the records of some classes of a source.

  Supports what the pipelines use: ``len``, ``source[i]``,
  ``source.__getitems__(indices)`` and :attr:`labels` (read by
  :func:`circle_jax.data.split_labels` without touching the images). Record
  ``i`` is the ``i``-th record of the source whose label is in ``classes``, in
  source order, with its label replaced by the position of that label in
  ``classes``. Picklable (for grain worker processes) when the source is.

  Args:
    source: a random-access source of ``{'image', 'label', ...}`` records.
    classes: the kept labels of ``source``.
    source_labels: ``split_labels(source)``, if already known.
  """

  def __init__(self, source: Any, classes: Sequence[int],
               source_labels: np.ndarray | None = None):
    if source_labels is None:
      source_labels = builders.split_labels(source)
    classes = np.asarray(classes, np.int64)
    remap = np.full(int(source_labels.max()) + 1, -1, np.int64)
    remap[classes] = np.arange(len(classes))
    self.source = source
    self.classes = classes
    self.indices = np.flatnonzero(remap[source_labels] >= 0)
    self.labels = remap[source_labels[self.indices]]

  def __len__(self) -> int:
    return len(self.indices)

  def _record(self, record, i):
    record = dict(record)
    record["label"] = self.labels[i]
    return record

  def __getitem__(self, i):
    i = int(i)
    return self._record(self.source[int(self.indices[i])], i)

  def __getitems__(self, keys):
    keys = [int(k) for k in keys]
    outer = [int(self.indices[k]) for k in keys]
    getitems = getattr(self.source, "__getitems__", None)
    records = (getitems(outer) if getitems is not None
               else [self.source[k] for k in outer])
    return [self._record(r, k) for r, k in zip(records, keys)]


def split_classes(source: Any, *, fraction: float, seed: int = 0
                  ) -> Tuple[ClassSubset, ClassSubset]:
  """``(train, validation)`` views of a train split, class-disjoint.

  Args:
    source: the train split (labels ``0 .. C-1``).
    fraction: share of the classes held out (see :func:`num_holdout_classes`).
    seed: which classes (:func:`holdout_classes`).

  Returns:
    Two :class:`ClassSubset` s; ``validation.classes`` are the held-out
    labels of ``source``.
  """
  labels = builders.split_labels(source)
  num_classes = int(labels.max()) + 1
  held = holdout_classes(num_classes, fraction, seed)
  kept = np.setdiff1d(np.arange(num_classes), held)
  return (ClassSubset(source, kept, labels),
          ClassSubset(source, held, labels))
