r"""Signal-to-noise-ratio contrastive loss (Yuan et al., CVPR 2019), a rule.

The two-margin contrastive rule (:class:`circle_jax.losses.contrastive.
Contrastive`) on the SNR distance of L2-normalised embeddings,
``d_ij = var(x_i - x_j) / var(x_i)``
(the anchor's variance in the denominator, so ``d`` is not symmetric). The
distance is the shared ``snr`` geometry
(:class:`circle_jax.losses.engine.SNR`, PML's ``SNRDistance``, which any
pair loss takes as ``geometry="snr"``), so the loss runs dense, blockwise and
on the device ring like every rule.
"""

from __future__ import annotations

import dataclasses
import types

import jax

from circle_jax.losses import contrastive
from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses import ranges

Array = jax.Array

SNR_GEOMETRY = engine.SNR()


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
