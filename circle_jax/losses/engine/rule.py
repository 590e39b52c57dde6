"""The pair-rule interface: what a pair loss says, and nothing about how it
is run (see :mod:`circle_jax.losses.engine` for the whole contract).

A rule sees a tile ``s`` ``[R, C]`` of similarities (rows: anchors, columns:
candidates; what "similarity" means is the geometry's,
:mod:`circle_jax.losses.engine.geometry`) and the anchors' positive /
negative pair masks. :class:`PairRule` gives the defaults of every method.
All block methods are elementwise in the tile (the engines rely on it to
tile the block):

* ``prepare(s)``: the quantity ``x`` the rule reads (the similarity itself,
  or e.g. the Euclidean distance of unit vectors);
* ``prepass``: per-anchor statistics of ``x`` over the label sets, taken
  without gradient before anything else, as ``(op, set)`` pairs with
  ``op in ("min", "max")`` and ``set in ("pos", "neg")``; the engines hand
  them to the rule as ``[R, 1]`` arrays ``pre``;
* ``select(x, pos, neg, pre)``: the pairs the loss uses (mining, non-trivial
  pairs), decisions without gradient;
* ``statistic``: ``"lse"``, the set statistic is ``logsumexp(logit)``;
  ``"mean"``, the ``exp(logit)``-weighted mean of ``values(x)``, the weights
  constant in backprop; or ``"sum"``, the pair ``(sum of values(x), number
  of pairs)`` of the set (the count without gradient); or a pair of these,
  one per set ``(positive set's, negative set's)`` (a ``"sum"`` set's
  logits are 0), e.g. SupCon's ``("sum", "lse")``: the positives' sum and
  count, and the logsumexp over all candidates (:func:`set_statistics`).
  The two sets are disjoint, except that a ``"sum"`` set may overlap the
  other (``select`` may widen the negatives to every candidate);
* ``logits(x) -> (logit_p, logit_n)`` (not for ``"sum"``) and, for
  ``"mean"`` and ``"sum"``, ``values(x) -> (v_p, v_n)``;
* ``shift(pre)``: optionally the row maxima of the logits when the pre-pass
  already gives them (saves the dense engine two max passes), else ``None``;
* ``combine(stat_p, stat_n) -> (per_anchor, valid)``, rowwise; an empty set's
  statistic is ``-inf`` (``"lse"``) or ``0`` (``"mean"``, ``"sum"``);
  ``per_anchor`` is ``[R]`` or a tuple of ``[R]`` terms;
* ``geometry``: how a tile's similarities are made
  (:mod:`circle_jax.losses.engine.geometry`; cosine by default). It is a
  static keyword-only field of every :func:`rule_dataclass` (its default the
  class attribute), so the shared ``geometry`` option replaces it in any
  rule (:func:`with_geometry`);
* ``ranges``: the documented range of each hyperparameter (name ->
  :class:`circle_jax.losses.ranges.HyperRange`), checked for concrete values
  when the rule is built and exposed by :func:`circle_jax.losses.hyper_ranges`;
* ``reduction``: ``"valid_mean"`` (mean over valid anchors of the global
  batch), ``"batch_mean"`` (sum over anchors / global batch size), or the
  rule's own ``reduce(per_anchor, valid, axis_name)``;
* ``first_stage()``: ``None`` (a one-stage rule), or a *two-stage* rule's
  first stage: a rule whose per-anchor output ``t`` (e.g. the anchor's
  logsumexp over its negatives, :class:`NegativeLogsumexp`) this rule's
  pairs read. Every engine runs the first stage, then this rule with
  ``prepare(s, t_row, t_col)``: ``t_row`` ``[R, 1]`` the anchors' ``t`` and
  ``t_col`` ``[1, C]`` the candidates' own (where the candidates are the
  anchors and ``column_stage`` is set; else ``None``), and differentiates
  through ``t`` (the sides' ``aux``,
  :class:`~circle_jax.losses.engine.tiles.PairSide`). So a pair term may
  read a per-anchor statistic *with its gradient* (N-pair, lifted
  structure).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Mapping, Tuple

import jax
import jax.numpy as jnp

from circle_jax.losses.engine import reductions
from circle_jax.losses import ranges as ranges_lib
from circle_jax.losses.engine import geometry as geometry_lib

NEG_INF = -jnp.inf


class PairRule:
  """Defaults of the rule interface (see the module docstring)."""

  # The similarity of a tile (geometry.py); a class attribute, static.
  geometry: geometry_lib.Geometry = geometry_lib.COSINE
  statistic = "lse"
  prepass: Tuple[Tuple[str, str], ...] = ()
  reduction = "valid_mean"
  ranges: Mapping[str, ranges_lib.HyperRange] = types.MappingProxyType({})

  def check_ranges(self):
    """Raises ValueError for a concrete hyperparameter outside ``ranges``."""
    ranges_lib.check_ranges({n: getattr(self, n) for n in self.ranges},
                            self.ranges, f"the {type(self).__name__} rule")

  def __post_init__(self):
    self.check_ranges()

  def prepare(self, s):
    return s

  def select(self, x, pos, neg, pre):
    del x, pre
    return pos, neg

  def values(self, x):
    raise NotImplementedError(f"{type(self).__name__} has no values.")

  def logits(self, x):
    # "sum" rules weigh every pair of a set by exp(0) = 1.
    zero = jnp.zeros_like(x)
    return zero, zero

  def shift(self, pre):
    del pre
    return None

  # Whether a rule with its own `reduce` of per-anchor sums over pairs has
  # pair terms (`pair_values`, times `side_weights`) whose per-set means its
  # `reduce` adds (the `reduction` option then reduces them instead:
  # dispatch.term_kind, dispatch.pair_terms).
  pair_terms = False

  def pair_values(self, x, sel_p, sel_n):
    """``(v_p, v_n)``, ``[M, N]``: the pair terms on a whole block (read
    where ``sel_p`` / ``sel_n``, the selected pairs); ``values`` unless a
    term reads a statistic of its row."""
    del sel_p, sel_n
    return self.values(x)

  def side_weights(self):
    """``(w_+, w_-)``: the weights of the positive and negative sets' means
    in the rule's own reduction (and of their pair terms)."""
    return 1.0, 1.0

  # Two-stage rules (module docstring): the first stage, and whether the
  # pairs read the candidates' first-stage statistic too.
  column_stage = False

  def first_stage(self):
    return None


class NegativeLogsumexp(PairRule):
  """A first stage: per anchor, ``t = LSE_{n in N} logit_n`` (``-inf``, not
  valid, when it has no negative).

  A subclass (a :func:`rule_dataclass`) gives ``logits(x) -> (0,
  logit_n)``; the positives take no part (a ``"sum"`` of zeros).
  """

  statistic = ("sum", "lse")

  def values(self, x):
    zero = jnp.zeros_like(x)
    return zero, zero

  def combine(self, sum_count_p, lse_n):
    del sum_count_p
    return lse_n, lse_n != NEG_INF


class PositivePairMean(PairRule):
  """Per anchor, the sum of ``v_p`` over its positive pairs and their count
  (``"sum"``); the loss is ``scale`` times the global mean over the pairs
  (the sums over every device's anchors, divided).

  A subclass gives ``values(x) -> (v_p, 0)`` (and may ``select`` pairs).
  """

  statistic = "sum"
  scale = 1.0

  def combine(self, sum_count_p, sum_count_n):
    del sum_count_n
    return sum_count_p, sum_count_p[1] > 0

  def side_weights(self):
    return self.scale, 0.0

  def reduce(self, terms, valid, axis_name):
    del valid
    return self.side_weights()[0] * reductions.ratio_of_sums(*terms,
                                                             axis_name)


class PairSetMeans(PairRule):
  """Per anchor, the sums of ``v_p`` over its positive pairs and of ``v_n``
  over its negative pairs, with their counts (``"sum"``); the loss is
  ``w_+`` times the global mean over the positive pairs plus ``w_-`` times
  the global mean over the negative pairs (each side's sums over every
  device's anchors, divided; a side without pairs adds 0).

  A subclass gives ``values(x) -> (v_p, v_n)`` (and may ``select`` pairs)
  and, for weights other than 1, ``side_weights() -> (w_+, w_-)``.
  """

  statistic = "sum"

  def combine(self, sum_count_p, sum_count_n):
    terms = sum_count_p + sum_count_n  # (sum_p, count_p, sum_n, count_n)
    return terms, jnp.ones(terms[0].shape, bool)

  def reduce(self, terms, valid, axis_name):
    del valid
    sum_p, count_p, sum_n, count_n = terms
    w_p, w_n = self.side_weights()
    return (w_p * reductions.ratio_of_sums(sum_p, count_p, axis_name)
            + w_n * reductions.ratio_of_sums(sum_n, count_n, axis_name))


def set_statistics(rule) -> Tuple[str, str]:
  """``(positive set's, negative set's)`` statistic of ``rule``."""
  kind = rule.statistic
  return (kind, kind) if isinstance(kind, str) else tuple(kind)


def both_sets_nonempty(stat_p, stat_n):
  """Validity of an anchor whose set statistics are logsumexps (``-inf`` empty).

  NaN is not ``-inf``, so a non-finite input is never taken for an empty set.
  """
  return (stat_p != NEG_INF) & (stat_n != NEG_INF)


def rule_dataclass(cls=None, *, meta=()):
  """A frozen dataclass rule whose hyperparameters are pytree leaves.

  Fields named in ``meta`` are static (e.g. ``mining``); the others are the
  hyperparameters, which may be Python numbers or traced scalars. The
  class's field defaults are the loss's defaults (the public functions read
  them from there) and ``__post_init__`` checks them when concrete. Every
  such rule also gets the static keyword-only field ``geometry`` (default:
  the class's ``geometry`` attribute, cosine unless the rule sets another).
  """
  def wrap(cls):
    own = cls.__dict__.get("__annotations__", {})
    inherited = getattr(cls, "__dataclass_fields__", {})
    if "geometry" not in own and "geometry" not in inherited:
      cls.__annotations__ = {**own, "geometry": "geometry_lib.Geometry"}
      cls.geometry = dataclasses.field(default=cls.geometry, kw_only=True)
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    static = set(meta) | {"geometry"}
    return jax.tree_util.register_dataclass(
        cls, data_fields=[n for n in names if n not in static],
        meta_fields=[n for n in names if n in static])
  return wrap if cls is None else wrap(cls)


def with_geometry(rule, geometry: geometry_lib.Geometry):
  """``rule`` with its tiles' similarity made by ``geometry`` (a
  :class:`circle_jax.losses.engine.Geometry`; ``None`` keeps the rule's)."""
  if geometry is None or geometry == rule.geometry:
    return rule
  if not isinstance(geometry, geometry_lib.Geometry):
    raise ValueError(
        f"`geometry` must be a Geometry, e.g. losses.Poincare(c=0.1, r=2.3) "
        f"or losses.engine.COSINE, or a name in {geometry_lib.names()}; got "
        f"{geometry!r}.")
  return dataclasses.replace(rule, geometry=geometry)


def as_distance(rule, s: jax.Array) -> jax.Array:
  """The block ``s`` as distances for a rule with the static field
  ``on_distance`` (the rules of the ``*_from_distance`` forms).

  ``rule.on_distance``: ``s`` already holds distances and is returned as it
  is. Otherwise ``s`` holds the geometry's similarities, turned into its
  distance by ``rule.geometry.to_distance`` (cosine: the Euclidean distance
  of unit vectors ``sqrt(2 - 2 s)``, 0 with a zero gradient at ``s = 1``;
  Poincaré: ``-s``).
  """
  return s if rule.on_distance else rule.geometry.to_distance(s)
