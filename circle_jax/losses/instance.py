r"""Instance loss (Zheng et al., ACM TOMM 2020), in-batch, a rule.

Every instance (a label) is a class, and the batch's own unit-norm
embeddings, scaled by ``gamma``, are the classifier's weights: anchor ``i``
is classified among every row of the batch, itself included, and its class
is the anchor with its positives:

.. math::

  \ell_i = -\log \frac{e^{\gamma} + \sum_{p \in P_i} e^{\gamma s_{ip}}}
                      {e^{\gamma} + \sum_{a \in P_i \cup N_i}
                       e^{\gamma s_{ia}}}
         = \operatorname{softplus}\Big(
             \operatorname*{LSE}_{n \in N_i} \gamma s_{in}
             - \operatorname{logaddexp}(\gamma,
               \operatorname*{LSE}_{p \in P_i} \gamma s_{ip})\Big),

``e^{\gamma}`` the anchor's own column (``s_ii = 1``). The second form is a
rule of two disjoint log-sum-exps with a constant added to one of them, so
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


@engine.rule_dataclass
class Instance(engine.PairRule):
  """Instance rule: ``softplus(LSE_N l - logaddexp(gamma, LSE_P l))`` with
  ``l = gamma s`` (cosine similarities of unit vectors).

  Attributes:
    gamma: the scale ``gamma`` of the cosine similarities, in [1e-6, 1e4].
  """

  gamma: float = 64.0

  ranges = types.MappingProxyType({"gamma": ranges.SCALE_RANGE})

  def logits(self, s):
    logit = self.gamma * s
    return logit, logit

  def combine(self, lse_p, lse_n):
    # The anchor's own column, gamma * s_ii = gamma, is always a positive.
    own = jnp.logaddexp(jnp.asarray(self.gamma, lse_p.dtype), lse_p)
    some = lse_n != -jnp.inf
    x = jnp.where(some, lse_n, 0.0) - own
    return jnp.where(some, jax.nn.softplus(x), 0.0), jnp.ones_like(some)


def instance_loss(
    embeddings: Array,
    labels: Array,
    *,
    gamma: float = Instance.gamma,
    **options,
) -> Array:
  r"""Instance loss (Zheng et al., ACM TOMM 2020), in-batch.

  .. math::

    L = \operatorname*{mean}_i
      -\log \frac{e^{\gamma} + \sum_{p \in P_i} e^{\gamma s_{ip}}}
                 {e^{\gamma} + \sum_{a \in P_i \cup N_i} e^{\gamma s_{ia}}},

  ``s`` the cosine similarity, ``P_i`` and ``N_i`` the anchor's positives
  and negatives (the other rows of its label and of other labels; with miner
  masks, the masked sets; with references, among the references), and
  ``e^{\gamma}`` the anchor's own column: each label is one instance class
  whose in-batch weights are its rows, the anchor included, as the paper's
  classifier ``W_share`` has one class per instance.

  Reduction: mean over every anchor, as pytorch-metric-learning's
  ``InstanceLoss`` with its default ``MeanReducer``. An anchor without
  negatives has loss 0 and zero gradient.

  Differences from pytorch-metric-learning 2.9 (``InstanceLoss(gamma)``,
  same name and default, cosine similarity only): equal value and gradient
  when the labels are ``0..B-1`` in batch order, or absent in PML (every row
  its own instance; tested in float64). PML bug: with labels it takes
  ``torch.unique(labels, return_inverse=True)``, the rank of each label
  among the batch's labels, as the index of the target *column* of the
  ``[B, B]`` similarity logits, so anchor ``i``'s target is the row whose
  position equals its label's rank, an unrelated sample in general (labels
  ``[5, 5, 7, 7]``: anchor 2's target is row 1, of label 5). We follow the
  paper: the target is the anchor's instance class, its own column with its
  positives' (tested against a float64 loop reference). PML refuses miner
  tuples and ``ref_emb``; here masks restrict ``P_i`` and ``N_i`` and
  references are the candidates, as for every rule.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels (one per instance).
    gamma: the scale ``gamma`` of the cosine logits, in [1e-6, 1e4] (PML's
      name and default; the paper's classifier is unnormalised and has none).
    **options: the pair losses' shared keywords (``axis_name``,
      ``pos_mask``, ``neg_mask``, ``block_size``, ``collective``, ``ref``),
      documented once at :func:`circle_jax.losses.engine.embedding_loss`;
      the cosine geometry only (the own column's ``s_ii = 1``).

  Returns:
    float32 scalar.

  References:
    Zheng, Zheng, Garrett, Yang, Xu, Shen, "Dual-Path Convolutional
    Image-Text Embeddings with Instance Loss", ACM Transactions on
    Multimedia Computing, Communications, and Applications (TOMM) 16(2),
    2020.
  """
  engine.require_cosine(options.get("geometry"), "instance loss",
                        "classifies by cosine similarity")
  rule = Instance(gamma=gamma)
  return engine.embedding_loss(rule, embeddings, labels, **options)


# The registry's facts of this module's losses (circle_jax.losses.registry
# collects them).
REGISTRY = (
    entries.entry("instance", instance_loss, "pair", rule=Instance,
        paper="Zheng et al., \"Dual-Path Convolutional Image-Text "
              "Embeddings with Instance Loss\", ACM TOMM 2020",
        reduction="mean over anchors"),
)
