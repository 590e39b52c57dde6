"""Engines that run a pair-loss *rule* over anchors and candidates.

A pair loss is split in two:

* its **rule** (in the loss's own module: ``circle.py`` (Circle, unified),
  ``multi_similarity.py``, ``ranked_list.py``, ``pair_baselines.py``
  (contrastive)) says what the loss computes from a block of
  similarities ``s`` ``[R, C]`` (rows: anchors, columns: candidates) and the
  anchors' positive / negative pair masks: which pairs it keeps, the
  per-anchor statistic of each set and how the two statistics combine into the
  anchor's loss; constants in backprop are marked with ``stop_gradient``;
* an **engine** (here) evaluates any rule: :func:`dense_per_anchor` on a whole
  ``[M, N]`` block, :func:`blockwise_per_anchor` in ``block_size`` tiles with
  online statistics and a ``custom_vjp`` that recomputes the tiles in the
  backward pass. No engine holds a loss formula.

The rule interface (:class:`PairRule` gives the defaults). All block methods
are elementwise in the block (the engines rely on it to tile it):

* ``prepare(s)``: the quantity ``x`` the rule reads (the similarity itself,
  or e.g. the Euclidean distance of unit vectors);
* ``prepass``: per-anchor statistics of ``x`` over the label sets, taken
  without gradient before anything else, as ``(op, set)`` pairs with
  ``op in ("min", "max")`` and ``set in ("pos", "neg")`` (Multi-Similarity's
  smallest positive and largest negative similarity); the engines hand them
  to the rule as ``[R, 1]`` arrays ``pre``;
* ``select(x, pos, neg, pre)``: the pairs the loss uses (mining, non-trivial
  pairs), decisions without gradient;
* ``statistic``: ``"lse"``, the set statistic is ``logsumexp(logit)``;
  ``"mean"``, the ``exp(logit)``-weighted mean of ``values(x)``, the weights
  constant in backprop; or ``"sum"``, the pair ``(sum of values(x), number
  of pairs)`` of the set (the count without gradient);
* ``logits(x) -> (logit_p, logit_n)`` (not for ``"sum"``) and, for
  ``"mean"`` and ``"sum"``, ``values(x) -> (v_p, v_n)``;
* ``shift(pre)``: optionally the row maxima of the logits when the pre-pass
  already gives them (saves the dense engine two max passes), else ``None``;
* ``combine(stat_p, stat_n) -> (per_anchor, valid)``, rowwise; an empty set's
  statistic is ``-inf`` (``"lse"``) or ``0`` (``"mean"``, ``"sum"``);
  ``per_anchor`` is ``[R]`` or a tuple of ``[R]`` terms;
* ``ranges``: the documented range of each hyperparameter (name ->
  :class:`circle_jax.losses._common.HyperRange`), checked for concrete values
  by the default ``__post_init__`` and exposed by
  :func:`circle_jax.losses.hyper_ranges`;
* ``reduction``: ``"valid_mean"`` (mean over valid anchors of the global
  batch), ``"batch_mean"`` (sum over anchors / global batch size), or the
  rule's own ``reduce(per_anchor, valid, axis_name)`` (e.g. contrastive's
  ratios of global sums and pair counts).

The blockwise backward pass needs ``dL/ds`` of a tile, and derives it from the
rule instead of asking for a hand-written gradient: for a pair ``j`` of set
``P`` of anchor ``i``,

  dL/ds_ij = d combine/d stat_P (i) * softmax_P(logit)_ij * d f_ij / d s_ij,

with ``f = logits`` for ``"lse"`` and ``f = values`` for ``"mean"`` (for
``"sum"`` the softmax factor is 1 on the set); the first
factor is a ``jax.vjp`` of ``combine`` and the last an elementwise
``jax.jvp`` of ``prepare`` and ``f`` (which honours the rule's
``stop_gradient`` constants), so dense (autodiff) and blockwise share one
definition of the gradient too.

Rows and columns. An engine sees rows (the local anchors) and columns (the
candidates) as :class:`PairSide` s: normalised embeddings, labels, *ids* and
an optional column *valid* mask. A row and a column with the same id are the
same sample (a self pair: neither positive nor negative) and a column whose
``valid`` is False takes no part in any pair; ids place the anchors among
candidates that may come from elsewhere. :func:`pair_sides` builds both for
every embedding form: the columns are the batch gathered over ``axis_name``
(ids: the global row indices), or, with reference embeddings (e.g. a
cross-batch memory, Wang et al., CVPR 2020), the references gathered over
``axis_name`` with their ``ref_ids`` and ``ref_valid``. References are just
other columns, so every rule and engine runs on them unchanged.

Adding an engine. A third engine (e.g. a device ring that passes column
blocks around the devices with ``jax.lax.ppermute``) is a new
function ``(rule, rows, cols, ...) -> (per_anchor, valid)`` built from the
tile-level pieces below, with no change to any loss: :func:`prepass_update`
for the pre-pass, :func:`stats_init` / :func:`stats_update` /
:func:`stats_finish` for the online set statistics of each tile it sees,
``rule.combine`` for the per-anchor loss, and :func:`tile_cotangent` for the
``dL/ds`` of a tile in its backward pass. :func:`reduce_per_anchor` gives the
rule's (global-batch) reduction. Every embedding form of a rule-based loss
goes through :func:`embedding_loss`, which picks the engine (from
``block_size`` and ``collective``), so a new engine is selected there, once
for all losses. The device ring (:mod:`circle_jax.losses.ring`,
``collective="ring"``) is such an engine: the column shards travel around the
devices with ``ppermute``, each tile folded into the rows' online statistics
as it passes, and its ``custom_vjp`` sends each shard's ``dL/dz`` around with
the shard.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Mapping, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from circle_jax.losses import _common

Array = jax.Array

_F32 = jnp.float32
_NEG_INF = -jnp.inf


# ----------------------------------------------------------------------------
# The rule interface.
# ----------------------------------------------------------------------------


class PairRule:
  """Defaults of the rule interface (see the module docstring)."""

  statistic = "lse"
  prepass: Tuple[Tuple[str, str], ...] = ()
  reduction = "valid_mean"
  # The documented range of each checked hyperparameter (name ->
  # _common.HyperRange), enforced by check_ranges for concrete values and
  # exposed by circle_jax.losses.hyper_ranges.
  ranges: Mapping[str, _common.HyperRange] = types.MappingProxyType({})

  def check_ranges(self):
    """Raises ValueError for a concrete hyperparameter outside ``ranges``."""
    _common.check_ranges({n: getattr(self, n) for n in self.ranges},
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


def both_sets_nonempty(stat_p, stat_n):
  """Validity of an anchor whose set statistics are logsumexps (``-inf`` empty).

  NaN is not ``-inf``, so a non-finite input is never taken for an empty set.
  """
  return (stat_p != _NEG_INF) & (stat_n != _NEG_INF)


def rule_dataclass(cls=None, *, meta=()):
  """A frozen dataclass rule whose hyperparameters are pytree leaves.

  Fields named in ``meta`` are static (e.g. ``mining``); the others are the
  hyperparameters, which may be Python numbers or traced scalars. The
  class's field defaults are the loss's defaults (the public functions read
  them from there) and ``__post_init__`` checks them when concrete.
  """
  def wrap(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(
        cls, data_fields=[n for n in names if n not in meta],
        meta_fields=list(meta))
  return wrap if cls is None else wrap(cls)


# ----------------------------------------------------------------------------
# Tile-level pieces (shared by every engine).
# ----------------------------------------------------------------------------


def _finite_or_zero(m: Array) -> Array:
  return jnp.where(jnp.isfinite(m), m, 0.0)


def _full(like: Array, value) -> Array:
  """A float32 array shaped like ``like`` filled with ``value``.

  ``full_like`` keeps ``like``'s device-varying type inside ``jax.shard_map``,
  so loop carries that start constant and are updated with per-device values
  type-check (a plain ``jnp.full`` would be device-invariant).
  """
  return jnp.full_like(like, value, dtype=_F32)


_PREPASS_OPS = {"min": (jnp.min, jnp.minimum, jnp.inf),
                "max": (jnp.max, jnp.maximum, _NEG_INF)}


def prepass_init(rule, like):
  return tuple(_full(like, _PREPASS_OPS[op][2]) for op, _ in rule.prepass)


def prepass_update(rule, pre, s, pos, neg, keepdims=False):
  """Folds a tile into the pre-pass statistics (no gradient)."""
  x = rule.prepare(jax.lax.stop_gradient(s))
  out = []
  for k, (op, which) in enumerate(rule.prepass):
    reduce, merge, empty = _PREPASS_OPS[op]
    mask = pos if which == "pos" else neg
    value = reduce(jnp.where(mask, x, empty), axis=-1, keepdims=keepdims)
    out.append(value if pre is None else merge(pre[k], value))
  return tuple(out)


def _expand(pre):
  return tuple(p[:, None] for p in pre)


def _set_terms(rule, s, pos, neg, pre):
  """``(x, pos, neg, logit_p, logit_n)`` of a tile after the rule's selection."""
  x = rule.prepare(s)
  pos, neg = rule.select(jax.lax.stop_gradient(x), pos, neg, pre)
  logit_p, logit_n = rule.logits(x)
  return x, pos, neg, logit_p, logit_n


def stats_init(like):
  """Empty online statistics ``(m, z, a)`` of both sets, ``[R]`` each."""
  one = (_full(like, _NEG_INF), _full(like, 0.0), _full(like, 0.0))
  return one + one


def _online(state, logits, values, mask):
  """Running ``(max, sum w, sum w v)`` with ``w = exp(logit - max)``.

  Masked-out entries are never exponentiated. ``values=None`` skips ``a``.
  """
  m, z, a = state
  block_max = jnp.max(jnp.where(mask, logits, _NEG_INF), axis=1)
  m_new = jnp.maximum(m, block_max)
  shift = _finite_or_zero(m_new)
  # <= 0 mathematically; clamped against a logit recomputed with other
  # rounding than the maximum's (ops.nonpositive).
  e = jnp.exp(jnp.where(mask, jnp.minimum(logits - shift[:, None], 0.0),
                        _NEG_INF))
  scale = jnp.exp(m - shift)
  z = z * scale + jnp.sum(e, axis=1)
  if values is not None:
    a = a * scale + jnp.sum(e * jnp.where(mask, values, 0.0), axis=1)
  return m_new, z, a


def stats_update(rule, stats, s, pos, neg, pre):
  """Folds a ``[R, C]`` tile into the online set statistics."""
  x, pos, neg, logit_p, logit_n = _set_terms(rule, s, pos, neg, pre)
  v_p = v_n = None
  if rule.statistic != "lse":
    v_p, v_n = rule.values(x)
  return (_online(stats[:3], logit_p, v_p, pos)
          + _online(stats[3:], logit_n, v_n, neg))


def _lse(m: Array, z: Array) -> Array:
  """``log z + m``; ``-inf`` when the set was empty (``z == 0``)."""
  nonempty = z > 0
  return jnp.where(nonempty,
                   jnp.log(jnp.where(nonempty, z, 1.0)) + _finite_or_zero(m),
                   _NEG_INF)


def stats_finish(rule, stats):
  """``(stat_p, stat_n)`` from the online statistics."""
  m_p, z_p, a_p, m_n, z_n, a_n = stats
  if rule.statistic == "lse":
    return _lse(m_p, z_p), _lse(m_n, z_n)
  if rule.statistic == "sum":  # z counts the pairs (all weights are 1)
    return (a_p, z_p), (a_n, z_n)

  def mean(z, a):
    return jnp.where(z > 0, a / jnp.where(z > 0, z, 1.0), 0.0)

  return mean(z_p, a_p), mean(z_n, a_n)


def _softmax_weights(logits, lse, mask):
  """``exp(logit - lse)`` on ``mask`` (0 elsewhere and for an empty set).

  A softmax weight is <= 1; the backward pass recomputes the logit, whose
  rounding may differ from the forward pass's by a few ulps (``ulp x
  scale``), so the exponent is clamped at 0 to keep the weight in [0, 1].
  """
  safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  return jnp.exp(jnp.where(mask, jnp.minimum(logits - safe_lse[:, None], 0.0),
                           _NEG_INF))


def tile_cotangent(rule, s, pos, neg, pre, stats, ct):
  """``dL/ds`` ``[R, C]`` of a tile, derived from the rule (module docstring).

  Args:
    rule: the pair rule.
    s: ``[R, C]`` similarities of the tile.
    pos, neg: ``[R, C]`` label (and miner) masks of the tile.
    pre: the rows' pre-pass statistics, each ``[R, 1]``.
    stats: the rows' finished online statistics (:func:`stats_update` over
      all columns).
    ct: ``[R]`` cotangent of the rows' per-anchor losses (a tuple like
      ``combine``'s when it returns several terms).
  """
  stat_p, stat_n = stats_finish(rule, stats)
  _, combine_vjp = jax.vjp(lambda a, b: rule.combine(a, b)[0], stat_p, stat_n)
  c_p, c_n = combine_vjp(ct)
  if rule.statistic == "sum":  # the counts carry no gradient
    c_p, c_n = c_p[0], c_n[0]
  _, pos, neg, logit_p, logit_n = _set_terms(rule, s, pos, neg, pre)

  def head(s):
    x = rule.prepare(s)
    return rule.logits(x) if rule.statistic == "lse" else rule.values(x)

  _, (df_p, df_n) = jax.jvp(head, (s,), (jnp.ones_like(s),))
  m_p, z_p, _, m_n, z_n, _ = stats
  if rule.statistic == "sum":  # a plain sum: every pair has weight 1
    w_p = w_n = 1.0
  else:
    w_p = _softmax_weights(logit_p, _lse(m_p, z_p), pos)
    w_n = _softmax_weights(logit_n, _lse(m_n, z_n), neg)
  return (jnp.where(pos, c_p[:, None] * w_p * df_p, 0.0)
          + jnp.where(neg, c_n[:, None] * w_n * df_n, 0.0))


# ----------------------------------------------------------------------------
# Dense engine.
# ----------------------------------------------------------------------------


def selected_pairs(rule, similarity: Array, pos: Array, neg: Array):
  """The pairs ``rule`` uses in a whole block (pre-pass and selection).

  Without gradient; e.g. Multi-Similarity's mining as a miner.

  Returns:
    ``(pos, neg)``, ``[M, N]`` bool.
  """
  s = jax.lax.stop_gradient(similarity)
  pre = prepass_update(rule, None, s, pos, neg, keepdims=True)
  return rule.select(rule.prepare(s), pos, neg, pre)


def dense_per_anchor(rule, similarity: Array, pos: Array,
                     neg: Array) -> Tuple[Array, Array]:
  """Runs ``rule`` on a whole ``[M, N]`` block, differentiated by autodiff.

  Both sets of a row share one ``exp`` pass
  (:func:`circle_jax.losses._common.two_set_exp`).

  Args:
    rule: the pair rule.
    similarity: ``[M, N]`` float32 block (for a rule on distances, whatever
      its ``prepare`` reads).
    pos, neg: ``[M, N]`` bool label (and miner) masks, disjoint.

  Returns:
    ``(per_anchor [M], valid [M])``.
  """
  x = rule.prepare(similarity)
  pre = prepass_update(rule, None, similarity, pos, neg, keepdims=True)
  pos, neg = rule.select(jax.lax.stop_gradient(x), pos, neg, pre)
  if rule.statistic == "sum":
    v_p, v_n = rule.values(x)

    def total(mask, v):
      count = jnp.sum(mask.astype(_F32), axis=-1)
      return jnp.sum(jnp.where(mask, v, 0.0), axis=-1), count

    return rule.combine(total(pos, v_p), total(neg, v_n))
  logit_p, logit_n = rule.logits(x)
  e, m_p, m_n = _common.two_set_exp(logit_p, logit_n, pos, neg,
                                    rule.shift(pre))
  if rule.statistic == "lse":
    s_p = jnp.sum(jnp.where(pos, e, 0.0), axis=-1, keepdims=True)
    s_n = jnp.sum(jnp.where(neg, e, 0.0), axis=-1, keepdims=True)
    stat_p = jnp.squeeze(_common.log_of_shifted_sum(s_p, m_p), -1)
    stat_n = jnp.squeeze(_common.log_of_shifted_sum(s_n, m_n), -1)
  else:
    e = jax.lax.stop_gradient(e)
    v_p, v_n = rule.values(x)

    def mean(mask, v):
      # An empty set has all weights 0 (total 0); a non-empty one has total
      # about >= 1 (its maximum gives exp(0), up to the rounding of a
      # recomputed logit, which at large temperatures is not exactly 0).
      total = jnp.sum(jnp.where(mask, e, 0.0), axis=-1)
      return (jnp.sum(jnp.where(mask, e * v, 0.0), axis=-1)
              / jnp.where(total == 0, 1.0, total))

    stat_p, stat_n = mean(pos, v_p), mean(neg, v_n)
  return rule.combine(stat_p, stat_n)


# ----------------------------------------------------------------------------
# Blockwise engine.
# ----------------------------------------------------------------------------


class PairSide(NamedTuple):
  """Rows (anchors) or columns (candidates) of a pair block.

  Attributes:
    z: ``[K, D]`` float32 L2-normalised embeddings.
    labels: ``[K]`` int32 labels.
    ids: ``[K]`` int32 sample ids; a row and a column with the same id are the
      same sample (a self pair: neither positive nor negative).
    valid: optional ``[K]`` bool; a column with False takes no part in any
      pair (an empty memory slot). ``None``: all valid.
  """

  z: Array
  labels: Array
  ids: Array
  valid: Optional[Array] = None


def pair_masks_of(row_labels, row_ids, col_labels, col_ids, ok=None):
  """``(pos, neg)`` of rows x columns: same / other label, not a self pair.

  ``ok`` (broadcastable to the block) marks the usable pairs (e.g. valid
  columns, or not padding).
  """
  same = row_labels[:, None] == col_labels[None, :]
  usable = row_ids[:, None] != col_ids[None, :]
  if ok is not None:
    usable = usable & ok
  return same & usable, ~same & usable


def side_masks(rows: PairSide, cols: PairSide, pos_mask, neg_mask):
  """The dense block's pair masks, intersected with the miner masks."""
  ok = None if cols.valid is None else cols.valid[None, :]
  pos, neg = pair_masks_of(rows.labels, rows.ids, cols.labels, cols.ids, ok)
  if pos_mask is not None:
    pos = pos & pos_mask
  if neg_mask is not None:
    neg = neg & neg_mask
  return pos, neg


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static description of the tiling (hashable: a custom_vjp nondiff arg)."""

  rows: int           # M: local anchors
  cols: int           # N: candidates
  row_block: int
  col_block: int

  @property
  def num_row_blocks(self):
    return -(-self.rows // self.row_block)

  @property
  def num_col_blocks(self):
    return -(-self.cols // self.col_block)


def _blocks(x, count, size, value=0):
  """Pads the leading axis of ``x`` to ``count * size`` and splits it."""
  pad = count * size - x.shape[0]
  if pad:
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1),
                constant_values=value)
  return x.reshape((count, size) + x.shape[1:])


def _mask_blocks(plan, mask):
  """``[M, N]`` miner mask -> ``[row blocks, R, col blocks, C]`` (padded False)."""
  if mask is None:
    return None
  mr = plan.num_row_blocks * plan.row_block
  nc = plan.num_col_blocks * plan.col_block
  mask = jnp.pad(mask, ((0, mr - mask.shape[0]), (0, nc - mask.shape[1])))
  return mask.reshape(plan.num_row_blocks, plan.row_block, plan.num_col_blocks,
                      plan.col_block)


def _prepare(plan, rows, cols, pos_mask, neg_mask):
  """Pads and reshapes everything into tiles (padding marked not ``ok``)."""
  def side(x, count, size):
    ok = jnp.arange(count * size) < x.z.shape[0]
    if x.valid is not None:
      ok = ok & _blocks(x.valid, count, size, False).reshape(-1)
    return dict(z=_blocks(x.z, count, size), labels=_blocks(x.labels, count, size),
                ids=_blocks(x.ids, count, size), ok=ok.reshape(count, size))

  r = side(rows, plan.num_row_blocks, plan.row_block)
  r.update(pos_mask=_mask_blocks(plan, pos_mask),
           neg_mask=_mask_blocks(plan, neg_mask))
  return r, side(cols, plan.num_col_blocks, plan.col_block)


def _tile(rows_b, cols, j):
  """Similarities and masks of row block ``rows_b`` x column block ``j``."""
  z_c = cols["z"][j]
  s = jnp.matmul(rows_b["z"], z_c.T, precision=jax.lax.Precision.HIGHEST)
  ok = rows_b["ok"][:, None] & cols["ok"][j][None, :]
  pos, neg = pair_masks_of(rows_b["labels"], rows_b["ids"], cols["labels"][j],
                           cols["ids"][j], ok)
  if rows_b["pos_mask"] is not None:
    pos = pos & rows_b["pos_mask"][:, j, :]
  if rows_b["neg_mask"] is not None:
    neg = neg & rows_b["neg_mask"][:, j, :]
  return s, pos, neg, z_c


def _forward(plan, rule, rows, cols):
  """``(pre, stats)`` of every row block, each a tuple of ``[blocks, R]``."""
  nb = plan.num_col_blocks

  def row_fn(rows_b):
    like = rows_b["z"][:, 0]
    pre = prepass_init(rule, like)
    if rule.prepass:
      def pre_step(j, pre):
        s, pos, neg, _ = _tile(rows_b, cols, j)
        return prepass_update(rule, pre, s, pos, neg)
      pre = jax.lax.fori_loop(0, nb, pre_step, pre)

    def step(j, stats):
      s, pos, neg, _ = _tile(rows_b, cols, j)
      return stats_update(rule, stats, s, pos, neg, _expand(pre))

    return pre, jax.lax.fori_loop(0, nb, step, stats_init(like))

  return jax.lax.map(row_fn, rows)


def _blockwise_impl(plan, rule, rows, cols, pos_mask, neg_mask):
  rows_t, cols_t = _prepare(plan, rows, cols, pos_mask, neg_mask)
  pre, stats = _forward(plan, rule, rows_t, cols_t)
  loss, valid = jax.vmap(
      lambda st: rule.combine(*stats_finish(rule, st)))(stats)
  out = jax.tree.map(lambda a: a.reshape(-1)[: plan.rows], (loss, valid))
  return out, (pre, stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise(plan, rule, rows, cols, pos_mask, neg_mask):
  return _blockwise_impl(plan, rule, rows, cols, pos_mask, neg_mask)[0]


def _blockwise_fwd(plan, rule, rows, cols, pos_mask, neg_mask):
  out, (pre, stats) = _blockwise_impl(plan, rule, rows, cols, pos_mask,
                                      neg_mask)
  return out, (rule, rows, cols, pos_mask, neg_mask, pre, stats)


def _blockwise_bwd(plan, res, cts):
  rule, rows, cols, pos_mask, neg_mask, pre, stats = res
  # The validity output carries no gradient.
  ct_loss = jax.tree.map(
      lambda c: _blocks(c.astype(_F32), plan.num_row_blocks, plan.row_block),
      cts[0])
  rows_t, cols_t = _prepare(plan, rows, cols, pos_mask, neg_mask)
  rows_t = dict(rows_t, pre=pre, stats=stats, ct=ct_loss)
  hi = jax.lax.Precision.HIGHEST

  def row_fn(dz_cols, rows_b):
    def step(j, carry):
      dz_row, dz_cols = carry
      s, pos, neg, z_c = _tile(rows_b, cols_t, j)
      g = tile_cotangent(rule, s, pos, neg, _expand(rows_b["pre"]),
                         rows_b["stats"], rows_b["ct"])
      dz_row = dz_row + jnp.matmul(g, z_c, precision=hi)
      dz_cols = dz_cols.at[j].add(jnp.matmul(g.T, rows_b["z"], precision=hi))
      return dz_row, dz_cols

    dz_row = jnp.zeros_like(rows_b["z"])
    dz_row, dz_cols = jax.lax.fori_loop(0, plan.num_col_blocks, step,
                                        (dz_row, dz_cols))
    return dz_cols, dz_row

  dz_cols, dz_rows = jax.lax.scan(row_fn, jnp.zeros_like(cols_t["z"]), rows_t)
  dz_rows = dz_rows.reshape(-1, rows.z.shape[1])[: plan.rows]
  dz_cols = dz_cols.reshape(-1, cols.z.shape[1])[: plan.cols]
  # Hyperparameters, labels, ids and masks get no gradient.
  d_rule = jax.tree.map(jnp.zeros_like, rule)
  return (d_rule, PairSide(dz_rows.astype(rows.z.dtype), None, None),
          PairSide(dz_cols.astype(cols.z.dtype), None, None), None, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def check_block_size(block_size) -> int:
  """A static positive Python (or NumPy) int, with an error naming the fix."""
  if isinstance(block_size, np.integer) and not isinstance(block_size,
                                                            np.bool_):
    block_size = int(block_size)
  if isinstance(block_size, bool) or not isinstance(block_size, int):
    raise TypeError(
        f"`block_size` must be a Python int (the number of anchors / candidates"
        f" per block, e.g. 1024); got {block_size!r} of type "
        f"{type(block_size).__name__}. It is static: pass it as a constant, "
        "not a traced array.")
  if block_size < 1:
    raise ValueError(f"`block_size` must be >= 1; got {block_size}.")
  return block_size


def blockwise_per_anchor(rule, rows: PairSide, cols: PairSide, *,
                         block_size: int, pos_mask: Optional[Array] = None,
                         neg_mask: Optional[Array] = None):
  """Runs ``rule`` over ``rows x cols`` in tiles, never forming ``[M, N]``.

  Rows and columns are processed in ``block_size`` blocks (padded with masked
  rows and columns), with ``lax.map`` over row blocks and ``lax.fori_loop``
  over column blocks. The per-anchor set statistics are accumulated online
  (max-shifted logsumexp or weighted sums, as in memory-efficient attention);
  a rule's pre-pass is a first loop without gradient. A ``custom_vjp``
  recomputes every tile in the backward pass from the ``O(M)`` saved
  statistics, forms its ``dL/ds`` with :func:`tile_cotangent` and accumulates
  ``dL/dz_rows += G z_cols`` and ``dL/dz_cols += G^T z_rows``. Peak memory is
  ``O(block_size^2 + (M + N) D)``. Hyperparameters get zero cotangents (they
  are constants, like the rules' other constants).

  Args:
    rule: the pair rule.
    rows: the anchors (:class:`PairSide`).
    cols: the candidates.
    block_size: rows / columns per tile (static int; need not divide them).
    pos_mask, neg_mask: optional ``[M, N]`` bool miner masks.

  Returns:
    ``(per_anchor [M], valid [M])``, equal to :func:`dense_per_anchor` on the
    block to float32 rounding.
  """
  block_size = check_block_size(block_size)
  m, n = rows.z.shape[0], cols.z.shape[0]
  plan = _Plan(rows=m, cols=n, row_block=min(block_size, m),
               col_block=min(block_size, n))
  rule = jax.tree.map(lambda v: jnp.asarray(v, _F32), rule)
  return _blockwise(plan, rule, rows, cols, pos_mask, neg_mask)


# ----------------------------------------------------------------------------
# Front ends: embeddings, matrices, reductions.
# ----------------------------------------------------------------------------


def reduce_per_anchor(rule, per_anchor: Array, valid: Array, axis_name=None):
  """The rule's reduction of the per-anchor losses, as a float32 scalar."""
  if hasattr(rule, "reduce"):
    loss = rule.reduce(per_anchor, valid, axis_name)
  elif rule.reduction == "valid_mean":
    loss = _common.mean_over_valid(per_anchor, valid, axis_name)
  else:
    loss = _common.sum_over_batch(per_anchor, axis_name)
  return _common.to_float32_scalar(loss)


COLLECTIVES = ("all_gather", "ring")


def check_collective(collective) -> str:
  """One of :data:`COLLECTIVES`, with an error naming them."""
  if collective not in COLLECTIVES:
    raise ValueError(f"`collective` must be one of {COLLECTIVES}; got "
                     f"{collective!r}.")
  return collective


def _reference_vector(x, length: int, name: str, kind: str):
  """Checks a ``[length]`` vector of ``kind`` (``"int"`` or ``"bool"``)."""
  x = jnp.asarray(x)
  if x.shape != (length,):
    raise ValueError(
        f"`{name}` must have shape ({length},), one entry per "
        f"{'anchor' if name == 'ids' else 'reference'}; got {x.shape}.")
  if kind == "bool" and x.dtype != jnp.bool_:
    raise ValueError(f"`{name}` must be a bool array; got dtype {x.dtype}. "
                     "Cast it with `.astype(bool)`.")
  if kind == "int" and not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"`{name}` must be an integer array; got dtype "
                     f"{x.dtype}. Cast it with `.astype(jnp.int32)`.")
  return x.astype(jnp.int32) if kind == "int" else x


def pair_sides(embeddings, labels, *, axis_name=None, ref_embeddings=None,
               ref_labels=None, ref_valid=None, ids=None, ref_ids=None,
               normalize: bool = True,
               gather_columns: bool = True) -> Tuple[PairSide, PairSide]:
  """The rows (local anchors) and columns (candidates) of a pair loss.

  Without references the columns are the batch gathered over ``axis_name``
  and the ids are the global row indices (so an anchor is not its own
  positive). With ``ref_embeddings`` the columns are the references gathered
  over ``axis_name`` (each device passes its shard), with ``ref_valid`` as
  the columns' ``valid`` and ``ids`` / ``ref_ids`` as the sample ids; if
  those are ``None`` no pair is a self pair (rows and columns get ids that
  never match), unless ``ref_embeddings is embeddings``, when both default
  to the global row indices.

  Args:
    embeddings: ``[B, D]`` float (the local anchors).
    labels: ``[B]`` int.
    axis_name: optional mapped axis.
    ref_embeddings: optional ``[M, D]`` float references (local shard).
    ref_labels: ``[M]`` int, required with ``ref_embeddings``.
    ref_valid: optional ``[M]`` bool.
    ids: optional ``[B]`` int sample ids of the anchors.
    ref_ids: optional ``[M]`` int sample ids of the references (both or
      neither of ``ids`` and ``ref_ids``).
    normalize: L2-normalise the embeddings (else float32 as they are).
    gather_columns: gather the columns over ``axis_name`` (False: each
      device keeps its shard, with global ids, for the ring engine).

  Returns:
    ``(rows, cols)``, :class:`PairSide` s; ``cols.valid`` is ``None`` when
    all columns are valid.

  Raises:
    ValueError: a reference argument without ``ref_embeddings``, missing
      ``ref_labels``, mismatched dimensions or lengths, non-integer labels or
      ids, a non-bool ``ref_valid``, or only one of ``ids`` / ``ref_ids``.
  """
  x = _common.check_embeddings(embeddings)
  labels = _common.check_labels(labels, x.shape[0])
  m = x.shape[0]
  prep = _common.l2_normalize if normalize else (lambda v: v)
  row_index = (jnp.arange(m, dtype=jnp.int32)
               + jnp.asarray(_common.local_row_offset(m, axis_name), jnp.int32))
  if gather_columns:
    gather = functools.partial(_common.gather_global, axis_name=axis_name)
  else:
    gather = lambda v: v
  if ref_embeddings is None:
    extra = [name for name, v in (("ref_labels", ref_labels),
                                  ("ref_valid", ref_valid), ("ids", ids),
                                  ("ref_ids", ref_ids)) if v is not None]
    if extra:
      raise ValueError(
          f"`{extra[0]}` was given without `ref_embeddings`; pass the "
          "reference embeddings [M, D] with it, or drop it.")
    if not gather_columns:
      z = prep(x)
      return PairSide(z, labels, row_index), PairSide(z, labels, row_index)
    x_all = gather(x)
    return (PairSide(prep(x), labels, row_index),
            PairSide(prep(x_all), gather(labels),
                     jnp.arange(x_all.shape[0], dtype=jnp.int32)))
  r = _common.check_embeddings(ref_embeddings, "ref_embeddings")
  if ref_labels is None:
    raise ValueError("`ref_embeddings` needs `ref_labels`, the [M] integer "
                     "labels of the references.")
  if r.shape[1] != x.shape[1]:
    raise ValueError(
        f"`ref_embeddings` has dimension {r.shape[1]} but the embeddings have "
        f"dimension {x.shape[1]}; they must match.")
  k = r.shape[0]
  ref_labels = _reference_vector(ref_labels, k, "ref_labels", "int")
  if ref_valid is not None:
    ref_valid = gather(_reference_vector(ref_valid, k, "ref_valid", "bool"))
  if (ids is None) != (ref_ids is None):
    raise ValueError("Pass both `ids` and `ref_ids` (the sample ids of the "
                     "anchors and of the references), or neither.")
  if ids is not None:
    ids = _reference_vector(ids, m, "ids", "int")
    ref_ids = _reference_vector(ref_ids, k, "ref_ids", "int")
  elif ref_embeddings is embeddings:  # the batch itself: self pairs by row
    ids = ref_ids = row_index
  else:  # ids that never match: every anchor-reference pair counts
    ids = jnp.full((m,), -1, jnp.int32)
    ref_ids = jnp.full((k,), -2, jnp.int32)
  return (PairSide(prep(x), labels, ids),
          PairSide(prep(gather(r)), gather(ref_labels), gather(ref_ids),
                   ref_valid))


def embedding_loss(rule, embeddings, labels, *, axis_name=None, pos_mask=None,
                   neg_mask=None, block_size=None, collective="all_gather",
                   **references) -> Array:
  """A pair loss of a batch of embeddings (the ``*_loss`` functions).

  The embeddings are checked, L2-normalised and the local anchors (rows) are
  compared with the candidates (columns) of :func:`pair_sides`: the batch,
  or the references when ``references`` (``ref_embeddings``, ``ref_labels``,
  ``ref_valid``, ``ids``, ``ref_ids``) are given. With ``axis_name`` the
  columns of every device are either gathered over the axis
  (``collective="all_gather"``) or visit each device on a ring (``"ring"``,
  :mod:`circle_jax.losses.ring`). The value is the loss of the anchors of
  the global batch on every device, its gradient exact. With ``block_size``
  the blockwise engine (or the ring in tiles) runs, else the dense one.
  """
  ring = check_collective(collective) == "ring" and axis_name is not None
  if block_size is not None:
    block_size = check_block_size(block_size)
  rows, cols = pair_sides(embeddings, labels, axis_name=axis_name,
                          gather_columns=not ring, **references)
  n = cols.z.shape[0] * (jax.lax.axis_size(axis_name) if ring else 1)
  shape = (rows.z.shape[0], n)
  pos_mask = _common.check_mask(pos_mask, shape, "pos_mask")
  neg_mask = _common.check_mask(neg_mask, shape, "neg_mask")
  if ring:
    # Imported here: the ring engine is built on this module.
    from circle_jax.losses import ring as ring_lib  # pylint: disable=g-import-not-at-top
    per_anchor, valid = ring_lib.ring_per_anchor(
        rule, rows, cols, axis_name=axis_name, block_size=block_size,
        pos_mask=pos_mask, neg_mask=neg_mask)
  elif block_size is None:
    similarity = jnp.matmul(rows.z, cols.z.T,
                            precision=jax.lax.Precision.HIGHEST)
    pos, neg = side_masks(rows, cols, pos_mask, neg_mask)
    per_anchor, valid = dense_per_anchor(rule, similarity, pos, neg)
  else:
    per_anchor, valid = blockwise_per_anchor(
        rule, rows, cols, block_size=block_size,
        pos_mask=pos_mask, neg_mask=neg_mask)
  return reduce_per_anchor(rule, per_anchor, valid, axis_name)


def matrix_loss(rule, matrix, labels, *, pos_mask=None, neg_mask=None,
                name: str = "similarity") -> Array:
  """A pair loss of a square ``[B, B]`` matrix (the ``*_from_*`` forms)."""
  matrix, labels = _common.check_similarity(matrix, labels, name=name)
  pos, neg = _common.pair_masks(labels, labels, 0, pos_mask, neg_mask)
  return reduce_per_anchor(rule, *dense_per_anchor(rule, matrix, pos, neg))


def class_level_loss(rule, embeddings, labels, class_weights) -> Array:
  """A rule with class-level labels: each sample against ``C`` class vectors.

  The positive set is the sample's own class, the negatives the others; the
  result is the mean over all samples (a label outside ``[0, C)`` has no
  positive and contributes 0).
  """
  embeddings = _common.check_embeddings(embeddings)
  labels = _common.check_labels(labels, embeddings.shape[0])
  class_weights = _common.check_class_vectors(
      class_weights, embeddings.shape[1], name="class_weights")
  similarity = _common.cosine_similarity(embeddings, class_weights)
  classes = jnp.arange(class_weights.shape[0], dtype=labels.dtype)
  pos = labels[:, None] == classes[None, :]
  per_sample, _ = dense_per_anchor(rule, similarity, pos, ~pos)
  return _common.to_float32_scalar(jnp.mean(per_sample))

