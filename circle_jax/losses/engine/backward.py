"""The backward sweep shared by the tiled engines' ``custom_vjp`` s.

Given the rows' saved pre-pass and online statistics and the cotangent of
their per-anchor losses, a sweep recomputes every tile of the rows against a
set of column blocks, forms its ``dL/ds`` with
:func:`circle_jax.losses.engine.tiles.tile_cotangent` and pulls it back
through the geometry: ``dL/dz_rows`` and ``dL/dz_cols`` accumulate tile by
tile. The blockwise engine sweeps once over all columns; the ring engine
sweeps once per column shard as the shards (and their ``dL/dz`` accumulator)
travel around the devices. A two-stage rule's sides also carry ``aux``
(:class:`tiles.PairSide`); its ``dL/daux`` accumulates alongside ``dL/dz``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from circle_jax.losses.engine import tiles


def saved_rows(plan, rows, cols, res_pre, res_stats, ct_loss, pos_mask=None,
               neg_mask=None):
  """The tiled rows and columns with the saved statistics and cotangent.

  Args:
    plan: the :class:`tiles.Plan`.
    rows, cols: the :class:`tiles.PairSide` s of the forward pass.
    res_pre, res_stats: the rows' saved pre-pass and online statistics.
    ct_loss: the cotangent of ``per_anchor`` (``[M]`` or a tuple of them).
    pos_mask, neg_mask: optional ``[M, N]`` miner masks.

  Returns:
    ``(rows_t, cols_t)`` as :func:`tiles.prepare_tiles`, ``rows_t`` with
    ``pre``, ``stats`` and ``ct``.
  """
  ct = jax.tree.map(
      lambda c: tiles.blocks(c.astype(tiles.F32), plan.num_row_blocks,
                             plan.row_block), ct_loss)
  rows_t, cols_t = tiles.prepare_tiles(plan, rows, cols, pos_mask, neg_mask)
  return dict(rows_t, pre=res_pre, stats=res_stats, ct=ct), cols_t


def zeros(side_t):
  """The empty running cotangent of tiled sides: ``dict(z=, aux=)`` (``aux``
  ``None`` where the side has none)."""
  aux = side_t["aux"]
  return dict(z=jnp.zeros_like(side_t["z"]),
              aux=None if aux is None else jnp.zeros_like(aux))


def sweep(plan, rule, rows_t, cols_t, dz_rows, dz_cols):
  """Adds every tile's pull-back of ``dL/ds`` to the embeddings' cotangents.

  Args:
    plan: the :class:`tiles.Plan`.
    rule: the pair rule (its geometry pulls the tiles back).
    rows_t: the tiled rows of :func:`saved_rows` (with their miner masks
      for the columns of ``cols_t``).
    cols_t: the tiled columns.
    dz_rows: the rows' running cotangent (:func:`zeros`): ``dL/dz``
      ``[row blocks, R, D]`` and ``dL/daux`` ``[row blocks, R]`` or ``None``.
    dz_cols: the columns' (``[col blocks, C, ...]``).

  Returns:
    ``(dz_rows, dz_cols)`` with this sweep's contributions added.
  """
  geometry = rule.geometry

  def row_fn(dz_cols, args):
    rows_b, dz_row = args

    def step(j, carry):
      dz_row, dz_cols = carry
      s, pos, neg, z_c, aux = tiles.tile(geometry, rows_b, cols_t, j)
      g = tiles.tile_cotangent(rule, s, pos, neg, tiles.expand(rows_b["pre"]),
                               rows_b["stats"], rows_b["ct"], aux)
      da_row = da_col = None
      if aux is not None:
        g, da_row, da_col = g
      d_row, d_col = geometry.tile_vjp(rows_b["z"], z_c, g)
      return (jax.tree.map(jnp.add, dz_row, dict(z=d_row, aux=da_row)),
              jax.tree.map(lambda acc, d: acc.at[j].add(d), dz_cols,
                           dict(z=d_col, aux=da_col)))

    dz_row, dz_cols = jax.lax.fori_loop(0, plan.num_col_blocks, step,
                                        (dz_row, dz_cols))
    return dz_cols, dz_row

  dz_cols, dz_rows = jax.lax.scan(row_fn, dz_cols, (rows_t, dz_rows))
  return dz_rows, dz_cols


def side_cotangent(side, dz_tiled, count):
  """A :class:`tiles.PairSide` cotangent: for the embeddings (and ``aux``)."""
  dz, daux = (None if d is None else tiles.unblock(d, count)
              for d in (dz_tiled["z"], dz_tiled["aux"]))
  return tiles.PairSide(dz.astype(side.z.dtype), None, None, None,
                        None if daux is None else daux.astype(side.aux.dtype))
