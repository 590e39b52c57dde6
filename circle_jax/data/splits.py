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

Held-out superclasses. When the test classes come from superclasses never
seen in training (Omniglot's test characters are of new *alphabets*), a
validation split of held-out classes of the trained superclasses measures an
easier transfer than the test does: a choice that helps within an alphabet
can hurt across alphabets. Given the train split's superclasses
(``superclasses``: the class count of each, in label order), the held-out
classes are instead all the classes of ``max(1, round(fraction * G))`` of the
``G`` superclasses, so validation, like the test, is on superclasses the
model never trained on.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from circle_jax.data import builders


Superclasses = Optional[Sequence[int]]


def _check_fraction(fraction: float) -> None:
  if not 0.0 <= fraction < 1.0:
    raise ValueError(f"validation fraction must be in [0, 1); got {fraction}.")


def _check_sides(num_classes: int, held: int, what: str) -> None:
  if num_classes - held < 2 or held < 2:
    raise ValueError(
        f"{what} holds out {held} of the {num_classes} train classes and "
        f"leaves {num_classes - held} to train on; change it (both sides need "
        "at least 2 classes).")


def _superclass_starts(num_classes: int, superclasses: Sequence[int]
                       ) -> np.ndarray:
  sizes = np.asarray([int(n) for n in superclasses], np.int64)
  if len(sizes) < 2 or np.any(sizes < 1) or int(sizes.sum()) != num_classes:
    raise ValueError(
        f"superclasses must be the class counts (each >= 1) of at least 2 "
        f"superclasses summing to the {num_classes} train classes; got "
        f"{list(sizes)}.")
  return np.concatenate([[0], np.cumsum(sizes)])


def _seeded_choice(n: int, k: int, seed: int) -> np.ndarray:
  """``k`` of ``range(n)``, sorted: a function of ``(n, k, seed)`` only."""
  rng = np.random.default_rng([int(seed), 7919])
  return np.sort(rng.permutation(n)[:k]).astype(np.int64)


def holdout_superclasses(num_superclasses: int, fraction: float,
                         seed: int = 0) -> np.ndarray:
  """The sorted superclass indices held out: ``max(1, round(fraction * G))``
  of ``G`` (a seeded random choice; at least one is left to train on)."""
  _check_fraction(fraction)
  if fraction == 0.0:
    return np.zeros([0], np.int64)
  n = max(1, int(round(fraction * num_superclasses)))
  if n >= num_superclasses:
    raise ValueError(
        f"validation fraction {fraction} of {num_superclasses} superclasses "
        f"holds out {n} and leaves none to train on; lower it.")
  return _seeded_choice(num_superclasses, n, seed)


def holdout_classes(num_classes: int, fraction: float, seed: int = 0, *,
                    superclasses: Superclasses = None) -> np.ndarray:
  """The sorted class ids held out for validation (a seeded random choice).

  Args:
    num_classes: ``C``, the train split's classes (labels ``0 .. C-1``).
    fraction: the share held out, in ``[0, 1)``.
    seed: which ones.
    superclasses: None: ``round(fraction * C)`` classes (at least 2). Else
      the class count of each superclass in label order (the classes of a
      superclass are consecutive labels): every class of the held-out
      superclasses (:func:`holdout_superclasses`).

  Raises:
    ValueError: ``fraction`` outside ``[0, 1)``; fewer than 2 classes on
      either side; ``superclasses`` that do not sum to ``C``.
  """
  _check_fraction(fraction)
  if fraction == 0.0:
    return np.zeros([0], np.int64)
  if superclasses is None:
    n = max(2, int(round(fraction * num_classes)))
    _check_sides(num_classes, n, f"validation fraction {fraction}")
    return _seeded_choice(num_classes, n, seed)
  starts = _superclass_starts(num_classes, superclasses)
  groups = holdout_superclasses(len(starts) - 1, fraction, seed)
  held = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in groups])
  _check_sides(num_classes, len(held),
               f"validation fraction {fraction} of superclasses {list(groups)}")
  return held.astype(np.int64)


def num_holdout_classes(num_classes: int, fraction: float, seed: int = 0, *,
                        superclasses: Superclasses = None) -> int:
  """How many classes :func:`holdout_classes` holds out: ``round(fraction *
  C)``, at least 2 when ``fraction > 0``, or all those of the held-out
  superclasses.

  Raises:
    ValueError: as :func:`holdout_classes`.
  """
  return len(holdout_classes(num_classes, fraction, seed,
                             superclasses=superclasses))


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


def split_classes(source: Any, *, fraction: float, seed: int = 0,
                  superclasses: Superclasses = None
                  ) -> Tuple[ClassSubset, ClassSubset]:
  """``(train, validation)`` views of a train split, class-disjoint.

  Args:
    source: the train split (labels ``0 .. C-1``).
    fraction: share of the classes held out (see :func:`holdout_classes`).
    seed: which classes (:func:`holdout_classes`).
    superclasses: hold out whole superclasses, of these class counts in
      label order (:func:`holdout_classes`).

  Returns:
    Two :class:`ClassSubset` s; ``validation.classes`` are the held-out
    labels of ``source``.
  """
  labels = builders.split_labels(source)
  num_classes = int(labels.max()) + 1
  held = holdout_classes(num_classes, fraction, seed,
                         superclasses=superclasses)
  kept = np.setdiff1d(np.arange(num_classes), held)
  return (ClassSubset(source, kept, labels),
          ClassSubset(source, held, labels))
