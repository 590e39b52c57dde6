r"""Neighbourhood Components Analysis loss (Goldberger et al. 2004), a rule.

Anchor ``i`` picks a neighbour ``j`` with probability
``softmax_j(-scale d_ij^2)`` over every other candidate; the loss is minus
the log-probability that the neighbour has its label:

.. math::

  \ell_i = -\log \frac{\sum_{p \in P_i} e^{-\sigma d_{ip}^2}}
                      {\sum_{a \in P_i \cup N_i} e^{-\sigma d_{ia}^2}}
         = \operatorname{softplus}\Big(
             \operatorname*{LSE}_{n \in N_i} (-\sigma d_{in}^2)
             - \operatorname*{LSE}_{p \in P_i} (-\sigma d_{ip}^2)\Big).

The second form is a rule of two disjoint log-sum-exps (like Circle's), so
it runs dense, blockwise and on the device ring.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses import ranges

Array = jax.Array


def squared_distance(geometry, s):
  """The geometry's squared distance of a pair from its similarity ``s``:
  ``2 - 2 s`` for unit vectors (cosine; smooth at ``s = 1``), else the
  square of ``geometry.to_distance(s)``."""
  if isinstance(geometry, engine.Cosine):
    return 2.0 - 2.0 * s
  return jnp.square(geometry.to_distance(s))


@engine.rule_dataclass
class NCA(engine.PairRule):
  """NCA rule: ``softplus(LSE_N l - LSE_P l)`` with ``l = -scale d^2``.

  Attributes:
    softmax_scale: the scale ``sigma`` of the squared distances, in
      [1e-6, 1e4].
  """

  softmax_scale: float = 1.0

  ranges = types.MappingProxyType({"softmax_scale": ranges.SCALE_RANGE})

  def logits(self, s):
    logit = -self.softmax_scale * squared_distance(self.geometry, s)
    return logit, logit

  def combine(self, lse_p, lse_n):
    valid = lse_p != -jnp.inf
    some = valid & (lse_n != -jnp.inf)
    x = jnp.where(some, lse_n - jnp.where(some, lse_p, 0.0), 0.0)
    return jnp.where(some, jax.nn.softplus(x), 0.0), valid


def nca_loss(embeddings: Array, labels: Array, *,
             softmax_scale: float = NCA.softmax_scale, **options) -> Array:
  r"""Neighbourhood Components Analysis loss (Goldberger et al., NIPS 2004).

  .. math::

    L = \operatorname*{mean}_{i:\ |P_i| > 0}
      -\log \frac{\sum_{p \in P_i} e^{-\sigma d_{ip}^2}}
                 {\sum_{a \in P_i \cup N_i} e^{-\sigma d_{ia}^2}},

  ``d`` the Euclidean distance of the L2-normalised embeddings
  (``d^2 = 2 - 2 s``; on another geometry, its distance squared), ``P_i``
  and ``N_i`` the anchor's positives and negatives (every other candidate;
  with miner masks, the masked sets).

  Reduction: mean over the anchors with at least one positive, as
  pytorch-metric-learning's ``NCALoss`` with its default ``MeanReducer``
  (it drops the anchors whose positive probability is 0, i.e. without
  positives). An anchor without positives contributes 0 with zero gradient;
  one without negatives has probability 1 and loss 0.

  Differences from pytorch-metric-learning 2.9 (``NCALoss(softmax_scale)``,
  same name and default): equal value and gradient without a miner (tested
  to float32 rounding). With a miner, PML keeps every pair in the softmax and
  weighs each anchor's term by how often it appears in the mined tuples;
  here ``pos_mask`` / ``neg_mask`` restrict the sets ``P_i`` and ``N_i``
  themselves, like every rule of this package.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    softmax_scale: ``sigma``, the scale of the squared distances inside the
      softmax, in [1e-6, 1e4] (PML's name; the paper has none, its
      ``A`` absorbs it).
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Goldberger, Roweis, Hinton, Salakhutdinov, "Neighbourhood Components
    Analysis", NIPS 2004.
  """
  rule = NCA(softmax_scale=softmax_scale)
  return engine.embedding_loss(rule, embeddings, labels, **options)


REGISTRY = (
    entries.entry("nca", nca_loss, "pair", rule=NCA,
        paper="Goldberger et al., \"Neighbourhood Components Analysis\", "
              "NIPS 2004",
        reduction="mean over anchors with >= 1 positive"),
)
