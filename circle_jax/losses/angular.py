r"""Angular loss (Wang et al., ICCV 2017), dense.

For a positive pair ``(a, p)`` of unit vectors and the anchor's negatives
``n``, with ``t = tan^2 alpha``:

.. math::

  \ell_{ap} = \log\Big(1 + \sum_{n \in N_a}
      e^{4t (x_a + x_p)^\top x_n - 2 (1 + t) x_a^\top x_p}\Big).

Not a rule: a pair's term sums over the anchor's negatives a product
``e^{4t s_an} e^{4t s_pn}`` that reads the *positive's* similarity to each
of the anchor's negatives. A rule's pair term is a function of its own
similarity ``s_ap`` and of per-anchor statistics (one per row, or, in a
two-stage rule, one per row and one per column), so it cannot hold
``sum_n e^{4t s_an} e^{4t s_pn}``, which is a second matrix product of the
exponentiated block with the candidates' own block. The loss takes the
rules' ``**options`` through :func:`circle_jax.losses.engine.dense_block`
(dense engine only) and computes that sum as one matmul
``E F^T`` with ``E_an = [n in N_a] e^{4t (s_an - m_a)}`` (``m_a`` the
anchor's largest negative similarity) and ``F_pn = e^{4t (s_pn - 1)}``:
memory ``O(M N + N^2)``, never the ``[M, N, N]`` tensor of every triple.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses import ranges
from circle_jax.losses.engine import reductions

Array = jax.Array

_NOT_A_RULE = ("a positive pair's term reads the positive's similarity to "
               "each of the anchor's negatives: see circle_jax.losses."
               "angular's docstring")
_HIGHEST = jax.lax.Precision.HIGHEST

# alpha in degrees. Above 72 degrees (tan^2 > 9.4) a term of E F^T can
# fall below float32's smallest normal number (e^{-8t} < e^{-75}).
ALPHA_RANGE = ranges.HyperRange(0.0, 72.0, False, True)


def _angular_terms(s, s_cols, pos, neg, alpha):
  """``[M, N]`` terms ``l_ap`` of the positive pairs (0 elsewhere)."""
  t = jnp.square(jnp.tan(jnp.deg2rad(jnp.asarray(alpha, jnp.float32))))
  k = 4.0 * t
  m = jax.lax.stop_gradient(
      jnp.max(jnp.where(neg, s, -jnp.inf), axis=1, keepdims=True))
  some = jnp.isfinite(m)
  m = jnp.where(some, m, 0.0)
  e = jnp.where(neg, jnp.exp(ops.nonpositive(k * (s - m))), 0.0)
  f = jnp.exp(k * (s_cols - 1.0))
  g = jnp.matmul(e, f.T, precision=_HIGHEST)  # [M, N]: sum over n
  has = pos & (g > 0)
  logit = (jnp.log(jnp.where(has, g, 1.0)) + k * (m + 1.0)
           - 2.0 * (1.0 + t) * s)
  return jnp.where(has, jax.nn.softplus(jnp.where(has, logit, 0.0)), 0.0)


@dataclasses.dataclass(frozen=True)
class Angular:
  """The angular loss's hyperparameter, its default (PML's) and documented
  range (which the registry reads): ``alpha`` in degrees."""

  alpha: float = 40.0

  ranges = types.MappingProxyType({"alpha": ALPHA_RANGE})


def angular_loss(
    embeddings: Array,
    labels: Array,
    *,
    alpha: float = Angular.alpha,
    **options,
) -> Array:
  r"""Angular loss (Wang et al., ICCV 2017), the N-pair form of eq. 8.

  .. math::

    L = \frac{1}{|P|} \sum_{(a,p) \in P} \log\Big(1 + \sum_{n \in N_a}
        \exp\big(4 \tan^2\alpha\, (x_a + x_p)^\top x_n
                 - 2 (1 + \tan^2\alpha)\, x_a^\top x_p\big)\Big),

  ``x`` the L2-normalised embeddings, ``P`` the ordered positive pairs and
  ``N_a`` the anchor's negatives.

  Reduction: mean over the ordered positive pairs (a pair whose anchor has
  no negative adds 0 and counts), as pytorch-metric-learning's
  ``AngularLoss`` with its default ``MeanReducer``; 0 with zero gradient
  without a positive pair. A ``reduction`` (docs/reductions.md) reduces the
  pair terms instead, PML's elements (``pos_pair``); ``"none"`` gives them
  as ``[B, N]``, a positive pair's term at (anchor, positive), 0 elsewhere.

  Differences from pytorch-metric-learning 2.9 (``AngularLoss(alpha)``,
  same name, unit and default). PML bug: it normalises the anchors and
  positives but multiplies their sum by the *raw* reference embeddings
  ``ref_emb`` (``torch.matmul(anchors + positives, ref_emb.unsqueeze(2))``),
  so its ``x_n`` are not unit vectors unless the inputs are; the paper
  normalises every feature, and so do we. On unit-norm inputs the values
  are equal and our gradient is PML's projected onto the sphere's tangent
  space (tested to float32 rounding; the loop reference of the paper's form
  is tested on any input). With a miner, PML takes the positive pairs from the mined
  tuples but every label-negative of the anchor in the sum; here
  ``neg_mask`` restricts ``N_a`` too. The paper's ``alpha`` is in degrees
  as PML's (its experiments use 36 to 55); ``alpha`` is in ``(0, 72]``:
  beyond, the float32 sum may underflow. The cosine geometry only (the loss
  is defined on unit vectors).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    alpha: the angle ``alpha`` in degrees, in ``(0, 72]``.
    **options: the pair losses' shared keywords (``axis_name``,
      ``pos_mask``, ``neg_mask``, ``ref``), documented once at
      :func:`circle_jax.losses.engine.embedding_loss`; dense engine only
      (``block_size`` and ``collective="ring"`` are refused).

  Returns:
    float32 scalar.

  References:
    Wang, Zhou, Wen, Liu, Lin, "Deep Metric Learning with Angular Loss",
    ICCV 2017.
  """
  ranges.check_range(alpha, "alpha", ALPHA_RANGE)
  engine.require_cosine(options.get("geometry"), "angular loss",
                        "is defined on unit vectors")
  reduction = engine.as_reduction(options.pop("reduction", None))
  rows, cols, s, pos, neg = engine.dense_block(
      embeddings, labels, loss="angular loss", reason=_NOT_A_RULE,
      **options)
  s_cols = jnp.matmul(cols.z, cols.z.T, precision=_HIGHEST)
  terms = _angular_terms(s, s_cols, pos, neg, alpha)
  if reduction is not None:
    return engine.reduce_pair_sets(((terms, pos),), reduction,
                                   labels=rows.labels,
                                   axis_name=options.get("axis_name"))
  count = jnp.sum(pos.astype(jnp.float32))
  return reductions.to_float32_scalar(reductions.ratio_of_sums(
      jnp.sum(terms), count, options.get("axis_name")))


REGISTRY = (
    entries.entry("angular", angular_loss, "pair", rule=Angular,
        tiled=False,
        paper="Wang et al., \"Deep Metric Learning with Angular Loss\", "
              "ICCV 2017",
        reduction="mean over ordered positive pairs",
        reduction_note="PML's `pos_pair` elements; the dense engine"),
)
