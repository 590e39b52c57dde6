"""The device-ring engine: pair losses over a device axis without gathering.

With ``axis_name`` the other engines all-gather the global batch's
embeddings ``[B_global, D]`` on every device, so each device's memory grows
with the device count. Here each device keeps its local anchors (rows) and
its local column shard, and the shards travel around the ring of devices
with ``jax.lax.ppermute``: at each of the ``n`` steps (``n`` = axis size) a
device folds the tiles of its rows against the shard it holds into the
rows' online set statistics (:func:`circle_jax.losses.engine.tiles.stats_update`), then passes the
shard on. A rule with a pre-pass (Multi-Similarity's mining statistics)
takes one ring pass for it first.

The backward pass is a ``custom_vjp`` that runs the ring again from the
rows' saved ``O(B_local)`` statistics: at each step the shared backward
sweep (:func:`circle_jax.losses.engine.backward.sweep`) recomputes each tile
against the shard it holds, accumulates ``dL/dz_rows`` locally and ``dL/dz_cols`` into an accumulator that travels *with* the
column shard, so that after the full cycle each shard's gradient is back at
its owner (one last ``ppermute`` of the accumulator alone).

Per device, memory is ``O(B_local D + tile)`` with a tile of ``block_size^2``
(``block_size`` given) or ``B_local^2`` (the "dense" ring: one tile per
step), independent of the device count. Only ``axis_name`` collectives are
used (``ppermute``, ``axis_index``), so it runs under ``jax.shard_map`` and
``jax.pmap``. The schedule is that of ring exchange for contrastive losses
(Cheng et al., 2024; the neighbour exchange of open_clip's SigLIP loss),
here for any label-masked rule (:mod:`circle_jax.losses.engine.rule`).

References:
  Cheng et al., "Breaking the Memory Barrier: Near Infinite Batch Size
  Scaling for Contrastive Loss", arXiv:2410.17243, 2024.
  Zhai et al., "Sigmoid Loss for Language Image Pre-Training", ICCV 2023.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses.engine import backward
from circle_jax.losses.engine import tiles

Array = jax.Array


def _shift(x, axis_name, n):
  """Sends ``x`` to the next device of the ring (device ``i`` -> ``i + 1``)."""
  return jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])


def _ring_pass(axis_name, visit, state, shard):
  """Visits the ``n`` column shards in turn, passing ``shard`` on between.

  ``visit(state, shard, k) -> (state, shard)`` sees at step ``k`` the shard
  of device ``axis_index - k``. Returns the final ``(state, shard)``; the
  shard is then one step short of home (``n - 1`` moves).
  """
  n = jax.lax.axis_size(axis_name)

  def body(k, carry):
    state, shard = visit(*carry, k)
    return state, _shift(shard, axis_name, n)

  # A loop carry keeps its type, and a shard that went through ppermute
  # varies over the axis: parts computed from constants (the padding mask)
  # are cast to vary as the embeddings do.
  shard = jax.tree.map(lambda x: ops.vary_as(x, shard["z"]), shard)
  state, shard = jax.lax.fori_loop(0, n - 1, body, (state, shard))
  return visit(state, shard, n - 1)


def _with_masks(plan, axis_name, rows_t, pos_mask, neg_mask, k):
  """The rows' tiles with the miner masks' columns of the shard at step ``k``."""
  if pos_mask is None and neg_mask is None:
    return rows_t
  n = jax.lax.axis_size(axis_name)
  owner = (jax.lax.axis_index(axis_name) - k) % n

  def columns(mask):
    if mask is None:
      return None
    part = jax.lax.dynamic_slice_in_dim(mask, owner * plan.cols, plan.cols,
                                        axis=1)
    return tiles.mask_blocks(plan, part)

  return dict(rows_t, pos_mask=columns(pos_mask), neg_mask=columns(neg_mask))


def _fold(plan, geometry, rows_t, shard, state, tile_fn):
  """Folds every tile of the rows against ``shard`` into per-row-block state.

  ``tile_fn(rows_b, state_b, s, pos, neg, aux) -> state_b``.
  """
  def row_fn(args):
    rows_b, state_b = args

    def step(j, state_b):
      s, pos, neg, _, aux = tiles.tile(geometry, rows_b, shard, j)
      return tile_fn(rows_b, state_b, s, pos, neg, aux)

    return jax.lax.fori_loop(0, plan.num_col_blocks, step, state_b)

  return jax.lax.map(row_fn, (rows_t, state))


def _ring_impl(plan, axis_name, rule, rows, cols, pos_mask, neg_mask):
  rows_t, cols_t = tiles.prepare_tiles(plan, rows, cols)
  like = rows_t["z"][:, :, 0]
  pre = tiles.prepass_init(rule, like)
  fold = functools.partial(_fold, plan, rule.geometry)
  if rule.prepass:
    def pre_visit(pre, shard, k):
      rows_k = _with_masks(plan, axis_name, rows_t, pos_mask, neg_mask, k)
      return fold(rows_k, shard, pre, lambda rows_b, pre_b, s, pos, neg, aux:
                  tiles.prepass_update(rule, pre_b, s, pos, neg,
                                       aux=aux)), shard
    pre, _ = _ring_pass(axis_name, pre_visit, pre, cols_t)

  def visit(stats, shard, k):
    rows_k = dict(_with_masks(plan, axis_name, rows_t, pos_mask, neg_mask, k),
                  pre=pre)
    return fold(rows_k, shard, stats, lambda rows_b, st, s, pos, neg, aux:
                tiles.stats_update(rule, st, s, pos, neg,
                                   tiles.expand(rows_b["pre"]), aux)), shard

  stats, _ = _ring_pass(axis_name, visit, tiles.stats_init(like), cols_t)
  return tiles.finish_rows(rule, plan, stats), (pre, stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(plan, axis_name, rule, rows, cols, pos_mask, neg_mask):
  return _ring_impl(plan, axis_name, rule, rows, cols, pos_mask, neg_mask)[0]


def _ring_fwd(plan, axis_name, rule, rows, cols, pos_mask, neg_mask):
  out, (pre, stats) = _ring_impl(plan, axis_name, rule, rows, cols, pos_mask,
                                 neg_mask)
  return out, (rule, rows, cols, pos_mask, neg_mask, pre, stats)


def _ring_bwd(plan, axis_name, res, cts):
  rule, rows, cols, pos_mask, neg_mask, pre, stats = res
  # The validity output carries no gradient.
  rows_t, cols_t = backward.saved_rows(plan, rows, cols, pre, stats, cts[0])

  def visit(dz_rows, shard, k):
    rows_k = _with_masks(plan, axis_name, rows_t, pos_mask, neg_mask, k)
    dz_rows, dz_cols = backward.sweep(plan, rule, rows_k, shard, dz_rows,
                                      shard["dz"])
    return dz_rows, dict(shard, dz=dz_cols)

  shard = dict(cols_t, dz=backward.zeros(cols_t))
  dz_rows, shard = _ring_pass(axis_name, visit, backward.zeros(rows_t),
                              shard)
  # The accumulator's last move brings every shard's gradient home.
  dz_cols = _shift(shard["dz"], axis_name, jax.lax.axis_size(axis_name))
  # Hyperparameters, labels, ids and masks get no gradient.
  d_rule = jax.tree.map(jnp.zeros_like, rule)
  return (d_rule, backward.side_cotangent(rows, dz_rows, plan.rows),
          backward.side_cotangent(cols, dz_cols, plan.cols), None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_per_anchor(rule, rows: tiles.PairSide, local_cols: tiles.PairSide,
                    *, axis_name, block_size: Optional[int] = None,
                    pos_mask: Optional[Array] = None,
                    neg_mask: Optional[Array] = None):
  """Runs ``rule`` over the local rows x every device's columns, on a ring.

  Call it inside ``jax.shard_map`` or ``jax.pmap`` over ``axis_name``. The
  candidates are the concatenation over the devices (in axis order) of each
  device's ``local_cols``; they never are gathered: each shard visits every
  device once (module docstring). ``local_cols`` may be the rows themselves
  (the global batch) or any other columns, e.g. reference embeddings, with
  ids that place the anchors among them (a row and a column with the same
  id are the same sample and never a pair) and a ``valid`` mask (invalid
  columns take no part in any pair).

  Args:
    rule: the pair rule.
    rows: this device's anchors (:class:`tiles.PairSide`), ``[M, D]``.
    local_cols: this device's column shard, ``[N, D]`` (the same ``N`` on
      every device).
    axis_name: the mapped axis of the ring.
    block_size: ``None`` for one ``[M, N]`` tile per ring step (the "dense"
      ring), or rows / columns per tile (a checked static int; need not
      divide them).
    pos_mask, neg_mask: optional ``[M, n N]`` bool miner masks over the
      global columns.

  Returns:
    ``(per_anchor [M], valid [M])``, equal to the other engines' on the
    gathered columns to float32 rounding; gradients flow to ``rows.z`` and
    ``local_cols.z`` (each shard's gradient from every device's anchors).
  """
  plan = tiles.Plan.of(rows.z.shape[0], local_cols.z.shape[0], block_size)
  rule = jax.tree.map(lambda v: jnp.asarray(v, tiles.F32), rule)
  return _ring(plan, axis_name, rule, rows, local_cols, pos_mask, neg_mask)
