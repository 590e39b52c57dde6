"""Blockwise (memory-efficient) Circle, Multi-Similarity and Ranked List losses.

The dense losses build the ``[B, B]`` similarity matrix, which needs ``4 B^2``
bytes for the matrix alone (17 GB at ``B = 65,536``) and several times that for
the elementwise intermediates and their gradients. The functions here compute
*exactly the same* loss and gradient (to float32 rounding) without ever
materialising it:

* anchor rows and candidate columns are processed in ``block_size`` blocks
  (``B`` is padded up to a multiple of ``block_size`` with masked rows and
  columns), with ``lax.map`` over row blocks and ``lax.fori_loop`` over column
  blocks;
* per-anchor statistics are accumulated online: max-shifted ``logsumexp``
  (Circle, Multi-Similarity) and max-shifted weighted sums (Ranked List), as in
  memory-efficient attention;
* Multi-Similarity's mining statistics (smallest positive and largest negative
  similarity of each anchor) come from a first pass without gradient;
* a ``jax.custom_vjp`` recomputes every similarity block in the backward pass
  from the per-anchor statistics saved by the forward pass (``O(B)`` floats),
  forms ``dL/dS`` for that block in closed form and accumulates
  ``dL/dZ_rows += G Z_cols`` and ``dL/dZ_cols += G^T Z_rows``.

Peak memory is ``O(block_size^2 + B D)``; the work is one (Circle, Ranked
List) or two (Multi-Similarity) similarity matmuls forward and three backward
(recompute, ``G Z_cols``, ``G^T Z_rows``), against one and two for the dense
losses. On CPU the tiles stay in cache and the blockwise losses measured
faster than the dense ones from ``B = 4096`` (``docs/performance.md``).

With ``axis_name`` (inside ``jax.shard_map`` or ``jax.pmap``) each device keeps
only its own anchor rows; the columns are the embeddings gathered over devices
(``[B_global, D]``, never ``[B_global, B_global]``). The gradient with respect
to the gathered columns flows back through the ``all_gather`` (a
reduce-scatter), so every device gets the exact gradient of the global-batch
loss for its local embeddings, as for the dense losses.

Hyperparameters may be Python numbers or (traced) scalars; like the dense
losses' conventions for constants (Circle's ``alpha_p``/``alpha_n``, the
mining decisions), no gradient flows into them: the ``custom_vjp`` returns zero
cotangents for hyperparameters.

Reduction conventions are those of the dense losses: Circle averages over the
anchors with at least one positive and one negative; Multi-Similarity sums over
anchors and divides by the (global) batch size; Ranked List averages over all
anchors of the (global) batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from circle_jax.losses import _common

Array = jax.Array

_F32 = jnp.float32
_NEG_INF = -jnp.inf


# ----------------------------------------------------------------------------
# Small numerical helpers on blocks.
# ----------------------------------------------------------------------------


def _finite_or_zero(m: Array) -> Array:
  return jnp.where(jnp.isfinite(m), m, 0.0)


def _online_lse(state, logits, mask):
  """Folds a ``[R, C]`` block of masked logits into a running ``(max, sum)``.

  ``state = (m, z)`` with ``m`` the running max (``-inf`` while empty) and
  ``z = sum(exp(logit - m))``. Masked-out entries are never exponentiated.
  """
  m, z = state
  block_max = jnp.max(jnp.where(mask, logits, _NEG_INF), axis=1)
  m_new = jnp.maximum(m, block_max)
  shift = _finite_or_zero(m_new)
  e = jnp.exp(jnp.where(mask, logits - shift[:, None], _NEG_INF))
  z = z * jnp.exp(m - shift) + jnp.sum(e, axis=1)
  return m_new, z


def _online_weighted(state, logits, values, mask):
  """Running ``(max, sum w, sum w v)`` with ``w = exp(logit - max)``."""
  m, z, a = state
  block_max = jnp.max(jnp.where(mask, logits, _NEG_INF), axis=1)
  m_new = jnp.maximum(m, block_max)
  shift = _finite_or_zero(m_new)
  e = jnp.exp(jnp.where(mask, logits - shift[:, None], _NEG_INF))
  scale = jnp.exp(m - shift)
  z = z * scale + jnp.sum(e, axis=1)
  a = a * scale + jnp.sum(e * jnp.where(mask, values, 0.0), axis=1)
  return m_new, z, a


def _lse(m: Array, z: Array) -> Array:
  """``log z + m``; ``-inf`` when the set was empty (``z == 0``)."""
  nonempty = z > 0
  return jnp.where(nonempty, jnp.log(jnp.where(nonempty, z, 1.0)) + _finite_or_zero(m),
                   _NEG_INF)


def _softmax_weights(logits, lse, mask):
  """``exp(logit - lse)`` on ``mask`` (0 elsewhere, and 0 when the set is empty)."""
  safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  return jnp.exp(jnp.where(mask, logits - safe_lse[:, None], _NEG_INF))


def _full(like: Array, value) -> Array:
  """A float32 vector shaped like ``like`` filled with ``value``.

  ``full_like`` keeps ``like``'s device-varying type inside ``jax.shard_map``,
  so loop carries that start constant and are updated with per-device values
  type-check (a plain ``jnp.full`` would be device-invariant).
  """
  return jnp.full_like(like, value, dtype=_F32)


# ----------------------------------------------------------------------------
# Per-loss block rules. Each rule says, for one [R, C] block of similarities
# with its positive / negative masks:
#   pre_init / pre_update   (optional) a first no-gradient pass (MS mining),
#   init / update / finish  the online per-anchor statistics and the loss,
#   grad                    dL_i/dS_ij of the block given the saved statistics.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Circle:
  """Circle loss (Sun et al. 2020, eq. 6 with O_p=1+m, O_n=-m, D_p=1-m, D_n=m)."""

  has_prepass = False

  @staticmethod
  def _logits(s, h):
    alpha_n = jax.nn.relu(s + h["margin"])
    alpha_p = jax.nn.relu(1.0 + h["margin"] - s)
    logit_n = h["gamma"] * alpha_n * (s - h["margin"])
    logit_p = -h["gamma"] * alpha_p * (s - (1.0 - h["margin"]))
    return logit_p, logit_n, alpha_p, alpha_n

  def init(self, like):
    e = _full(like, _NEG_INF), _full(like, 0.0)
    return e + e  # (m_pos, z_pos, m_neg, z_neg)

  def update(self, stats, s, pos, neg, pre, h):
    logit_p, logit_n, _, _ = self._logits(s, h)
    return (_online_lse(stats[:2], logit_p, pos)
            + _online_lse(stats[2:], logit_n, neg))

  def finish(self, stats, h):
    m_p, z_p, m_n, z_n = stats
    valid = (z_p > 0) & (z_n > 0)
    total = _lse(m_n, z_n) + _lse(m_p, z_p)
    loss = jnp.where(valid, jax.nn.softplus(jnp.where(valid, total, 0.0)), 0.0)
    return loss, valid

  def grad(self, s, pos, neg, pre, stats, h):
    m_p, z_p, m_n, z_n = stats
    logit_p, logit_n, alpha_p, alpha_n = self._logits(s, h)
    lse_p, lse_n = _lse(m_p, z_p), _lse(m_n, z_n)
    valid = (z_p > 0) & (z_n > 0)
    sig = jnp.where(valid, jax.nn.sigmoid(jnp.where(valid, lse_p + lse_n, 0.0)), 0.0)
    # alpha_p, alpha_n are constants in backprop (the paper's gradient).
    g_pos = -h["gamma"] * alpha_p * _softmax_weights(logit_p, lse_p, pos)
    g_neg = h["gamma"] * alpha_n * _softmax_weights(logit_n, lse_n, neg)
    return sig[:, None] * (g_pos + g_neg)


@dataclasses.dataclass(frozen=True)
class _MultiSimilarity:
  """Multi-Similarity loss (Wang et al. 2019) with its hard-pair mining."""

  mining: bool = True
  has_prepass = True

  def pre_init(self, like):
    return _full(like, jnp.inf), _full(like, _NEG_INF)

  def pre_update(self, pre, s, pos, neg):
    min_pos, max_neg = pre
    min_pos = jnp.minimum(min_pos, jnp.min(jnp.where(pos, s, jnp.inf), axis=1))
    max_neg = jnp.maximum(max_neg, jnp.max(jnp.where(neg, s, _NEG_INF), axis=1))
    return min_pos, max_neg

  def _mined(self, s, pos, neg, pre, h):
    if not self.mining:
      return pos, neg
    min_pos, max_neg = pre
    pos = pos & (s - h["epsilon"] < max_neg[:, None])
    neg = neg & (s + h["epsilon"] > min_pos[:, None])
    return pos, neg

  def init(self, like):
    e = _full(like, _NEG_INF), _full(like, 0.0)
    return e + e

  def update(self, stats, s, pos, neg, pre, h):
    pos, neg = self._mined(s, pos, neg, pre, h)
    logit_p = -h["alpha"] * (s - h["base"])
    logit_n = h["beta"] * (s - h["base"])
    return (_online_lse(stats[:2], logit_p, pos)
            + _online_lse(stats[2:], logit_n, neg))

  @staticmethod
  def _keep(stats):
    # An anchor whose (mined) positive or negative set is empty contributes 0
    # (with or without mining, as the dense loss).
    _, z_p, _, z_n = stats
    return (z_p > 0) & (z_n > 0)

  def finish(self, stats, h):
    m_p, z_p, m_n, z_n = stats
    term = (jax.nn.softplus(_lse(m_p, z_p)) / h["alpha"]
            + jax.nn.softplus(_lse(m_n, z_n)) / h["beta"])
    keep = self._keep(stats)
    return jnp.where(keep, term, 0.0), keep

  def grad(self, s, pos, neg, pre, stats, h):
    m_p, z_p, m_n, z_n = stats
    pos, neg = self._mined(s, pos, neg, pre, h)
    lse_p, lse_n = _lse(m_p, z_p), _lse(m_n, z_n)
    keep = self._keep(stats)
    # d/dS (1/a) log(1 + sum exp(-a(S - base))) = -sigmoid(lse) softmax(logit)
    sig_p = jnp.where(keep, jax.nn.sigmoid(lse_p), 0.0)
    sig_n = jnp.where(keep, jax.nn.sigmoid(lse_n), 0.0)
    g_pos = -sig_p[:, None] * _softmax_weights(-h["alpha"] * (s - h["base"]), lse_p, pos)
    g_neg = sig_n[:, None] * _softmax_weights(h["beta"] * (s - h["base"]), lse_n, neg)
    return g_pos + g_neg


@dataclasses.dataclass(frozen=True)
class _RankedList:
  """Ranked List loss (Wang et al. 2019) on Euclidean distances of unit vectors.

  The normalised exp-weights are constants in backprop (the paper's gradient
  and the official code, as the dense loss).
  """

  has_prepass = False

  @staticmethod
  def _terms(s, pos, neg, h):
    d = _common.euclidean_from_cosine(s)
    v_pos = d - (h["alpha"] - h["margin"])
    v_neg = h["alpha"] - d
    pos = pos & (v_pos > 0)  # non-trivial positives: d > alpha - margin
    neg = neg & (v_neg > 0)  # non-trivial negatives: d < alpha
    return d, v_pos, v_neg, pos, neg

  def init(self, like):
    e = _full(like, _NEG_INF), _full(like, 0.0), _full(like, 0.0)
    return e + e  # (m, z, a) for positives then negatives

  def update(self, stats, s, pos, neg, pre, h):
    _, v_pos, v_neg, pos, neg = self._terms(s, pos, neg, h)
    return (_online_weighted(stats[:3], h["t_pos"] * v_pos, v_pos, pos)
            + _online_weighted(stats[3:], h["t_neg"] * v_neg, v_neg, neg))

  @staticmethod
  def _means(stats):
    _, z_p, a_p, _, z_n, a_n = stats
    l_p = jnp.where(z_p > 0, a_p / jnp.where(z_p > 0, z_p, 1.0), 0.0)
    l_n = jnp.where(z_n > 0, a_n / jnp.where(z_n > 0, z_n, 1.0), 0.0)
    return l_p, l_n

  def finish(self, stats, h):
    l_p, l_n = self._means(stats)
    loss = (1.0 - h["imbalance"]) * l_p + h["imbalance"] * l_n
    return loss, jnp.ones(loss.shape, bool)

  def grad(self, s, pos, neg, pre, stats, h):
    m_p, z_p, _, m_n, z_n, _ = stats
    d, v_pos, v_neg, pos, neg = self._terms(s, pos, neg, h)
    w_p = _softmax_weights(h["t_pos"] * v_pos, _lse(m_p, z_p), pos)
    w_n = _softmax_weights(h["t_neg"] * v_neg, _lse(m_n, z_n), neg)
    # dv_pos/dd = +1, dv_neg/dd = -1.
    g_d = ((1.0 - h["imbalance"]) * w_p - h["imbalance"] * w_n)
    # d = sqrt(2 - 2 s): dd/ds = -1/d (0 where d is numerically 0, as safe_sqrt).
    inv_d = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    return -g_d * inv_d


# ----------------------------------------------------------------------------
# The blockwise engine with its custom VJP.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static description of the blocking (hashable: a custom_vjp nondiff arg)."""

  rule: Any
  rows: int           # M: local anchors
  cols: int           # N: candidates (global batch)
  row_block: int
  col_block: int

  @property
  def num_row_blocks(self):
    return -(-self.rows // self.row_block)

  @property
  def num_col_blocks(self):
    return -(-self.cols // self.col_block)


def _pad_to(x, size, value=0):
  pad = size - x.shape[0]
  if pad == 0:
    return x
  widths = [(0, pad)] + [(0, 0)] * (x.ndim - 1)
  return jnp.pad(x, widths, constant_values=value)


def _row_blocks(plan, x, value=0):
  x = _pad_to(x, plan.num_row_blocks * plan.row_block, value)
  return x.reshape((plan.num_row_blocks, plan.row_block) + x.shape[1:])


def _col_blocks(plan, x, value=0):
  x = _pad_to(x, plan.num_col_blocks * plan.col_block, value)
  return x.reshape((plan.num_col_blocks, plan.col_block) + x.shape[1:])


def _mask_blocks(plan, mask):
  """``[M, N]`` miner mask -> ``[row blocks, R, col blocks, C]`` (padded False)."""
  if mask is None:
    return None
  mr = plan.num_row_blocks * plan.row_block
  nc = plan.num_col_blocks * plan.col_block
  mask = jnp.pad(mask, ((0, mr - mask.shape[0]), (0, nc - mask.shape[1])))
  return mask.reshape(plan.num_row_blocks, plan.row_block, plan.num_col_blocks,
                      plan.col_block)


def _prepare(plan, z_rows, z_cols, row_labels, col_labels, row_offset,
             pos_mask, neg_mask):
  """Pads and reshapes everything into blocks."""
  r, c = plan.row_block, plan.col_block
  row_ids = jnp.arange(plan.num_row_blocks * r, dtype=jnp.int32)
  row_ids = jnp.where(row_ids < plan.rows, row_ids + row_offset, -1)
  col_ids = jnp.arange(plan.num_col_blocks * c, dtype=jnp.int32)
  col_ids = jnp.where(col_ids < plan.cols, col_ids, -2)
  rows = dict(
      z=_row_blocks(plan, z_rows),
      labels=_row_blocks(plan, row_labels),
      ids=row_ids.reshape(plan.num_row_blocks, r),
      pos_mask=_mask_blocks(plan, pos_mask),
      neg_mask=_mask_blocks(plan, neg_mask),
  )
  cols = dict(
      z=_col_blocks(plan, z_cols),
      labels=_col_blocks(plan, col_labels),
      ids=col_ids.reshape(plan.num_col_blocks, c),
  )
  return rows, cols


def _block(rows_b, cols, j):
  """Similarities and label masks of row block ``rows_b`` x column block ``j``."""
  z_c = cols["z"][j]
  s = jnp.matmul(rows_b["z"], z_c.T, precision=jax.lax.Precision.HIGHEST)
  row_ok = rows_b["ids"] >= 0
  col_ids = cols["ids"][j]
  ok = row_ok[:, None] & (col_ids >= 0)[None, :]
  same = rows_b["labels"][:, None] == cols["labels"][j][None, :]
  pos = same & (rows_b["ids"][:, None] != col_ids[None, :]) & ok
  neg = ~same & ok
  if rows_b["pos_mask"] is not None:
    pos = pos & rows_b["pos_mask"][:, j, :]
  if rows_b["neg_mask"] is not None:
    neg = neg & rows_b["neg_mask"][:, j, :]
  return s, pos, neg, z_c


def _forward(plan, hyper, rows, cols):
  """Returns (prepass stats, stats), each a tuple of ``[row blocks, R]`` arrays."""
  rule = plan.rule
  nb = plan.num_col_blocks

  def row_fn(rows_b):
    like = rows_b["z"][:, 0]
    if rule.has_prepass:
      def pre_step(j, pre):
        s, pos, neg, _ = _block(rows_b, cols, j)
        return rule.pre_update(pre, s, pos, neg)
      pre = jax.lax.fori_loop(0, nb, pre_step, rule.pre_init(like))
    else:
      pre = ()

    def step(j, stats):
      s, pos, neg, _ = _block(rows_b, cols, j)
      return rule.update(stats, s, pos, neg, pre, hyper)

    stats = jax.lax.fori_loop(0, nb, step, rule.init(like))
    return pre, stats

  return jax.lax.map(row_fn, rows)


def _per_anchor_impl(plan, hyper, z_rows, z_cols, row_labels, col_labels,
                     row_offset, pos_mask, neg_mask):
  rows, cols = _prepare(plan, z_rows, z_cols, row_labels, col_labels,
                        row_offset, pos_mask, neg_mask)
  pre, stats = _forward(plan, hyper, rows, cols)
  loss, valid = jax.vmap(lambda st: plan.rule.finish(st, hyper))(stats)
  loss = loss.reshape(-1)[: plan.rows]
  valid = valid.reshape(-1)[: plan.rows]
  return (loss, valid), (pre, stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _per_anchor(plan, hyper, z_rows, z_cols, row_labels, col_labels, row_offset,
                pos_mask, neg_mask):
  """Per-anchor losses ``[M]`` and anchor validity ``[M]`` (blockwise)."""
  out, _ = _per_anchor_impl(plan, hyper, z_rows, z_cols, row_labels, col_labels,
                            row_offset, pos_mask, neg_mask)
  return out


def _per_anchor_fwd(plan, hyper, z_rows, z_cols, row_labels, col_labels,
                    row_offset, pos_mask, neg_mask):
  out, (pre, stats) = _per_anchor_impl(plan, hyper, z_rows, z_cols, row_labels,
                                       col_labels, row_offset, pos_mask,
                                       neg_mask)
  res = (hyper, z_rows, z_cols, row_labels, col_labels, row_offset, pos_mask,
         neg_mask, pre, stats)
  return out, res


def _per_anchor_bwd(plan, res, cts):
  (hyper, z_rows, z_cols, row_labels, col_labels, row_offset, pos_mask,
   neg_mask, pre, stats) = res
  ct_loss = cts[0].astype(_F32)  # the validity output carries no gradient
  rule = plan.rule
  rows, cols = _prepare(plan, z_rows, z_cols, row_labels, col_labels,
                        row_offset, pos_mask, neg_mask)
  rows = dict(rows, pre=pre, stats=stats,
              ct=_row_blocks(plan, ct_loss))
  nb = plan.num_col_blocks

  def row_fn(dz_cols, rows_b):
    def step(j, carry):
      dz_row, dz_cols = carry
      s, pos, neg, z_c = _block(rows_b, cols, j)
      g = rule.grad(s, pos, neg, rows_b["pre"], rows_b["stats"], hyper)
      g = g * rows_b["ct"][:, None]
      hi = jax.lax.Precision.HIGHEST
      dz_row = dz_row + jnp.matmul(g, z_c, precision=hi)
      dz_cols = dz_cols.at[j].add(jnp.matmul(g.T, rows_b["z"], precision=hi))
      return dz_row, dz_cols

    dz_row = jnp.zeros_like(rows_b["z"])
    dz_row, dz_cols = jax.lax.fori_loop(0, nb, step, (dz_row, dz_cols))
    return dz_cols, dz_row

  dz_cols, dz_rows = jax.lax.scan(row_fn, jnp.zeros_like(cols["z"]), rows)
  dz_rows = dz_rows.reshape(-1, z_rows.shape[1])[: plan.rows]
  dz_cols = dz_cols.reshape(-1, z_cols.shape[1])[: plan.cols]
  d_hyper = jax.tree.map(jnp.zeros_like, hyper)
  return (d_hyper, dz_rows.astype(z_rows.dtype), dz_cols.astype(z_cols.dtype),
          None, None, None, None, None)


_per_anchor.defvjp(_per_anchor_fwd, _per_anchor_bwd)


# ----------------------------------------------------------------------------
# Public functions.
# ----------------------------------------------------------------------------


def _check_block_size(block_size) -> int:
  if isinstance(block_size, bool) or not isinstance(block_size, int):
    try:
      import numpy as np  # numpy integers are fine
      if isinstance(block_size, np.integer):
        block_size = int(block_size)
    except ImportError:  # pragma: no cover
      pass
  if isinstance(block_size, bool) or not isinstance(block_size, int):
    raise TypeError(
        f"`block_size` must be a Python int (the number of anchors / candidates"
        f" per block, e.g. 1024); got {block_size!r} of type "
        f"{type(block_size).__name__}. It is static: pass it as a constant, "
        "not a traced array.")
  if block_size < 1:
    raise ValueError(f"`block_size` must be >= 1; got {block_size}.")
  return block_size


def _run(rule, embeddings, labels, hyper, block_size, axis_name, pos_mask,
         neg_mask):
  """Normalises, gathers over ``axis_name`` and runs the blockwise core.

  Returns ``(per_anchor [M], valid [M])`` for the local anchors.
  """
  block_size = _check_block_size(block_size)
  x = _common.check_embeddings(embeddings)
  labels = _common.check_labels(labels, x.shape[0])
  z = _common.l2_normalize(x)
  z_all, labels_all, row_offset = _common.gathered_batch(z, labels, axis_name)
  m, n = z.shape[0], z_all.shape[0]
  shape = (m, n)
  pos_mask = _common.check_mask(pos_mask, shape, "pos_mask")
  neg_mask = _common.check_mask(neg_mask, shape, "neg_mask")
  plan = _Plan(rule=rule, rows=m, cols=n, row_block=min(block_size, m),
               col_block=min(block_size, n))
  hyper = {k: jnp.asarray(v, _F32) for k, v in hyper.items()}
  row_offset = jnp.asarray(row_offset, jnp.int32)
  return _per_anchor(plan, hyper, z, z_all, labels, labels_all, row_offset,
                     pos_mask, neg_mask)


def circle_loss_blockwise(
    embeddings: Array,
    labels: Array,
    *,
    margin: float = 0.4,
    gamma: float = 80.0,
    block_size: int,
    axis_name: Optional[Any] = None,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Array:
  """Pair-wise Circle loss computed in blocks, never forming the ``[B, B]`` matrix.

  Same value and gradient as :func:`circle_jax.losses.circle_loss` (to float32
  rounding). With ``s = cos(x_i, x_j)``, ``alpha_p = [1 + m - s_p]_+`` and
  ``alpha_n = [s_n + m]_+`` (constants in backprop), per anchor ``i``::

    L_i = softplus( logsumexp_{n in N_i} gamma alpha_n (s_n - m)
                  + logsumexp_{p in P_i} -gamma alpha_p (s_p - (1 - m)) )

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (local batch with
      ``axis_name``); L2-normalised inside.
    labels: ``[B]`` integer class ids.
    margin: relaxation ``m``.
    gamma: scale ``gamma``.
    block_size: anchors / candidates per block (static Python int). Need not
      divide ``B``; the batch is padded with masked rows and columns.
    axis_name: device axis of ``shard_map`` / ``pmap``: the loss of the global
      batch, each device keeping only its own anchor rows.
    pos_mask, neg_mask: optional boolean ``[B_local, B_global]`` miner masks,
      intersected with the label masks. (They are ``O(B^2)`` booleans
      themselves; the point of this function is to run without them.)

  Returns:
    Float32 scalar: mean of ``L_i`` over anchors with at least one positive and
    one negative (0 if there are none, with zero gradient).

  References:
    Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity
    Optimization", CVPR 2020.
  """
  _common.check_positive(gamma, "gamma")
  per, valid = _run(_Circle(), embeddings, labels,
                    {"margin": margin, "gamma": gamma}, block_size, axis_name,
                    pos_mask, neg_mask)
  return _common.to_float32_scalar(
      _common.mean_over_valid(per, valid, axis_name))


def multi_similarity_loss_blockwise(
    embeddings: Array,
    labels: Array,
    *,
    alpha: float = 2.0,
    beta: float = 50.0,
    base: float = 0.5,
    epsilon: float = 0.1,
    mining: bool = True,
    block_size: int,
    axis_name: Optional[Any] = None,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Array:
  """Multi-Similarity loss computed in blocks (same value and gradient as dense).

  Per anchor ``i`` with mined positives ``P_i`` and negatives ``N_i``::

    L_i = 1/alpha log(1 + sum_{P_i} exp(-alpha (S - base)))
        + 1/beta  log(1 + sum_{N_i} exp( beta (S - base)))

  Mining (``mining=True``): keep a negative if ``S + epsilon > min_{P} S`` and a
  positive if ``S - epsilon < max_{N} S``; the two statistics come from a first
  blockwise pass and the decisions carry no gradient. An anchor whose (mined)
  positive or negative set is empty contributes 0, with or without mining.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16; L2-normalised inside.
    labels: ``[B]`` integer class ids.
    alpha, beta, base: the loss' scales and similarity offset.
    epsilon: mining margin.
    mining: whether to apply the paper's hard-pair mining (static bool).
    block_size: anchors / candidates per block (static Python int).
    axis_name: device axis for the global batch (see ``circle_loss_blockwise``).
    pos_mask, neg_mask: optional ``[B_local, B_global]`` miner masks.

  Returns:
    Float32 scalar: ``sum_i L_i / B`` (global ``B`` with ``axis_name``).

  References:
    Wang et al., "Multi-Similarity Loss with General Pair Weighting for Deep
    Metric Learning", CVPR 2019.
  """
  _common.check_positive(alpha, "alpha")
  _common.check_positive(beta, "beta")
  if isinstance(epsilon, (int, float)) and epsilon < 0:
    raise ValueError(f"`epsilon` must be >= 0; got {epsilon}.")
  per, _ = _run(_MultiSimilarity(mining=bool(mining)), embeddings, labels,
                {"alpha": alpha, "beta": beta, "base": base,
                 "epsilon": epsilon}, block_size, axis_name, pos_mask, neg_mask)
  return _common.to_float32_scalar(_common.sum_over_batch(per, axis_name))


def ranked_list_loss_blockwise(
    embeddings: Array,
    labels: Array,
    *,
    alpha: float = 1.2,
    margin: float = 0.4,
    t_neg: float = 10.0,
    t_pos: float = 0.0,
    imbalance: float = 0.5,
    block_size: int,
    axis_name: Optional[Any] = None,
    pos_mask: Optional[Array] = None,
    neg_mask: Optional[Array] = None,
) -> Array:
  """Ranked List loss computed in blocks (same value and gradient as dense).

  On Euclidean distances ``d = ||x_i^ - x_j^||`` of unit vectors, per anchor::

    L_P = sum_{p: d > alpha - margin} w_p (d - (alpha - margin)) / sum w_p,
          w_p = exp(t_pos (d - (alpha - margin)))
    L_N = sum_{n: d < alpha} w_n (alpha - d) / sum w_n,
          w_n = exp(t_neg (alpha - d))
    L_i = (1 - imbalance) L_P + imbalance L_N       (empty sets give 0)

  The normalised weights are accumulated online with a running max shift, so
  large ``t_neg`` cannot overflow, and are constants in backprop (the paper's
  gradient, as the dense loss): ``dL/dd`` is ``(1 - imbalance) w_p / sum w_p``
  on non-trivial positives and ``-imbalance w_n / sum w_n`` on non-trivial
  negatives (divided by ``B``).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16; L2-normalised inside.
    labels: ``[B]`` integer class ids.
    alpha: negative boundary ``alpha``; positives are pulled within
      ``alpha - margin``.
    margin: the gap between positive and negative boundaries.
    t_neg, t_pos: temperatures of the negative / positive weighting.
    imbalance: weight ``lambda`` of the negative term.
    block_size: anchors / candidates per block (static Python int).
    axis_name: device axis for the global batch (see ``circle_loss_blockwise``).
    pos_mask, neg_mask: optional ``[B_local, B_global]`` miner masks.

  Returns:
    Float32 scalar: mean of ``L_i`` over all anchors of the (global) batch.

  References:
    Wang et al., "Ranked List Loss for Deep Metric Learning", CVPR 2019.
  """
  _common.check_positive(alpha, "alpha")
  if isinstance(margin, (int, float)) and not margin >= 0:
    raise ValueError(f"`margin` must be >= 0; got {margin}.")
  if isinstance(imbalance, (int, float)) and not 0.0 <= imbalance <= 1.0:
    raise ValueError(f"`imbalance` must be in [0, 1]; got {imbalance}.")
  per, _ = _run(_RankedList(), embeddings, labels,
                {"alpha": alpha, "margin": margin, "t_neg": t_neg,
                 "t_pos": t_pos, "imbalance": imbalance}, block_size,
                axis_name, pos_mask, neg_mask)
  return _common.to_float32_scalar(_common.sum_over_batch(per, axis_name))
