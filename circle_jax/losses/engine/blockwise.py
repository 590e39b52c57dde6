"""The blockwise engine: a rule over ``rows x cols`` in tiles.

Rows and columns are processed in ``block_size`` blocks (padded with masked
rows and columns), with ``lax.map`` over row blocks and ``lax.fori_loop``
over column blocks, so the ``[M, N]`` block is never formed. The per-anchor
set statistics are accumulated online (max-shifted logsumexp or weighted
sums, as in memory-efficient attention); a rule's pre-pass is a first loop
without gradient. A ``custom_vjp`` recomputes every tile in the backward
pass from the ``O(M)`` saved statistics
(:func:`circle_jax.losses.engine.backward.sweep`). Peak memory is
``O(block_size^2 + (M + N) D)``.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from circle_jax.losses.engine import backward
from circle_jax.losses.engine import tiles

Array = jax.Array


def _forward(plan, rule, rows, cols):
  """``(pre, stats)`` of every row block, each a tuple of ``[blocks, R]``."""
  nb = plan.num_col_blocks

  def row_fn(rows_b):
    like = rows_b["z"][:, 0]
    pre = tiles.prepass_init(rule, like)
    if rule.prepass:
      def pre_step(j, pre):
        s, pos, neg, _, aux = tiles.tile(rule.geometry, rows_b, cols, j)
        return tiles.prepass_update(rule, pre, s, pos, neg, aux=aux)
      pre = jax.lax.fori_loop(0, nb, pre_step, pre)

    def step(j, stats):
      s, pos, neg, _, aux = tiles.tile(rule.geometry, rows_b, cols, j)
      return tiles.stats_update(rule, stats, s, pos, neg, tiles.expand(pre),
                                aux)

    return pre, jax.lax.fori_loop(0, nb, step, tiles.stats_init(like))

  return jax.lax.map(row_fn, rows)


def _blockwise_impl(plan, rule, rows, cols, pos_mask, neg_mask):
  rows_t, cols_t = tiles.prepare_tiles(plan, rows, cols, pos_mask, neg_mask)
  pre, stats = _forward(plan, rule, rows_t, cols_t)
  return tiles.finish_rows(rule, plan, stats), (pre, stats)


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
  rows_t, cols_t = backward.saved_rows(plan, rows, cols, pre, stats, cts[0],
                                       pos_mask, neg_mask)
  dz_rows, dz_cols = backward.sweep(plan, rule, rows_t, cols_t,
                                    backward.zeros(rows_t),
                                    backward.zeros(cols_t))
  # Hyperparameters, labels, ids and masks get no gradient.
  d_rule = jax.tree.map(jnp.zeros_like, rule)
  return (d_rule, backward.side_cotangent(rows, dz_rows, plan.rows),
          backward.side_cotangent(cols, dz_cols, plan.cols), None, None)


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


def blockwise_per_anchor(rule, rows: tiles.PairSide, cols: tiles.PairSide, *,
                         block_size: int, pos_mask: Optional[Array] = None,
                         neg_mask: Optional[Array] = None):
  """Runs ``rule`` over ``rows x cols`` in tiles, never forming ``[M, N]``.

  Hyperparameters get zero cotangents (they are constants, like the rules'
  other constants).

  Args:
    rule: the pair rule.
    rows: the anchors (:class:`tiles.PairSide`).
    cols: the candidates.
    block_size: rows / columns per tile (static int; need not divide them).
    pos_mask, neg_mask: optional ``[M, N]`` bool miner masks.

  Returns:
    ``(per_anchor [M], valid [M])``, equal to the dense engine's on the
    block to float32 rounding.
  """
  block_size = check_block_size(block_size)
  plan = tiles.Plan.of(rows.z.shape[0], cols.z.shape[0], block_size)
  rule = jax.tree.map(lambda v: jnp.asarray(v, tiles.F32), rule)
  return _blockwise(plan, rule, rows, cols, pos_mask, neg_mask)
