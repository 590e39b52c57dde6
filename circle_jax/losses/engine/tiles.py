"""Tile-level pieces every engine is built from.

An engine sees rows (anchors) and columns (candidates) as :class:`PairSide`
s, cuts them into the tiles of a :class:`Plan` (:func:`prepare_tiles`), forms
a tile's similarities and pair masks (:func:`tile`), folds it into the rows'
pre-pass (:func:`prepass_update`) and online set statistics
(:func:`stats_update`), finishes them (:func:`stats_finish`) for the rule's
``combine``, and in a backward pass takes the tile's ``dL/ds`` from
:func:`tile_cotangent`. :func:`pair_masks` is the one definition of a
positive and a negative pair, and :func:`same_labels` the one comparison of
two samples' labels (integer class ids, or multi-hot label sets).

The backward pass derives ``dL/ds`` from the rule instead of asking for a
hand-written gradient: for a pair ``j`` of set ``P`` of anchor ``i``,

  dL/ds_ij = d combine/d stat_P (i) * softmax_P(logit)_ij * d f_ij / d s_ij,

with ``f = logits`` for ``"lse"`` and ``f = values`` for ``"mean"`` (for
``"sum"`` the softmax factor is 1 on the set); the first factor is a
``jax.vjp`` of ``combine`` and the last an elementwise ``jax.jvp`` of
``prepare`` and ``f`` (which honours the rule's ``stop_gradient``
constants), so dense (autodiff) and tiled engines share one definition of
the gradient.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from circle_jax.losses.engine.rule import NEG_INF, set_statistics

Array = jax.Array

F32 = jnp.float32


class PairSide(NamedTuple):
  """Rows (anchors) or columns (candidates) of a pair block.

  Attributes:
    z: ``[K, D]`` float32 embeddings after the geometry's ``embed``.
    labels: ``[K]`` int32 class ids, or ``[K, L]`` bool multi-hot label
      sets (compared by :func:`same_labels`).
    ids: ``[K]`` int32 sample ids; a row and a column with the same id are the
      same sample (a self pair: neither positive nor negative).
    valid: optional ``[K]`` bool; a column with False takes no part in any
      pair (an empty memory slot). ``None``: all valid.
    aux: optional ``[K]`` float32, a per-sample value the pairs of a
      two-stage rule read (its first stage's per-anchor output,
      :mod:`circle_jax.losses.engine.rule`); the engines differentiate
      through it. ``None`` (every one-stage rule): nothing is read or done.
  """

  z: Array
  labels: Array
  ids: Array
  valid: Optional[Array] = None
  aux: Optional[Array] = None


def prepare(rule, s, aux=None):
  """The rule's ``x`` of a tile; ``aux``: ``None`` or ``(t_row [R, 1], t_col
  [1, C] or None)`` of a two-stage rule."""
  return rule.prepare(s) if aux is None else rule.prepare(s, *aux)


def same_labels(row_labels, col_labels):
  """``[R, C]`` bool: whether a row's and a column's labels match.

  The one label comparison of every pair loss, engine and miner. Integer
  class ids ``[R]`` / ``[C]`` match when equal. Multi-hot label sets
  ``[R, L]`` / ``[C, L]`` (Musgrave et al., pytorch-metric-learning, GitHub
  issue 658, "multi-label support") match when
  they intersect, i.e. share a class: a one-hot row is its class id. A row
  with no label (all zero) matches nothing, so it is a negative of every
  other sample, another empty row included: "positive iff the sets
  intersect, negative iff they are disjoint" keeps the positives and
  negatives a partition of the usable pairs, as with class ids (an empty
  set is disjoint from every set). To leave such samples out instead, mask
  their pairs (``neg_mask``) or drop them.

  The intersection is a matmul of the 0/1 sets, exact on every backend
  (bfloat16 holds 0 and 1 exactly; the counts accumulate in float32).
  """
  if row_labels.ndim == 1:
    return row_labels[:, None] == col_labels[None, :]
  shared = jnp.matmul(row_labels.astype(jnp.bfloat16),
                      col_labels.astype(jnp.bfloat16).T,
                      preferred_element_type=F32)
  return shared > 0.5


def pair_masks(row_labels, row_ids, col_labels, col_ids, ok=None,
               pos_mask=None, neg_mask=None):
  """``(pos, neg)`` of rows x columns: same / other label, not a self pair.

  The one definition of the pairs of every loss (labels compared by
  :func:`same_labels`).

  Args:
    row_labels, row_ids: ``[R]`` labels (or ``[R, L]`` multi-hot) and
      sample ids of the anchors.
    col_labels, col_ids: ``[C]`` of the candidates (a column with the id of
      a row is that row's sample: neither positive nor negative).
    ok: optional mask broadcastable to ``[R, C]`` of the usable pairs (valid
      columns, not padding).
    pos_mask, neg_mask: optional ``[R, C]`` miner masks intersected with the
      label masks (a miner only removes pairs).
  """
  same = same_labels(row_labels, col_labels)
  usable = row_ids[:, None] != col_ids[None, :]
  if ok is not None:
    usable = usable & ok
  pos, neg = same & usable, ~same & usable
  if pos_mask is not None:
    pos = pos & pos_mask
  if neg_mask is not None:
    neg = neg & neg_mask
  return pos, neg


def side_pair_masks(rows: PairSide, cols: PairSide, pos_mask=None,
                    neg_mask=None):
  """:func:`pair_masks` of two whole sides (the dense block)."""
  ok = None if cols.valid is None else cols.valid[None, :]
  return pair_masks(rows.labels, rows.ids, cols.labels, cols.ids, ok,
                    pos_mask, neg_mask)


def finite_or_zero(m: Array) -> Array:
  return jnp.where(jnp.isfinite(m), m, 0.0)


def full(like: Array, value) -> Array:
  """A float32 array shaped like ``like`` filled with ``value``.

  ``full_like`` keeps ``like``'s device-varying type inside ``jax.shard_map``,
  so loop carries that start constant and are updated with per-device values
  type-check (a plain ``jnp.full`` would be device-invariant).
  """
  return jnp.full_like(like, value, dtype=F32)


# ----------------------------------------------------------------------------
# Tiling.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
  """Static description of the tiling (hashable: a custom_vjp nondiff arg)."""

  rows: int           # M: local anchors
  cols: int           # N: candidates
  row_block: int
  col_block: int

  @classmethod
  def of(cls, rows: int, cols: int, block_size: Optional[int]):
    """Blocks of ``block_size`` (``None``: one tile of the whole block)."""
    if block_size is None:
      return cls(rows, cols, rows, cols)
    return cls(rows, cols, min(block_size, rows), min(block_size, cols))

  @property
  def num_row_blocks(self):
    return -(-self.rows // self.row_block)

  @property
  def num_col_blocks(self):
    return -(-self.cols // self.col_block)


def blocks(x, count, size, value=0):
  """Pads the leading axis of ``x`` to ``count * size`` and splits it."""
  pad = count * size - x.shape[0]
  if pad:
    x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1),
                constant_values=value)
  return x.reshape((count, size) + x.shape[1:])


def mask_blocks(plan, mask):
  """``[M, N]`` miner mask -> ``[row blocks, R, col blocks, C]`` (padded False)."""
  if mask is None:
    return None
  mr = plan.num_row_blocks * plan.row_block
  nc = plan.num_col_blocks * plan.col_block
  mask = jnp.pad(mask, ((0, mr - mask.shape[0]), (0, nc - mask.shape[1])))
  return mask.reshape(plan.num_row_blocks, plan.row_block, plan.num_col_blocks,
                      plan.col_block)


def prepare_tiles(plan, rows, cols, pos_mask=None, neg_mask=None):
  """Pads and reshapes everything into tiles (padding marked not ``ok``).

  Returns:
    ``(rows_t, cols_t)``: dicts of ``[blocks, size, ...]`` arrays (``z``,
    ``labels``, ``ids``, ``ok``, ``aux`` or ``None``; the rows also the tiled
    miner masks).
  """
  def side(x, count, size):
    ok = jnp.arange(count * size) < x.z.shape[0]
    if x.valid is not None:
      ok = ok & blocks(x.valid, count, size, False).reshape(-1)
    return dict(z=blocks(x.z, count, size),
                labels=blocks(x.labels, count, size),
                ids=blocks(x.ids, count, size), ok=ok.reshape(count, size),
                aux=None if x.aux is None else blocks(x.aux, count, size))

  r = side(rows, plan.num_row_blocks, plan.row_block)
  r.update(pos_mask=mask_blocks(plan, pos_mask),
           neg_mask=mask_blocks(plan, neg_mask))
  return r, side(cols, plan.num_col_blocks, plan.col_block)


def tile(geometry, rows_b, cols, j):
  """Similarities and masks of row block ``rows_b`` x column block ``j``.

  Returns:
    ``(s, pos, neg, z_cols, aux)``; ``aux`` as :func:`prepare` reads it.
  """
  z_c = cols["z"][j]
  s = geometry.tile(rows_b["z"], z_c)
  ok = rows_b["ok"][:, None] & cols["ok"][j][None, :]
  pos_mask, neg_mask = (None if rows_b[k] is None else rows_b[k][:, j, :]
                        for k in ("pos_mask", "neg_mask"))
  pos, neg = pair_masks(rows_b["labels"], rows_b["ids"], cols["labels"][j],
                        cols["ids"][j], ok, pos_mask, neg_mask)
  return s, pos, neg, z_c, pair_aux(
      rows_b["aux"], None if cols["aux"] is None else cols["aux"][j])


def pair_aux(row_aux, col_aux):
  """The ``aux`` :func:`prepare` reads from the sides' ``[R]`` / ``[C]``
  values (``None`` without a row value: a one-stage rule)."""
  if row_aux is None:
    return None
  return row_aux[:, None], None if col_aux is None else col_aux[None, :]


def unblock(x, plan_rows):
  """``[blocks, size, ...]`` -> the first ``plan_rows`` of ``[blocks*size, ...]``."""
  return x.reshape((-1,) + x.shape[2:])[:plan_rows]


# ----------------------------------------------------------------------------
# Statistics.
# ----------------------------------------------------------------------------


_PREPASS_OPS = {"min": (jnp.min, jnp.minimum, jnp.inf),
                "max": (jnp.max, jnp.maximum, NEG_INF)}


def prepass_init(rule, like):
  return tuple(full(like, _PREPASS_OPS[op][2]) for op, _ in rule.prepass)


def prepass_update(rule, pre, s, pos, neg, keepdims=False, aux=None):
  """Folds a tile into the pre-pass statistics (no gradient)."""
  x = prepare(rule, jax.lax.stop_gradient(s), jax.lax.stop_gradient(aux))
  out = []
  for k, (op, which) in enumerate(rule.prepass):
    reduce, merge, empty = _PREPASS_OPS[op]
    mask = pos if which == "pos" else neg
    value = reduce(jnp.where(mask, x, empty), axis=-1, keepdims=keepdims)
    out.append(value if pre is None else merge(pre[k], value))
  return tuple(out)


def expand(pre):
  """Pre-pass statistics ``[R]`` -> the ``[R, 1]`` a rule reads."""
  return tuple(p[:, None] for p in pre)


def set_terms(rule, s, pos, neg, pre, aux=None):
  """``(x, pos, neg, logit_p, logit_n)`` of a tile after the rule's selection."""
  x = prepare(rule, s, aux)
  pos, neg = rule.select(jax.lax.stop_gradient(x), pos, neg, pre)
  logit_p, logit_n = rule.logits(x)
  return x, pos, neg, logit_p, logit_n


def stats_init(like):
  """Empty online statistics ``(m, z, a)`` of both sets, ``[R]`` each."""
  one = (full(like, NEG_INF), full(like, 0.0), full(like, 0.0))
  return one + one


def _online(state, logits, values, mask):
  """Running ``(max, sum w, sum w v)`` with ``w = exp(logit - max)``.

  Masked-out entries are never exponentiated. ``values=None`` skips ``a``.
  """
  m, z, a = state
  block_max = jnp.max(jnp.where(mask, logits, NEG_INF), axis=1)
  m_new = jnp.maximum(m, block_max)
  shift = finite_or_zero(m_new)
  # <= 0 mathematically; clamped against a logit recomputed with other
  # rounding than the maximum's (ops.nonpositive).
  e = jnp.exp(jnp.where(mask, jnp.minimum(logits - shift[:, None], 0.0),
                        NEG_INF))
  scale = jnp.exp(m - shift)
  z = z * scale + jnp.sum(e, axis=1)
  if values is not None:
    a = a * scale + jnp.sum(e * jnp.where(mask, values, 0.0), axis=1)
  return m_new, z, a


def stats_update(rule, stats, s, pos, neg, pre, aux=None):
  """Folds a ``[R, C]`` tile into the online set statistics."""
  x, pos, neg, logit_p, logit_n = set_terms(rule, s, pos, neg, pre, aux)
  kind_p, kind_n = set_statistics(rule)
  v_p = v_n = None
  if (kind_p, kind_n) != ("lse", "lse"):
    v_p, v_n = rule.values(x)
  return (_online(stats[:3], logit_p, None if kind_p == "lse" else v_p, pos)
          + _online(stats[3:], logit_n, None if kind_n == "lse" else v_n,
                    neg))


def lse(m: Array, z: Array) -> Array:
  """``log z + m``; ``-inf`` when the set was empty (``z == 0``)."""
  nonempty = z > 0
  return jnp.where(nonempty,
                   jnp.log(jnp.where(nonempty, z, 1.0)) + finite_or_zero(m),
                   NEG_INF)


def stats_finish(rule, stats):
  """``(stat_p, stat_n)`` from the online statistics."""
  m_p, z_p, a_p, m_n, z_n, a_n = stats

  def finish(kind, m, z, a):
    if kind == "lse":
      return lse(m, z)
    if kind == "sum":  # z counts the pairs (all weights are 1)
      return a, z
    return jnp.where(z > 0, a / jnp.where(z > 0, z, 1.0), 0.0)

  kind_p, kind_n = set_statistics(rule)
  return finish(kind_p, m_p, z_p, a_p), finish(kind_n, m_n, z_n, a_n)


def finish_rows(rule, plan, stats):
  """The rows' ``(per_anchor [M], valid [M])`` from their tiled statistics."""
  loss, valid = jax.vmap(
      lambda st: rule.combine(*stats_finish(rule, st)))(stats)
  return jax.tree.map(lambda a: a.reshape(-1)[: plan.rows], (loss, valid))


def _softmax_weights(logits, set_lse, mask):
  """``exp(logit - lse)`` on ``mask`` (0 elsewhere and for an empty set).

  A softmax weight is <= 1; the backward pass recomputes the logit, whose
  rounding may differ from the forward pass's by a few ulps (``ulp x
  scale``), so the exponent is clamped at 0 to keep the weight in [0, 1].
  """
  safe_lse = jnp.where(jnp.isfinite(set_lse), set_lse, 0.0)
  return jnp.exp(jnp.where(mask, jnp.minimum(logits - safe_lse[:, None], 0.0),
                           NEG_INF))


def tile_cotangent(rule, s, pos, neg, pre, stats, ct, aux=None):
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
    aux: ``None``, or a two-stage rule's ``(t_row, t_col)`` (:func:`prepare`).

  Returns:
    ``dL/ds``; with ``aux``, ``(dL/ds, dL/dt_row [R], dL/dt_col [C] or
    None)``: the same derivation, with the tangent on ``t`` instead of ``s``.
  """
  stat_p, stat_n = stats_finish(rule, stats)
  _, combine_vjp = jax.vjp(lambda a, b: rule.combine(a, b)[0], stat_p, stat_n)
  c_p, c_n = combine_vjp(ct)
  kind_p, kind_n = set_statistics(rule)
  # The counts of a "sum" set carry no gradient.
  c_p = c_p[0] if kind_p == "sum" else c_p
  c_n = c_n[0] if kind_n == "sum" else c_n
  _, pos, neg, logit_p, logit_n = set_terms(rule, s, pos, neg, pre, aux)
  primals = (s,) if aux is None else (s,) + tuple(
      t for t in aux if t is not None)

  def head(s, *t):
    x = prepare(rule, s, None if aux is None else (t + (None,))[:2])
    logits = rule.logits(x)
    if (kind_p, kind_n) == ("lse", "lse"):
      return logits
    values = rule.values(x)
    return (logits[0] if kind_p == "lse" else values[0],
            logits[1] if kind_n == "lse" else values[1])

  m_p, z_p, _, m_n, z_n, _ = stats
  # A plain sum weighs every pair by 1.
  w_p = (1.0 if kind_p == "sum"
         else _softmax_weights(logit_p, lse(m_p, z_p), pos))
  w_n = (1.0 if kind_n == "sum"
         else _softmax_weights(logit_n, lse(m_n, z_n), neg))

  def derivative(k):
    """``dL/d primals[k]`` per pair of the tile (elementwise)."""
    tangents = tuple(jnp.ones_like(p) if i == k else jnp.zeros_like(p)
                     for i, p in enumerate(primals))
    _, (df_p, df_n) = jax.jvp(head, primals, tangents)
    return (jnp.where(pos, c_p[:, None] * w_p * df_p, 0.0)
            + jnp.where(neg, c_n[:, None] * w_n * df_n, 0.0))

  if aux is None:
    return derivative(0)
  return (derivative(0), jnp.sum(derivative(1), axis=1),
          jnp.sum(derivative(2), axis=0) if len(primals) > 2 else None)
