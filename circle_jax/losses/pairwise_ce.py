r"""Hyp-ViT's pairwise cross-entropy (Ermolov et al., CVPR 2022), a rule.

For each positive pair ``(i, p)`` (two images of one class), a softmax
cross-entropy over every other sample of the batch, on the similarity
``s = -d_c`` of the Poincaré ball (``geometry="poincare"``, the default) or
the cosine (Hyp-ViT's "sphere" mode, ``hyp_c = 0``):

.. math::

  \ell_{ip} = -\log \frac{\exp(s_{ip}/\tau)}
                         {\sum_{k \ne i} \exp(s_{ik}/\tau)} .

It is NT-Xent's pair term (:mod:`circle_jax.losses.nt_xent`) with Hyp-ViT's
defaults (``tau = 0.2``, ``c = 0.1``, ``r = 2.3``), so its rule is
:class:`circle_jax.losses.nt_xent.NTXent`.

Differences from the official code (github.com/htdt/hyp_metric,
``train.py``'s ``contrastive_loss``): it draws each class once per batch
with ``num_samples`` images, and for every ordered pair of sample slots
``(a, b)`` takes a cross-entropy over slot ``b``'s images and slot ``a``'s
other images, *summing* the ``V (V - 1)`` terms. With labels we take the
mean over all positive pairs and every other sample as a candidate: the same
loss up to the factor ``V (V - 1)`` (2 with Hyp-ViT's two images per class)
when each class has ``V = 2`` images in the batch; with more, each anchor's
denominator also holds the images of the other slots.
"""

from __future__ import annotations

import jax

from circle_jax.losses import entries
from circle_jax.losses import engine
from circle_jax.losses import hyperbolic
from circle_jax.losses import nt_xent

Array = jax.Array

# Hyp-ViT's cross-entropy temperature (hyp_metric's train.py, ``t``).
PAIRWISE_CE_TAU = 0.2
# Hyp-ViT's ball: hyp_c = 0.1, clip_r = 2.3 (the Poincare defaults).
HYP_VIT_BALL = hyperbolic.Poincare()


def pairwise_ce_loss(embeddings: Array, labels: Array, *,
                     tau: float = PAIRWISE_CE_TAU, **options) -> Array:
  r"""Hyp-ViT's pairwise cross-entropy (Ermolov et al., CVPR 2022).

  .. math::

    L = \frac{1}{\sum_i |P(i)|} \sum_i \sum_{p \in P(i)} \Big[
      \operatorname*{LSE}_{k \in A(i)} \frac{-d_c(z_i, z_k)}{\tau}
      + \frac{d_c(z_i, z_p)}{\tau} \Big],

  ``z = exp_0^c(clip_r(x))`` on the Poincaré ball of curvature ``-c``
  (:mod:`circle_jax.losses.hyperbolic`), ``P(i)`` the anchor's positives,
  ``A(i)`` every candidate but itself (miner masks restrict both).

  Reduction: mean over all positive pairs; 0 with zero gradient without
  any. The official code sums over the ordered pairs of sample slots
  (module docstring): twice our value with two images per class.

  A ``reduction`` (docs/reductions.md) reduces the pair terms instead, as
  :func:`circle_jax.losses.nt_xent_loss`'s.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (Euclidean features; the
      geometry clips and maps them onto the ball).
    labels: ``[B]`` integer labels.
    tau: the temperature ``tau`` in [1e-3, 1e4] (Hyp-ViT: 0.2).
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`; ``geometry``
      defaults to Hyp-ViT's ball, ``Poincare(c=0.1, r=2.3)``
      (``"cosine"``: Hyp-ViT's sphere mode).

  Returns:
    float32 scalar.

  References:
    Ermolov, Mirvakhabova, Khrulkov, Sebe, Oseledets, "Hyperbolic Vision
    Transformers: Combining Improvements in Metric Learning", CVPR 2022.
  """
  options.setdefault("geometry", HYP_VIT_BALL)
  rule = nt_xent.NTXent(tau=tau)
  return engine.embedding_loss(rule, embeddings, labels, **options)


REGISTRY = (
    entries.entry("pairwise_ce", pairwise_ce_loss, "pair",
        rule=nt_xent.NTXent, geometry="poincare",
        paper="Ermolov et al., \"Hyperbolic Vision Transformers: "
              "Combining Improvements in Metric Learning\", CVPR 2022",
        reduction="mean over positive pairs",
        reduction_note="NT-Xent's pair terms (PML has no such loss); the "
                       "dense engine"),
)
