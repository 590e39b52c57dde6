r"""FastAP (Cakir, He, Xia, Kulis, Sclaroff, CVPR 2019), column tile by tile.

AP from distance histograms: the squared Euclidean distance of unit vectors
``d_ik = |z_i - z_k|^2 = 2 - 2 s_ik`` in ``[0, 4]`` is soft-binned into
``L + 1`` bins centred at ``z_l = l Delta`` (``l = 0..L``, ``Delta = 4 / L``)
with the triangular kernel ``delta(d, l) = max(0, 1 - |d - z_l| / Delta)``
(which sums to 1 over the bins for every ``d`` in ``[0, 4]``). For anchor
``i`` with positives ``P_i`` and candidates ``Omega_i`` (positives and
negatives, never ``i`` itself):

.. math::

  h^+_l = \sum_{k \in P_i} \delta(d_{ik}, l),\quad
  h_l = \sum_{k \in \Omega_i} \delta(d_{ik}, l),\quad
  H^+_l = \sum_{l' \le l} h^+_{l'},\quad H_l = \sum_{l' \le l} h_{l'},

.. math::

  \mathrm{FastAP}_i = \frac{1}{|P_i|} \sum_{l} \frac{h^+_l H^+_l}{H_l}
  \ (0/0 \to 0), \qquad
  L = 1 - \operatorname*{mean}_{i:\ |P_i| > 0} \mathrm{FastAP}_i .

Memory. The histograms are ``[M, L + 1]``; the candidates are taken in
column tiles of ``K`` (``jax.lax.scan``) whose body is rematerialised
(``jax.checkpoint``), so neither pass keeps a ``[M, N, L + 1]`` tensor: the
live intermediate is one ``[M, K, L + 1]`` tile and the backward pass
stores only the ``[M, L + 1]`` histograms per tile. Time ``O(M N L)`` +
the ``O(B^2 D)`` similarity matmul; memory ``O(B D + M N + M K L)``.
Measured (XLA's memory analysis of ``jit(value_and_grad)``, D = 512, tiles
of 128): peak 37 MiB at B = 1,024, 101 MiB at 2,048, 334 MiB at 4,096:
``python -m experiments.bench.ranking`` (experiments/results/bench/ranking_cpu.md).

Published implementations, and what we follow. The official PyTorch layer
(kunhe/FastAP-metric-learning, ``pytorch/FastAP_loss.py``) and
pytorch-metric-learning 2.9.0's ``FastAPLoss`` (adapted from it) both use
``num_bins + 1`` centres ``linspace(0, 4, num_bins + 1)`` with width
``4 / num_bins``, as we do (``L`` = their ``num_bins``, default 10, the
paper's). Differences:

* the official layer computes ``d = 2 - 2 x.x^T`` from the raw input (a
  squared distance only if the caller normalised it) and writes its
  backward pass by hand: by our reading it ignores the incoming cotangent
  and omits the ``1 / (number of anchors)`` of the mean and the factor 2 of
  ``d(d_ik)/dz``, so its gradient is a multiple of the forward's. It drops
  anchors without positives from the mean (NaN filter), as we do;
* PML normalises the embeddings (``LpDistance(power=2)``), reduces by the
  mean over the anchors with positives, and takes no references (``ref``);
  on a batch with an anchor without positives its value and gradient equal
  ours to float32 rounding (tests/losses/test_fastap.py).

We follow the formula above with autodiff (exact gradient of the value),
L2-normalised embeddings, label-defined sets (miner masks and references
allowed) and the distances clipped to ``[0, 4]`` (float32 rounding of
``2 - 2 s`` can leave the interval by ~1e-7, where the kernels would no
longer sum to 1).
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp

from circle_jax.losses import entries
from circle_jax.losses import engine
from circle_jax.losses import ranges
from circle_jax.losses import ranking

Array = jax.Array
F32 = jnp.float32

# The range of the squared Euclidean distance of unit vectors.
_D_MAX = 4.0


@dataclasses.dataclass(frozen=True)
class FastAP:
  """FastAP's hyperparameters and their documented ranges.

  Attributes:
    L: the number of histogram bins (an int in [1, 1000]; ``L + 1`` centres).
  """

  L: int = 10

  ranges = types.MappingProxyType({"L": ranges.HyperRange(1, 1000)})

  def __post_init__(self):
    if isinstance(self.L, bool) or not isinstance(self.L, int):
      raise ValueError(
          f"`L` (the number of FastAP's histogram bins) must be a Python int; "
          f"got {self.L!r}. It sets a shape: pass a constant.")
    ranges.check_ranges({"L": self.L}, self.ranges, "FastAP")


def _histograms(d, pos, cand, num_bins, k_block):
  """``(h+, h)``, ``[M, L + 1]`` soft counts of positives and candidates."""
  delta = _D_MAX / num_bins
  centres = jnp.arange(num_bins + 1, dtype=F32) * delta
  tiles = (ranking.column_tiles(d, k_block),
           ranking.column_tiles(pos, k_block),
           ranking.column_tiles(cand, k_block))

  @jax.checkpoint
  def step(carry, tile):
    h_pos, h_all = carry
    d_k, pos_k, cand_k = tile
    pulse = jax.nn.relu(1.0 - jnp.abs(d_k[:, :, None] - centres) / delta)
    h_pos = h_pos + jnp.sum(jnp.where(pos_k[:, :, None], pulse, 0.0), 1)
    h_all = h_all + jnp.sum(jnp.where(cand_k[:, :, None], pulse, 0.0), 1)
    return (h_pos, h_all), None

  # Shaped from d, so it is device-varying like the tiles under shard_map.
  zeros = jnp.zeros_like(d[:, :1]) * centres
  (h_pos, h_all), _ = jax.lax.scan(step, (zeros, zeros), tiles)
  return h_pos, h_all


def fastap_per_anchor(d, pos, cand, *, L: int, block: int) -> Array:
  """``FastAP_i`` ``[M]`` of squared distances ``d`` ``[M, N]`` in [0, 4]
  (0 for an anchor without positives)."""
  h_pos, h_all = _histograms(d, pos, cand, L, min(block, d.shape[1]))
  cum_pos = jnp.cumsum(h_pos, axis=1)
  cum_all = jnp.cumsum(h_all, axis=1)
  filled = cum_all > 0  # h+ <= h <= H: 0 where H is 0
  terms = jnp.where(filled, h_pos * cum_pos / jnp.where(filled, cum_all, 1.0),
                    0.0)
  count = jnp.sum(pos, axis=1).astype(F32)
  return jnp.sum(terms, axis=1) / jnp.maximum(count, 1.0)


def fastap_loss(embeddings: Array, labels: Array, *, L: int = FastAP.L,
                **options) -> Array:
  r"""FastAP loss (Cakir et al., CVPR 2019), without a ``[B, B, L]`` tensor.

  .. math::

    L = 1 - \operatorname*{mean}_{i:\ |P_i| > 0} \frac{1}{|P_i|}
      \sum_{l=0}^{L} \frac{h^+_l H^+_l}{H_l},

  the histograms of the squared Euclidean distances ``2 - 2 s_ik`` of the
  L2-normalised embeddings (module docstring: the binning, the memory, and
  how the official code and pytorch-metric-learning differ).

  Reduction: mean over the anchors with at least one positive (global over
  ``axis_name``); an anchor without positives contributes 0 with zero
  gradient. Time ``O(B^2 (D + L))``; memory ``O(B^2 + block B L)``.

  A ``reduction`` (docs/reductions.md) reduces the anchor terms ``1 -
  FastAP_i`` of the anchors with a positive instead (PML's ``element``
  terms), dense and blockwise; ``"none"`` gives them as ``[B]``, 0 for the
  others.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (computed in float32).
    labels: ``[B]`` integer labels.
    L: the number of bins (int in [1, 1000]; default 10, the paper's);
      ``L + 1`` centres ``0, 4/L, ..., 4``.
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`;
      here ``block_size`` is the column tile (``None``: 128) and
      ``collective="ring"`` is refused. ``geometry`` may only be ``None``
      or cosine (``circle_jax.losses.engine.COSINE``): the histogram's
      range [0, 4] is that of unit vectors.

  Returns:
    float32 scalar.

  References:
    Cakir, He, Xia, Kulis, Sclaroff, "Deep Metric Learning to Rank", CVPR
    2019.
  """
  FastAP(L=L)  # the type and range check
  geometry = engine.resolve_geometry(options.get("geometry"))
  if geometry is not None and not isinstance(geometry, engine.Cosine):
    raise ValueError(
        "FastAP bins squared distances of unit vectors in [0, 4]; it takes "
        f"only the cosine geometry (geometry=None); got {geometry!r}.")
  block = ranking.ranking_block(embeddings, labels, loss="FastAP loss",
                                **options)
  d = jnp.clip(2.0 - 2.0 * block.s, 0.0, _D_MAX)
  fast_ap = fastap_per_anchor(d, block.pos, block.cand, L=L,
                              block=block.block)
  return ranking.ap_loss(fast_ap, block, options.get("axis_name"))


REGISTRY = (
    entries.entry("fastap", fastap_loss, "pair", rule=FastAP,
        paper="Cakir, He, Xia, Kulis, Sclaroff, \"Deep Metric Learning "
              "to Rank\", CVPR 2019",
        reduction=ranking.AP_REDUCTION,
        reduction_note="anchors with >= 1 positive, PML's `element` terms; "
                       "dense and blockwise"),
)
