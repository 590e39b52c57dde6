r"""Signal-to-noise-ratio contrastive loss (Yuan et al., CVPR 2019), a rule.

The two-margin contrastive rule (:class:`circle_jax.losses.contrastive.
Contrastive`) on the SNR distance of L2-normalised embeddings,

.. math::

  d_{ij} = \frac{\operatorname{var}(x_i - x_j)}{\operatorname{var}(x_i)}
         = \frac{|x_i|^2 + |x_j|^2 - 2 x_i^\top x_j - (m_i - m_j)^2 / D}
                {|x_i|^2 - m_i^2 / D},
  \qquad m_i = \textstyle\sum_k x_{ik},

(the variances over the ``D`` features; the anchor's in the denominator,
so ``d`` is not symmetric). The second form needs a tile's matmul and each
side's norm and feature sum only, so :class:`SNR` is a geometry (its
"similarity" is ``-d``) and the loss runs dense, blockwise and on the device
ring like every rule.

The issue's ``snr`` geometry (PML's ``SNRDistance`` for every loss) did not
exist when this loss was written: :class:`SNR` is defined here and
registered as ``"snr"``, so any pair loss that reads distances may already
take ``geometry="snr"``.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import contrastive
from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses import ranges

Array = jax.Array

_HIGHEST = jax.lax.Precision.HIGHEST
_TINY = 1e-12


@dataclasses.dataclass(frozen=True)
class SNR(engine.Geometry):
  """The SNR distance of L2-normalised embeddings, as ``s = -d`` (module
  docstring); ``to_distance(s) = -s``."""

  def embed(self, x):
    return ops.l2_normalize(x)

  def tile(self, z_rows, z_cols):
    dim = z_rows.shape[1]
    dot = jnp.matmul(z_rows, z_cols.T, precision=_HIGHEST)
    sum_r = jnp.sum(z_rows, axis=1, keepdims=True)
    sum_c = jnp.sum(z_cols, axis=1, keepdims=True).T
    sq_r = jnp.sum(z_rows * z_rows, axis=1, keepdims=True)
    sq_c = jnp.sum(z_cols * z_cols, axis=1, keepdims=True).T
    noise = sq_r + sq_c - 2.0 * dot - jnp.square(sum_r - sum_c) / dim
    signal = sq_r - jnp.square(sum_r) / dim
    return -jnp.maximum(noise, 0.0) / jnp.maximum(signal, _TINY)

  def to_distance(self, s):
    return -s


SNR_GEOMETRY = SNR()
engine.register_geometry("snr", SNR_GEOMETRY)


@engine.rule_dataclass(meta=("on_distance",))
class SNRContrastive(contrastive.Contrastive):
  """The contrastive rule on the SNR geometry with PML's defaults.

  Attributes:
    pos_margin: ``m_+`` >= 0: positives nearer than this are not pulled.
    neg_margin: ``m_-`` >= 0: negatives farther than this are not pushed.
  """

  pos_margin: float = 0.0
  neg_margin: float = 1.0

  geometry: engine.Geometry = dataclasses.field(default=SNR_GEOMETRY,
                                                kw_only=True)
  ranges = types.MappingProxyType({
      "pos_margin": ranges.NONNEGATIVE_RANGE,
      "neg_margin": ranges.NONNEGATIVE_RANGE})


def snr_contrastive_loss(embeddings: Array, labels: Array, *,
                         pos_margin: float = SNRContrastive.pos_margin,
                         neg_margin: float = SNRContrastive.neg_margin,
                         **options) -> Array:
  r"""Signal-to-noise-ratio contrastive loss (Yuan et al., CVPR 2019).

  .. math::

    L = \operatorname*{mean}_{(i,j) \in P,\ \ell^+_{ij} > 0} \ell^+_{ij}
      + \operatorname*{mean}_{(i,j) \in N,\ \ell^-_{ij} > 0} \ell^-_{ij},
    \quad \ell^+_{ij} = [d_{ij} - m_+]_+,\ \ell^-_{ij} = [m_- - d_{ij}]_+,

  ``d`` the SNR distance of the L2-normalised embeddings (module
  docstring), ``P`` / ``N`` the ordered positive / negative pairs.

  Reduction: each set's terms averaged over its pairs with a non-zero term
  and the two means summed (pytorch-metric-learning's ``AvgNonZeroReducer``
  on each sub-loss); a set without a non-zero term adds 0.

  Differences from pytorch-metric-learning 2.9
  (``SignalToNoiseRatioContrastiveLoss(pos_margin, neg_margin)``, same
  names and defaults, its ``SNRDistance``): none found; equal value and
  gradient (tested to float32 rounding). The paper's loss adds a
  regulariser on the embeddings' mean (``lambda``, not in PML's loss); add
  it outside if wanted. The SNR distance is computed here from a tile's
  matmul (module docstring), PML's from the ``[M, N, D]`` differences.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    pos_margin: ``m_+`` >= 0.
    neg_margin: ``m_-`` >= 0.
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Yuan, Chen, Wang, Yang, Li, Wang, "Signal-To-Noise Ratio: A Robust
    Distance Metric for Deep Metric Learning", CVPR 2019.
  """
  rule = SNRContrastive(pos_margin=pos_margin, neg_margin=neg_margin)
  return engine.embedding_loss(rule, embeddings, labels, **options)


REGISTRY = (
    entries.entry("snr_contrastive", snr_contrastive_loss, "pair",
        rule=SNRContrastive,
        paper="Yuan et al., \"Signal-To-Noise Ratio: A Robust Distance "
              "Metric for Deep Metric Learning\", CVPR 2019",
        reduction="mean over non-zero positive pairs + mean over "
                  "non-zero negative pairs"),
)
