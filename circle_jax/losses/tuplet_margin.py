r"""Tuplet margin loss (Yu and Tao, ICCV 2019), a two-stage rule.

Each positive pair ``(a, p)``, at angle ``theta_ap`` (``s_ap = cos
theta_ap``), costs

.. math::

  \ell_{ap} = \log\Big(1 + \sum_{n \in N_a}
      e^{\sigma (s_{an} - \cos(\theta_{ap} - \beta))}\Big)
    = \operatorname{softplus}\big(t_a - \sigma \cos(\theta_{ap} - \beta)\big),
  \qquad t_a = \operatorname*{LSE}_{n \in N_a} \sigma s_{an},

with ``t_a`` the anchor's log-sum-exp over its negatives, read with its
gradient: the first stage, :class:`TupletNegatives`, gives it (as the N-pair
loss's), the second, :class:`TupletMargin`, averages the pair terms. So it
runs dense, blockwise and on the device ring.
``cos(theta - beta) = s cos beta + sqrt(1 - s^2) sin beta`` needs no
``arccos``.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses import ranges

Array = jax.Array

MARGIN_RANGE = ranges.HyperRange(0.0, 90.0)  # degrees


@engine.rule_dataclass
class TupletNegatives(engine.NegativeLogsumexp):
  """First stage: ``t_a = LSE_{n in N_a} scale s_an`` per anchor (the
  fields: :class:`TupletMargin`'s)."""

  margin: float = 5.73
  scale: float = 64.0

  def logits(self, s):
    return jnp.zeros_like(s), self.scale * s


@engine.rule_dataclass
class TupletMargin(engine.PositivePairMean):
  """Tuplet margin rule: ``softplus(t_a - scale cos(theta_ap - beta))``
  averaged over the positive pairs.

  Attributes:
    margin: ``beta`` in degrees, in [0, 90].
    scale: ``s``, in [1e-6, 1e4].
  """

  margin: float = 5.73
  scale: float = 64.0

  ranges = types.MappingProxyType({"margin": MARGIN_RANGE,
                                   "scale": ranges.SCALE_RANGE})

  def first_stage(self):
    return TupletNegatives(margin=self.margin, scale=self.scale,
                           geometry=self.geometry)

  def prepare(self, s, t_row=None, t_col=None):
    del t_col
    beta = jnp.deg2rad(jnp.asarray(self.margin, jnp.float32))
    sine = ops.safe_sqrt(jnp.maximum(1.0 - jnp.square(s), 0.0))
    shifted = s * jnp.cos(beta) + sine * jnp.sin(beta)
    return t_row - self.scale * shifted  # -inf: the anchor has no negative

  def values(self, u):
    some = u != -jnp.inf
    return (jnp.where(some, jax.nn.softplus(jnp.where(some, u, 0.0)), 0.0),
            jnp.zeros_like(u))

  pair_terms = True

  def side_weights(self):
    # The mean over the pairs; ``scale`` here is the cosines' scale, not
    # PositivePairMean's factor of the mean.
    return 1.0, 0.0


def tuplet_margin_loss(embeddings: Array, labels: Array, *,
                       margin: float = TupletMargin.margin,
                       scale: float = TupletMargin.scale, **options) -> Array:
  r"""Tuplet margin loss (Yu and Tao, ICCV 2019, eq. 3).

  .. math::

    L = \frac{1}{|P|} \sum_{(a,p) \in P} \log\Big(1 + \sum_{n \in N_a}
        e^{s (\cos\theta_{an} - \cos(\theta_{ap} - \beta))}\Big),

  ``cos theta`` the cosine similarity of the embeddings, ``P`` the ordered
  positive pairs, ``N_a`` the anchor's negatives (with miner masks, the
  masked sets).

  Reduction: mean over the ordered positive pairs (a pair whose anchor has
  no negative adds 0 and counts), as pytorch-metric-learning's
  ``TupletMarginLoss`` with its default ``MeanReducer``; 0 with zero
  gradient without a positive pair.

  Differences from pytorch-metric-learning 2.9
  (``TupletMarginLoss(margin, scale)``, same names, units and defaults): none
  found; equal value and gradient, with and without a miner (tested to
  float32 rounding). ``margin`` is in degrees, as PML's (5.73 degrees is the
  paper's ``beta = 0.1`` radians); ``cos(theta - beta)`` is computed without
  ``arccos`` (PML's gradient at ``s = 1`` is infinite, ours there is
  finite). The cosine geometry only (the loss reads angles). The paper adds
  the intra-pair variance loss
  (:func:`circle_jax.losses.intra_pair_variance_loss`) with a weight; so
  does PML's user, by combining the two losses.

  A ``reduction`` (docs/reductions.md) reduces these pair terms instead
  (PML's ``pos_pair`` elements), on the dense engine; ``"none"`` gives them
  as ``[B, N]`` at (anchor, positive), 0 elsewhere.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    margin: ``beta`` in degrees, in [0, 90].
    scale: ``s``, the scale of the cosines, in [1e-6, 1e4].
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Yu, Tao, "Deep Metric Learning with Tuplet Margin Loss", ICCV 2019.
  """
  engine.require_cosine(options.get("geometry"), "tuplet margin loss",
                        "reads angles between unit vectors")
  rule = TupletMargin(margin=margin, scale=scale)
  return engine.embedding_loss(rule, embeddings, labels, **options)


REGISTRY = (
    entries.entry("tuplet_margin", tuplet_margin_loss, "pair",
        rule=TupletMargin,
        paper="Yu and Tao, \"Deep Metric Learning with Tuplet Margin "
              "Loss\", ICCV 2019",
        reduction="mean over ordered positive pairs",
        reduction_note="PML's `pos_pair` elements; the dense engine"),
)
