"""Reductions of per-anchor terms over the (global) batch.

With ``axis_name`` every sum runs over the devices with exact gradients
(:func:`circle_jax.ops.maybe_global_sum`): the value is that of the global
batch on every device and the gradient with respect to the local terms that
of the single-device loss on the concatenated batch. Counts carry no
gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from circle_jax import ops

Array = jax.Array


def local_row_offset(local_batch: int, axis_name):
  """Index of this device's first anchor in the gathered global batch."""
  if axis_name is None:
    return 0
  return jax.lax.axis_index(axis_name) * local_batch


def mean_over_valid(per_anchor: Array, valid: Array, axis_name=None) -> Array:
  """Mean of ``per_anchor`` over valid anchors of the (global) batch; 0 if none."""
  valid = valid.astype(jnp.float32)
  total = ops.maybe_global_sum(jnp.sum(jnp.where(valid > 0, per_anchor, 0.0)), axis_name)
  count = jax.lax.stop_gradient(ops.maybe_global_sum(jnp.sum(valid), axis_name))
  return total / jnp.maximum(count, 1.0)


def sum_over_batch(per_anchor: Array, axis_name=None) -> Array:
  """Sum of ``per_anchor`` over the (global) batch divided by its size."""
  batch = per_anchor.shape[0]
  if axis_name is not None:
    batch = batch * jax.lax.psum(1, axis_name)
  return ops.maybe_global_sum(jnp.sum(per_anchor), axis_name) / batch


def ratio_of_sums(total: Array, count: Array, axis_name=None) -> Array:
  """(Global) ``sum(total) / max(sum(count), 1)``; the count has no gradient."""
  total = ops.maybe_global_sum(jnp.sum(total), axis_name)
  count = jax.lax.stop_gradient(
      ops.maybe_global_sum(jnp.sum(count.astype(jnp.float32)), axis_name))
  return total / jnp.maximum(count, 1.0)


def to_float32_scalar(x) -> Array:
  return jnp.asarray(x, jnp.float32).reshape(())



# ----------------------------------------------------------------------------
# The `reduction` option of the pair losses: pytorch-metric-learning's
# reducers on a loss's terms (its elements: anchors, pairs or triplets).
# ----------------------------------------------------------------------------

REDUCTIONS = ("mean", "sum", "avg_non_zero", "threshold", "class_weighted",
              "divisor", "none")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["low", "high", "weights", "divisor"],
                   meta_fields=["kind"])
@dataclasses.dataclass(frozen=True)
class Reduction:
  """A reduction of a loss's terms by name, with its parameters.

  The kinds are pytorch-metric-learning's reducers on the loss's elements
  (:data:`REDUCTIONS`; docs/reductions.md lists each loss's elements):

  * ``"mean"``: the mean over the elements (``MeanReducer``);
  * ``"sum"``: their sum (``SumReducer``);
  * ``"avg_non_zero"``: the mean over the elements with a term ``> 0``
    (``AvgNonZeroReducer``);
  * ``"threshold"``: the mean over the elements with ``low < term < high``
    (``ThresholdReducer``; ``None`` leaves that side open);
  * ``"class_weighted"``: the mean of ``weights[label] * term``, the label
    the anchor's (``ClassWeightedReducer``);
  * ``"divisor"``: the sum divided by ``divisor`` (``DivisorReducer``,
    whose divisor the loss gives; here it is this constant);
  * ``"none"``: the terms themselves (``DoNothingReducer``): the anchors'
    ``[M]`` or the pairs' ``[M, N]`` (0 outside the elements).

  An empty selection gives 0 (and a zero gradient).

  Attributes:
    kind: one of :data:`REDUCTIONS` (static).
    low, high: ``"threshold"``'s bounds (exclusive).
    weights: ``"class_weighted"``'s ``[C]`` weight of each class.
    divisor: ``"divisor"``'s divisor.
  """

  kind: str = "mean"
  low: Optional[float] = None
  high: Optional[float] = None
  weights: Optional[tuple] = None
  divisor: float = 1.0

  def __post_init__(self):
    if self.kind not in REDUCTIONS:
      raise ValueError(f"`reduction` must be one of {REDUCTIONS}; got "
                       f"{self.kind!r}.")
    if self.kind == "threshold" and self.low is None and self.high is None:
      raise ValueError("reduction='threshold' needs `low` or `high` (or "
                       "both): the bounds of the kept terms.")
    if self.kind == "class_weighted" and self.weights is None:
      raise ValueError("reduction='class_weighted' needs `weights`, one per "
                       "class.")


def as_reduction(reduction) -> Optional[Reduction]:
  """``None`` (the loss's own reduction), a :class:`Reduction` (or a
  :class:`PerAnchorReducer`, :class:`MultipleReducers`), or one from its
  name."""
  if reduction is None or isinstance(
      reduction, (Reduction, PerAnchorReducer, MultipleReducers)):
    return reduction
  if isinstance(reduction, str):
    return Reduction(kind=reduction)
  raise ValueError(f"`reduction` must be None, a name in {REDUCTIONS} or a "
                   f"Reduction; got {reduction!r}.")


def refuse_reduction(reduction, loss: str, reason: str) -> None:
  """One line for a loss that has only its own reduction."""
  if reduction is not None:
    raise ValueError(f"The {loss} has only its own reduction ({reason}); "
                     "drop `reduction`.")


def reduce_terms(terms: Array, elements: Array, reduction: Reduction, *,
                 labels: Array, axis_name=None, name: str = "loss") -> Array:
  """``reduction`` of the terms of the (global) batch's elements.

  The one reducer of every loss's ``reduction`` option: each of its kinds
  is a ratio of global sums (:func:`ratio_of_sums`), so with ``axis_name``
  the value and the gradient are those of the single-device batch.

  Args:
    terms: ``[M, ...]`` the loss's terms of this device's anchors (a pair's
      or a triplet's term in the row of its anchor).
    elements: bool, the shape of ``terms``: which entries are elements.
    reduction: a :class:`Reduction`.
    labels: ``[M]`` the anchors' labels (``"class_weighted"``).
    axis_name: optional mapped axis: the global batch.
    name: PML's name of this set of terms (``"loss"``; a pair loss's
      ``"pos_loss"``, ``"neg_loss"``): the key of :class:`MultipleReducers`.

  Returns:
    a float32 scalar, or with ``"none"`` the terms (0 outside the
    elements).
  """
  if not isinstance(reduction, Reduction):
    return _reduce_composite(terms, elements, reduction, labels=labels,
                             axis_name=axis_name, name=name)
  terms = jnp.where(elements, terms, 0.0)
  kind = reduction.kind
  if kind == "none":
    return terms
  count = elements
  if kind == "avg_non_zero":
    count = elements & (terms > 0)
  elif kind == "threshold":
    if reduction.low is not None:
      count = count & (terms > reduction.low)
    if reduction.high is not None:
      count = count & (terms < reduction.high)
    terms = jnp.where(count, terms, 0.0)
  elif kind == "class_weighted":
    weights = jnp.asarray(reduction.weights, terms.dtype)
    shape = (-1,) + (1,) * (terms.ndim - 1)
    terms = terms * jnp.take(weights, labels, mode="clip").reshape(shape)
  if kind in ("sum", "divisor"):
    total = ops.maybe_global_sum(jnp.sum(terms), axis_name)
    if kind == "sum":
      return total
    divisor = jnp.asarray(reduction.divisor, total.dtype)
    nonzero = divisor != 0  # PML: a zero divisor gives a zero loss
    return jnp.where(nonzero, total / jnp.where(nonzero, divisor, 1.0), 0.0)
  return ratio_of_sums(terms, count, axis_name)


# ----------------------------------------------------------------------------
# pytorch-metric-learning's composite reducers: PerAnchorReducer and
# MultipleReducers, on the same terms (reduce_terms dispatches to them).
# ----------------------------------------------------------------------------


def _check_inner(reducer, composite: str) -> Reduction:
  if not isinstance(reducer, Reduction) or reducer.kind == "none":
    raise ValueError(f"{composite} takes Reductions other than 'none' "
                     f"(the terms must become a number); got {reducer!r}.")
  return reducer


@dataclasses.dataclass(frozen=True)
class PerAnchorReducer:
  """PML's ``PerAnchorReducer``: a pair loss's terms averaged per anchor,
  then ``reducer`` of those per-anchor terms (every anchor an element).

  An anchor's term is the mean of its row's elements (its pairs of the
  set), 0 for an anchor without one, as PML's default ``aggregation_func``;
  anchor terms (a rule's per-anchor losses) go to ``reducer`` unchanged;
  triplet terms are refused, as PML does.

  Attributes:
    reducer: the :class:`Reduction` of the per-anchor terms (PML's
      ``reducer``, default ``MeanReducer``: ``Reduction("mean")``).
  """

  reducer: Reduction = Reduction()

  kind = "per_anchor"

  def __post_init__(self):
    _check_inner(self.reducer, "PerAnchorReducer")


@dataclasses.dataclass(frozen=True)
class MultipleReducers:
  """PML's ``MultipleReducers``: each named set of a loss's terms (PML's
  sub-loss names: ``"pos_loss"`` and ``"neg_loss"`` of a pair loss,
  ``"loss"`` of the others) reduced by its own :class:`Reduction` (by
  ``default_reducer`` when not named), and the results added.

  Attributes:
    reducers: ``{name: Reduction}`` (kept as sorted ``(name, Reduction)``
      pairs, so the reducer is hashable and can be a static option).
    default_reducer: the :class:`Reduction` of the other sets (PML's
      default ``MeanReducer``).
  """

  reducers: Tuple[Tuple[str, Reduction], ...] = ()
  default_reducer: Reduction = Reduction()

  kind = "multiple"

  def __post_init__(self):
    pairs = self.reducers
    pairs = tuple(sorted((pairs.items() if isinstance(pairs, Mapping)
                          else pairs)))
    for name, reducer in pairs + (("default_reducer", self.default_reducer),):
      if not isinstance(name, str):
        raise ValueError(f"MultipleReducers' keys are sub-loss names "
                         f"('pos_loss', 'neg_loss', 'loss'); got {name!r}.")
      _check_inner(reducer, "MultipleReducers")
    object.__setattr__(self, "reducers", pairs)

  def reducer_of(self, name: str) -> Reduction:
    """The :class:`Reduction` of the set of terms ``name``."""
    return dict(self.reducers).get(name, self.default_reducer)


def _reduce_composite(terms, elements, reduction, *, labels, axis_name,
                      name):
  """:func:`reduce_terms` with a :class:`PerAnchorReducer` or
  :class:`MultipleReducers`."""
  if isinstance(reduction, MultipleReducers):
    return reduce_terms(terms, elements, reduction.reducer_of(name),
                        labels=labels, axis_name=axis_name)
  if not isinstance(reduction, PerAnchorReducer):
    raise ValueError(f"Not a reduction: {reduction!r}; see "
                     "circle_jax.losses.engine.reductions.")
  if terms.ndim > 2:
    raise ValueError("PerAnchorReducer takes anchor or pair terms, not "
                     "triplets (as PML's); use a Reduction.")
  if terms.ndim == 2:  # pairs: each anchor's mean over its row's elements
    count = jnp.sum(elements, axis=1)
    total = jnp.sum(jnp.where(elements, terms, 0.0), axis=1)
    terms = jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)
  return reduce_terms(terms, jnp.ones(terms.shape, bool), reduction.reducer,
                      labels=labels, axis_name=axis_name)


def reduce_pair_sets(sets, reduction: Reduction, *, labels: Array,
                     axis_name=None) -> Array:
  """``reduction`` of a loss's pair terms in sets (its positive pairs, its
  negative pairs): each set reduced on its own by :func:`reduce_terms` and
  the results added (PML's ``MultipleReducers``).

  Args:
    sets: ``((terms, elements), ...)``, ``[M, N]`` each: a set's pair terms
      in the rows of their anchors and which pairs are its elements
      (disjoint across the sets). Two sets are PML's sub-losses
      ``pos_loss`` and ``neg_loss`` (for :class:`MultipleReducers`), one set
      is ``loss``.
    reduction, labels, axis_name: as :func:`reduce_terms`.

  Returns:
    a float32 scalar, or with ``"none"`` the ``[M, N]`` terms of every set
    (0 outside the elements).
  """
  if reduction.kind == "none":
    return sum(jnp.where(e, t, 0.0) for t, e in sets)
  names = ("pos_loss", "neg_loss") if len(sets) == 2 else ("loss",) * len(sets)
  return to_float32_scalar(sum(
      reduce_terms(t, e, reduction, labels=labels, axis_name=axis_name,
                   name=name) for (t, e), name in zip(sets, names)))
