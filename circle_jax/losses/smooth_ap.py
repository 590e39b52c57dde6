r"""Smooth-AP (Brown, Xie, Kalogeiton, Zisserman, ECCV 2020), tile by tile.

For anchor ``i`` with positives ``P_i`` and candidates ``Omega_i``
(positives and negatives, never ``i`` itself) the rank of a candidate ``j``
is smoothed with a sigmoid of temperature ``tau``:

.. math::

  \mathrm{AP}_i \approx \frac{1}{|P_i|} \sum_{j \in P_i}
    \frac{1 + \sum_{k \in P_i, k \ne j} \sigma\big((s_{ik} - s_{ij})/\tau\big)}
         {1 + \sum_{k \in \Omega_i, k \ne j}
              \sigma\big((s_{ik} - s_{ij})/\tau\big)},
  \qquad L = \operatorname*{mean}_{i:\ |P_i| > 0} (1 - \mathrm{AP}_i).

Since ``sigma(0) = 1/2``, ``1 + sum_{k != j}`` is ``1/2 + sum_k`` over the
whole set (``j`` is in both sets), which is how the tiles accumulate it.

Memory. Formed at once, the ``[j, k]`` matrix of every anchor is a
``[B, B, B]`` tensor (pytorch-metric-learning's ``SmoothAPLoss`` and the
official code build it; 275 GB in float32 at B = 4,096). Here the anchors
are taken in blocks of ``R`` rows (``jax.lax.map``) and, within a block, the
candidates ``k`` in tiles of ``K`` columns (``jax.lax.scan``), so the live
intermediate is one ``[R, N, K]`` tile; the block's ranks (numerators and
denominators, ``[R, N]``) accumulate over the tiles. A ``custom_vjp``
recomputes the tiles in the backward pass from the closed-form gradient
(below), so autodiff stores no tile either. Time ``O(M N^2)`` sigmoids
(``O(B^3)``; plus the ``O(B^2 D)`` similarity matmul), memory
``O(B D + M N + R N K)``: ``O(B^2)`` for the similarities, their masks and
the ranks, and ``O(block^2 B)`` for a tile (``R = K = block_size``).
Measured (XLA's memory analysis of ``jit(value_and_grad)``, D = 512, tiles
of 128): peak 154 MiB at B = 1,024, 345 MiB at 2,048, 833 MiB at 4,096
(x2.2, x2.4 per doubling; one tile would need 20 GB, 164 GB, 1.3 TB):
``python -m experiments.bench.ranking`` (experiments/results/bench/ranking_cpu.md).

Gradient. With ``n_j``, ``d_j`` the numerator and denominator of positive
``j`` and ``sigma'_jk = sigma(1 - sigma)`` at ``(s_k - s_j) / tau``, let
``a_j = 1 / (|P| d_j)``, ``b_j = -n_j / (|P| d_j^2)`` (0 off ``P``) and
``t_jk = (a_j [k in P] + b_j [k in Omega]) sigma'_jk / tau``; then
``dAP/ds_m = sum_j t_jm - sum_k t_mk`` (``m`` as the compared candidate,
then as the positive being ranked) and ``dAP/dtau = -sum_jk t_jk (s_k -
s_j) / tau``.

Published implementations, and what we follow. The paper's equation is the
one above. The official code (Andrew-Brown1/Smooth_AP, ``Smooth_AP_loss.py``)
and pytorch-metric-learning 2.9.0's ``SmoothAPLoss`` (a port of it) differ:

* they need every class to have the same number ``g`` of samples in the
  batch, stored contiguously, and take the positive set from that layout
  rather than from the labels (PML checks the equal counts and raises
  otherwise). PML 2.9.0 computes the batch size over the number of
  classes (the samples per class) but uses it as the number of groups, so
  its groups hold as many samples as there are classes: the classes only
  when the two counts are equal (checked in
  tests/losses/test_smooth_ap.py: with 4 classes of 4 its value is the
  official form's, with 2 classes of 3 it is not; the benchmark builds
  square batches);
* the ``[j, k]`` mask removes only ``k = j``, so the anchor itself is both
  a candidate and one of its own positives (its similarity with itself is
  the largest): each anchor's AP averages ``g`` terms including a
  self-retrieval term close to 1, and every other positive's rank counts
  the anchor as one more retrieved positive above it;
* the official code clamps the sigmoid's exponent to [-50, 50].

We follow the paper with label-defined sets: ``P_i`` the candidates with the
anchor's label (any class sizes, any order, miner masks and references
allowed), ``Omega_i`` all valid candidates, the anchor excluded from both;
``jax.nn.sigmoid`` needs no clamp. Anchors without positives are left out
of the mean (zero loss, zero gradient). Default ``tau = 0.01``: the
paper's, the official ``main.py``'s ``--sigmoid_temperature`` and PML's.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp

from circle_jax.losses import entries
from circle_jax.losses import ranges
from circle_jax.losses import ranking

Array = jax.Array
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class SmoothAP:
  """Smooth-AP's hyperparameters and their documented ranges.

  Attributes:
    tau: the sigmoid's temperature ``tau`` in [1e-3, 1e4] (at 1e-3 a
      difference of cosines is at most 2e3 inside the sigmoid, which
      saturates without overflow).
  """

  tau: float = 0.01

  ranges = types.MappingProxyType(
      {"tau": ranges.DIVIDING_TEMPERATURE_RANGE})

  def __post_init__(self):
    ranges.check_ranges({"tau": self.tau}, self.ranges, "Smooth-AP")


def _block_ap(s, pos, cand, tau, k_block):
  num, den = ranking.block_ranks(s, (pos, cand), tau, k_block)
  count = jnp.sum(pos, axis=1).astype(F32)
  ratio = jnp.where(pos, num / den, 0.0)
  return jnp.sum(ratio, axis=1) / jnp.maximum(count, 1.0), (num, den)


def _block_grad(s, pos, cand, tau, num, den, g, k_block):
  """``(dL/ds [R, N], dL/dtau [R])`` of one block, ``g`` the anchors'
  cotangents ``[R]``."""
  count = jnp.maximum(jnp.sum(pos, axis=1).astype(F32), 1.0)
  scale = (g / count)[:, None]
  a = jnp.where(pos, scale / den, 0.0)
  b = jnp.where(pos, -scale * num / (den * den), 0.0)
  return ranking.block_rank_grad(s, (pos, cand), (a, b), tau, k_block)


def _blocks(s, pos, cand, r_block):
  return (ranking.row_blocks(s, r_block), ranking.row_blocks(pos, r_block),
          ranking.row_blocks(cand, r_block))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def smooth_ap_per_anchor(s, pos, cand, tau, block):
  """Smooth-AP of every anchor, tile by tile (module docstring).

  Args:
    s: ``[M, N]`` float32 similarities.
    pos: ``[M, N]`` bool positives ``P_i``.
    cand: ``[M, N]`` bool candidates ``Omega_i`` (containing ``pos``).
    tau: the temperature (a float or a traced scalar).
    block: static int, the rows per block and columns per tile.

  Returns:
    ``[M]`` float32 ``AP_i`` (0 for an anchor without positives).
  """
  return _forward(s, pos, cand, tau, block)[0]


def _forward(s, pos, cand, tau, block):
  m, n = s.shape
  r_block, k_block = min(block, m), min(block, n)
  ap, (num, den) = jax.lax.map(
      lambda x: _block_ap(*x, tau, k_block), _blocks(s, pos, cand, r_block))
  ap = ap.reshape(-1)[:m]
  num = num.reshape(-1, n)[:m]
  den = den.reshape(-1, n)[:m]
  return ap, (s, pos, cand, tau, num, den)


def _backward(block, residuals, g):
  s, pos, cand, tau, num, den = residuals
  m, n = s.shape
  r_block, k_block = min(block, m), min(block, n)
  blocks = _blocks(s, pos, cand, r_block) + (
      ranking.row_blocks(num, r_block), ranking.row_blocks(den, r_block),
      ranking.row_blocks(g.astype(F32), r_block))
  ds, dtau = jax.lax.map(
      lambda x: _block_grad(*x[:3], tau, *x[3:], k_block), blocks)
  ds = ds.reshape(-1, n)[:m]
  dtau = jnp.sum(dtau).astype(jnp.result_type(tau))
  return ds, None, None, jnp.reshape(dtau, jnp.shape(tau))


smooth_ap_per_anchor.defvjp(
    lambda s, pos, cand, tau, block: _forward(s, pos, cand, tau, block),
    _backward)


def smooth_ap_loss(embeddings: Array, labels: Array, *,
                   tau: float = SmoothAP.tau, **options) -> Array:
  r"""Smooth-AP loss (Brown et al., ECCV 2020), without a ``B^3`` tensor.

  .. math::

    L = \operatorname*{mean}_{i:\ |P_i| > 0} \Big(1 - \frac{1}{|P_i|}
      \sum_{j \in P_i} \frac{1/2 + \sum_{k \in P_i}
        \sigma((s_{ik} - s_{ij})/\tau)}{1/2 + \sum_{k \in \Omega_i}
        \sigma((s_{ik} - s_{ij})/\tau)}\Big),

  ``s`` the cosine similarity (or the ``geometry``'s), ``P_i`` the anchor's
  positives and ``Omega_i`` its positives and negatives (the anchor itself
  excluded; with miner masks, the masked sets). See the module docstring
  for the tiling, the gradient and how the official code and
  pytorch-metric-learning differ (we follow the paper with label-defined
  sets of any size).

  Reduction: mean over the anchors with at least one positive (global over
  ``axis_name``); an anchor without positives contributes 0 with zero
  gradient. Time ``O(B^3)`` (sigmoids) + ``O(B^2 D)``; memory ``O(B^2 +
  block^2 B)``.

  A ``reduction`` (docs/reductions.md) reduces the anchor terms ``1 - AP_i``
  of the anchors with a positive instead (PML's ``element`` terms), dense
  and blockwise; ``"none"`` gives them as ``[B]``, 0 for the others.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (computed in float32).
    labels: ``[B]`` integer labels.
    tau: the sigmoid's temperature ``tau`` in [1e-3, 1e4] (default 0.01, the
      paper's).
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`;
      here ``block_size`` is the tile size (rows of anchors and columns of
      candidates; ``None``: 128) and ``collective="ring"`` is refused. It
      also takes ``geometry``, a :class:`circle_jax.losses.engine.Geometry`
      (``None``: cosine): any similarity can be ranked.

  Returns:
    float32 scalar.

  References:
    Brown, Xie, Kalogeiton, Zisserman, "Smooth-AP: Smoothing the Path
    Towards Large-Scale Image Retrieval", ECCV 2020.
  """
  SmoothAP(tau=tau)  # the range check
  block = ranking.ranking_block(embeddings, labels, loss="Smooth-AP loss",
                                **options)
  tau = ranking.varying_scalar(tau, block)
  ap = smooth_ap_per_anchor(block.s, block.pos, block.cand, tau, block.block)
  return ranking.ap_loss(ap, block, options.get("axis_name"))


REGISTRY = (
    entries.entry("smooth_ap", smooth_ap_loss, "pair", rule=SmoothAP,
        paper="Brown, Xie, Kalogeiton, Zisserman, \"Smooth-AP: Smoothing "
              "the Path Towards Large-Scale Image Retrieval\", ECCV 2020",
        reduction=ranking.AP_REDUCTION,
        reduction_note="anchors with >= 1 positive, PML's `element` (its "
                       "AP groups the batch as the official code); dense "
                       "and blockwise"),
)
