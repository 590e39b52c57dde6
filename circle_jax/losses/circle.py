"""Circle loss and the unified loss of pair similarity (Sun et al., CVPR 2020).

Both losses are rules on a similarity block ``[M, N]`` (:class:`Circle`,
:class:`Unified`, run by the dense and blockwise engines of
:mod:`circle_jax.losses.engine`), exposed as a square similarity-matrix form
(``*_from_similarity``, used by :func:`circle_jax.losses.pair_weights`) and as
thin embedding wrappers that build the cosine-similarity block, including the
global batch across devices (``axis_name``). The class-level variants compare
each sample with ``C`` class weight vectors instead of with the batch.

Reduction conventions:

* pair-wise forms (``circle_loss``, ``unified_loss`` and their
  ``_from_similarity`` forms): mean over the anchors that have at least one
  positive and one negative; anchors without either contribute nothing, and a
  batch without any valid anchor gives 0 with zero gradient;
* class-level forms: mean over all samples of the batch.

References:
  Sun, Cheng, Zhang, Zhang, Zheng, Wang, Wei. "Circle Loss: A Unified
  Perspective of Pair Similarity Optimization". CVPR 2020.
  https://arxiv.org/abs/2002.10857
"""

from __future__ import annotations

import types

from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax.losses import entries
from circle_jax.losses import ranges
from circle_jax.losses import engine

Array = jax.Array


# ----------------------------------------------------------------------------
# Rules (run by circle_jax.losses.engine).
# ----------------------------------------------------------------------------


def _softplus_of_sum(lse_p, lse_n):
  """``log(1 + sum_n exp(logit_n) * sum_p exp(logit_p))`` from the two
  logsumexps: ``softplus(lse_p + lse_n)``, finite for any scale. An anchor
  with an empty set (``lse = -inf``) gives 0 with a zero gradient."""
  valid = engine.both_sets_nonempty(lse_p, lse_n)
  x = jnp.where(valid, lse_p + lse_n, 0.0)
  return jnp.where(valid, jax.nn.softplus(x), 0.0), valid


@engine.rule_dataclass
class Circle(engine.PairRule):
  """Circle loss rule (eq. 6 with ``O_p = 1 + m``, ``O_n = -m``,
  ``Delta_p = 1 - m``, ``Delta_n = m``); its fields are the pair-wise forms'
  defaults.

  Attributes:
    margin: relaxation ``m``, in [-1, 1].
    gamma: scale ``gamma``, in [1e-6, 1e4].
  """

  margin: float = 0.4
  gamma: float = 80.0

  ranges = types.MappingProxyType({
      "margin": ranges.SIMILARITY_MARGIN_RANGE,
      "gamma": ranges.SCALE_RANGE})

  def logits(self, s):
    # The weights alpha are constants in backprop (the paper scales the
    # gradient by them; it does not differentiate them).
    alpha_p = jax.lax.stop_gradient(jax.nn.relu(1.0 + self.margin - s))
    alpha_n = jax.lax.stop_gradient(jax.nn.relu(s + self.margin))
    logit_p = -self.gamma * alpha_p * (s - (1.0 - self.margin))
    logit_n = self.gamma * alpha_n * (s - self.margin)
    return logit_p, logit_n

  def combine(self, lse_p, lse_n):
    return _softplus_of_sum(lse_p, lse_n)


@engine.rule_dataclass
class Unified(engine.PairRule):
  """Unified loss rule (eq. 1): ``softplus(LSE_N gamma (s_n + m) + LSE_P
  -gamma s_p)``; its fields are the pair-wise forms' defaults.

  Attributes:
    gamma: scale ``gamma``, in [1e-6, 1e4].
    margin: margin ``m``, in [-1, 1].
  """

  gamma: float = 80.0
  margin: float = 0.4

  ranges = Circle.ranges

  def logits(self, s):
    return -self.gamma * s, self.gamma * (s + self.margin)

  def combine(self, lse_p, lse_n):
    return _softplus_of_sum(lse_p, lse_n)


# Class-level defaults (face recognition settings of the paper).
_CIRCLE_CLASS_LEVEL = Circle(margin=0.25, gamma=256.0)
_UNIFIED_CLASS_LEVEL = Unified(gamma=64.0, margin=0.35)


# ----------------------------------------------------------------------------
# Circle loss.
# ----------------------------------------------------------------------------


def circle_loss_from_similarity(similarity: Array, labels: Array, *,
                                margin: float = Circle.margin,
                                gamma: float = Circle.gamma,
                                pos_mask: Optional[Array] = None,
                                neg_mask: Optional[Array] = None) -> Array:
  r"""Pair-wise Circle loss of a square similarity matrix.

  Row ``i`` is an anchor; its positives ``P_i`` are the other samples with its
  label and its negatives ``N_i`` the samples with another label (intersected
  with ``pos_mask`` / ``neg_mask``). With the paper's eq. (6) and the settings
  ``O_p = 1 + m``, ``O_n = -m``, ``Delta_p = 1 - m``, ``Delta_n = m``:

  .. math::

    \alpha_p = [1 + m - s_p]_+, \qquad \alpha_n = [s_n + m]_+,

    \ell_i = \log\Big[1 + \sum_{j \in N_i} e^{\gamma \alpha_n^j (s_n^j - m)}
                        \sum_{k \in P_i} e^{-\gamma \alpha_p^k (s_p^k - 1 + m)}
                 \Big]
           = \operatorname{softplus}\big(\mathrm{LSE}_{N_i} + \mathrm{LSE}_{P_i}\big),

  and ``L`` is the mean of ``l_i`` over the anchors with ``P_i`` and ``N_i``
  both non-empty (0 when there is none). The weights ``alpha`` are constants
  in backprop, as in the paper's gradients (eqs. 9-10), so ``dL/ds`` is *not*
  the derivative of the value with respect to the ``s`` inside ``alpha``.

  Args:
    similarity: ``[B, B]`` float similarity matrix (cast to float32). It need
      not be symmetric: row ``i`` holds anchor ``i``'s similarities.
    labels: ``[B]`` integer labels.
    margin: relaxation ``m``, in [-1, 1] (paper: 0.25 for face recognition,
      0.4 for fine-grained retrieval).
    gamma: scale ``gamma``, in [1e-6, 1e4].
    pos_mask: optional ``[B, B]`` bool mask of usable positive pairs (miner).
    neg_mask: optional ``[B, B]`` bool mask of usable negative pairs (miner).

  Returns:
    float32 scalar: the mean Circle loss over valid anchors.

  References:
    Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity
    Optimization", CVPR 2020, eqs. (6), (9), (10).
  """
  rule = Circle(margin=margin, gamma=gamma)
  return engine.matrix_loss(rule, similarity, labels, pos_mask=pos_mask,
                            neg_mask=neg_mask)


def circle_loss(embeddings: Array, labels: Array, *,
                margin: float = Circle.margin, gamma: float = Circle.gamma,
                **options) -> Array:
  r"""Pair-wise Circle loss of a batch of embeddings.

  The embeddings are L2-normalised (zero vectors stay zero) and compared by
  cosine similarity; see :func:`circle_loss_from_similarity` for the math:

  .. math::

    \ell_i = \operatorname{softplus}\Big(
        \mathrm{LSE}_{j \in N_i}\, \gamma \alpha_n^j (s_n^j - m)
      + \mathrm{LSE}_{k \in P_i}\, -\gamma \alpha_p^k (s_p^k - 1 + m) \Big),
    \quad L = \operatorname{mean}_{i:\,P_i \neq \emptyset \neq N_i} \ell_i.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 embeddings (computed in
      float32).
    labels: ``[B]`` integer labels.
    margin: relaxation ``m``, in [-1, 1].
    gamma: scale ``gamma``, in [1e-6, 1e4].
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar: the mean over anchors that have at least one positive and
    one negative (0, with zero gradient, when there is none).

  References:
    Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity
    Optimization", CVPR 2020, eq. (6).
  """
  rule = Circle(margin=margin, gamma=gamma)
  return engine.embedding_loss(rule, embeddings, labels, **options)


def circle_loss_class_level(embeddings: Array, labels: Array,
                            class_weights: Array, *,
                            margin: float = _CIRCLE_CLASS_LEVEL.margin,
                            gamma: float = _CIRCLE_CLASS_LEVEL.gamma) -> Array:
  r"""Circle loss with class-level labels (face recognition / re-ID form).

  Each sample has one positive similarity ``s_p = cos(x, W_y)`` to its own
  class weight and ``C - 1`` negative similarities ``s_n^j = cos(x, W_j)``:

  .. math::

    \ell = \log\Big[1 + e^{-\gamma \alpha_p (s_p - 1 + m)}
                     \sum_{j \neq y} e^{\gamma \alpha_n^j (s_n^j - m)}\Big],
    \quad \alpha_p = [1 + m - s_p]_+,\ \alpha_n^j = [s_n^j + m]_+

  (``alpha`` constant in backprop), averaged over the samples.

  Labels are not range-checked (impossible under ``jit``): a sample whose
  label is outside ``[0, C)`` has no positive and contributes 0. Validate
  labels on the host (``circle_jax.losses.validate_labels``).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 embeddings.
    labels: ``[B]`` integer class ids in ``[0, C)``.
    class_weights: ``[C, D]`` float class weight vectors (L2-normalised
      inside).
    margin: relaxation ``m``, in [-1, 1] (paper: 0.25).
    gamma: scale ``gamma``, in [1e-6, 1e4] (paper: 256).

  Returns:
    float32 scalar: the mean loss over the ``B`` samples.

  References:
    Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity
    Optimization", CVPR 2020, eq. (6) with class-level labels.
  """
  rule = Circle(margin=margin, gamma=gamma)
  return engine.class_level_loss(rule, embeddings, labels, class_weights)


# ----------------------------------------------------------------------------
# Unified loss.
# ----------------------------------------------------------------------------


def unified_loss_from_similarity(similarity: Array, labels: Array, *,
                                 gamma: float = Unified.gamma,
                                 margin: float = Unified.margin,
                                 pos_mask: Optional[Array] = None,
                                 neg_mask: Optional[Array] = None) -> Array:
  r"""Unified loss of pair similarity (eq. 1) of a square similarity matrix.

  .. math::

    \ell_i = \log\Big[1 + \sum_{j \in N_i} \sum_{k \in P_i}
                      e^{\gamma (s_n^j - s_p^k + m)}\Big]
           = \operatorname{softplus}\big(
               \mathrm{LSE}_{N_i}\, \gamma (s_n + m)
             + \mathrm{LSE}_{P_i}\, (-\gamma s_p)\big),

  averaged over anchors with ``P_i`` and ``N_i`` both non-empty. As
  ``gamma -> inf``, ``l_i / gamma`` tends to the hard-mined triplet loss
  ``[max_j s_n^j - min_k s_p^k + m]_+`` (eq. 3).

  Args:
    similarity: ``[B, B]`` float similarity matrix (row ``i``: anchor ``i``).
    labels: ``[B]`` integer labels.
    gamma: scale ``gamma``, in [1e-6, 1e4].
    margin: margin ``m``, in [-1, 1].
    pos_mask: optional ``[B, B]`` bool mask of usable positive pairs.
    neg_mask: optional ``[B, B]`` bool mask of usable negative pairs.

  Returns:
    float32 scalar: the mean over valid anchors (0 when there is none).

  References:
    Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity
    Optimization", CVPR 2020, eqs. (1) and (3).
  """
  rule = Unified(gamma=gamma, margin=margin)
  return engine.matrix_loss(rule, similarity, labels, pos_mask=pos_mask,
                            neg_mask=neg_mask)


def unified_loss(embeddings: Array, labels: Array, *,
                 gamma: float = Unified.gamma, margin: float = Unified.margin,
                 **options) -> Array:
  r"""Unified loss of pair similarity (eq. 1) with pair-wise labels.

  Cosine similarities of the L2-normalised embeddings; per anchor

  .. math::

    \ell_i = \log\Big[1 + \sum_{j \in N_i} e^{\gamma (s_n^j + m)}
                          \sum_{k \in P_i} e^{-\gamma s_p^k}\Big],

  averaged over the anchors with at least one positive and one negative.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 embeddings.
    labels: ``[B]`` integer labels.
    gamma: scale ``gamma``, in [1e-6, 1e4].
    margin: margin ``m``, in [-1, 1].
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar: the mean over valid anchors (0 when there is none).

  References:
    Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity
    Optimization", CVPR 2020, eq. (1).
  """
  rule = Unified(gamma=gamma, margin=margin)
  return engine.embedding_loss(rule, embeddings, labels, **options)


def unified_loss_class_level(
    embeddings: Array, labels: Array, class_weights: Array, *,
    gamma: float = _UNIFIED_CLASS_LEVEL.gamma,
    margin: float = _UNIFIED_CLASS_LEVEL.margin) -> Array:
  r"""Unified loss (eq. 1) with class-level labels: AM-Softmax (eq. 2).

  With one positive ``s_p = cos(x, W_y)`` and ``C - 1`` negatives
  ``s_n^j = cos(x, W_j)``:

  .. math::

    \ell = \log\Big[1 + \sum_{j \neq y} e^{\gamma (s_n^j - s_p + m)}\Big]
         = -\log \frac{e^{\gamma (s_p - m)}}
                      {e^{\gamma (s_p - m)} + \sum_{j \neq y} e^{\gamma s_n^j}},

  i.e. the AM-Softmax / CosFace cross-entropy with scale ``gamma`` and
  additive margin ``m``, averaged over the samples. Out-of-range labels
  contribute 0 (see :func:`circle_loss_class_level`).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 embeddings.
    labels: ``[B]`` integer class ids in ``[0, C)``.
    class_weights: ``[C, D]`` float class weight vectors (L2-normalised
      inside).
    gamma: scale ``gamma``, in [1e-6, 1e4].
    margin: additive cosine margin ``m``.

  Returns:
    float32 scalar: the mean loss over the ``B`` samples.

  References:
    Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity
    Optimization", CVPR 2020, eqs. (1)-(2). Wang et al., "Additive Margin
    Softmax for Face Verification", IEEE SPL 2018.
  """
  rule = Unified(gamma=gamma, margin=margin)
  return engine.class_level_loss(rule, embeddings, labels, class_weights)


_CIRCLE_PAPER = ("Sun et al., \"Circle Loss: A Unified Perspective of Pair "
                 "Similarity Optimization\", CVPR 2020")
_BOTH_SETS = "mean over anchors with >= 1 positive and >= 1 negative"

REGISTRY = (
    entries.entry("circle", circle_loss, "pair", rule=Circle,
        paper=_CIRCLE_PAPER + " (eq. 6)", reduction=_BOTH_SETS),
    entries.entry("unified", unified_loss, "pair", rule=Unified,
        paper=_CIRCLE_PAPER + " (eq. 1)", reduction=_BOTH_SETS),
    entries.entry("circle_class_level", circle_loss_class_level,
        "classifier", param_name="class_weights",
        init=entries.normal(0.01), param_init="normal, std 0.01",
        rule=Circle,
        paper="Sun et al., CVPR 2020 (class-level labels)",
        reduction="mean over samples"),
)
