"""Proxy-Anchor loss (Kim et al., CVPR 2020) and Ranked Proxy-Anchor loss.

Both losses use one learnable proxy per class and treat *each proxy as an
anchor* over the batch: a proxy is pulled towards the samples of its class
and pushed away from the others, so every sample interacts with every proxy
and the per-proxy sums run over the whole (global) batch.

Each loss is a function of the ``[B, C]`` sample-to-proxy block (similarity
for Proxy-Anchor, distance for Ranked Proxy-Anchor), exposed as
``proxy_anchor_loss_from_similarity`` / ``ranked_proxy_anchor_loss_from_distance``,
with a thin wrapper that normalises embeddings and proxies and builds it.

Labels: a sample whose label is outside ``[0, C)`` is neither a positive nor a
negative of any proxy, so it is ignored. Out-of-range labels cannot raise an
error under ``jit`` (the values are not known at trace time): check them on
the host with :func:`circle_jax.losses.validate_labels` in the data pipeline.

``axis_name``: inside ``jax.shard_map`` / ``jax.pmap`` the per-proxy sums and
counts are taken over the global batch (``psum``-reduced ``[C]`` statistics;
embeddings are not gathered), the value is the global-batch loss on every
device, and the gradient w.r.t. the local embeddings is exact. The gradient
w.r.t. replicated proxies is exact under ``shard_map`` (JAX sums it over the
devices); under ``pmap`` each device gets its own part and the data-parallel
step must ``psum`` (not ``pmean``) it.

References:
  Kim, Kim, Cho, Kwak. "Proxy Anchor Loss for Deep Metric Learning".
  CVPR 2020. https://arxiv.org/abs/2003.13911
  Wang, Hua, Kodirov, Robertson. "Ranked List Loss for Deep Metric
  Learning". CVPR 2019 / TPAMI 2021 (the boundaries and weights of RPAL).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import entries
from circle_jax.losses import class_shard
from circle_jax.losses import ranges
from circle_jax.losses import checks
from circle_jax.losses.engine import reductions
from circle_jax.losses import ranked_list as _ranked_list

Array = jax.Array

_DISTANCES = ("euclidean", "cosine")


@dataclasses.dataclass(frozen=True)
class ProxyAnchor:
  """Proxy-Anchor's hyperparameters, the defaults of both its forms (the
  paper's): the margin ``delta`` and the scale ``alpha``."""

  margin: float = 0.1
  alpha: float = 32.0


@dataclasses.dataclass(frozen=True)
class RankedProxyAnchor:
  """Ranked Proxy-Anchor's hyperparameters, the defaults of both its forms:
  RLL's negative boundary ``alpha``, gap ``m`` and temperature ``T_n``."""

  alpha: float = 1.4
  margin: float = 0.4
  t_neg: float = 20.0


# ----------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------


def _check_sample_to_proxy(matrix, labels, name: str):
  """Checks a ``[B, C]`` sample-to-proxy block and its ``[B]`` labels."""
  matrix = checks.check_matrix(
      matrix, name, "[batch, num_classes]: samples against proxies")
  labels = checks.check_labels(labels, matrix.shape[0])
  return matrix, labels


def _proxy_masks(labels: Array, block: class_shard.ClassBlock):
  """``[B, R]`` masks: ``pos[b, r]`` iff ``labels[b]`` is row ``r``'s class;
  ``neg`` iff the label is another valid class and the row a real one.
  Out-of-range labels and padding rows are in neither."""
  pos = block.onehot(labels)
  valid = (labels >= 0) & (labels < block.num_classes)
  neg = valid[:, None] & block.real[None, :] & ~pos
  return pos, neg


def _psum_const(x: Array, axis_name) -> Array:
  """Global sum of a quantity that carries no gradient (counts, weights)."""
  x = jax.lax.stop_gradient(x)
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def _pmax_const(x: Array, axis_name) -> Array:
  x = jax.lax.stop_gradient(x)
  return x if axis_name is None else jax.lax.pmax(x, axis_name)


def _batch_log1p_sum_exp_two_sets(logit_p: Array, logit_n: Array, pos: Array,
                                  neg: Array, axis_name):
  """``log(1 + sum_b mask * exp(logit))`` over the (global) batch axis 0.

  For the positive and the negative samples of every proxy (column), each
  max-shifted with its global per-column maximum, with one ``exp`` per
  (sample, proxy) pair for both sets (:func:`ops.two_set_exp`); ``exp`` is
  never taken of an entry outside its set. An empty set gives 0 with a zero
  gradient. The per-device partial sums are combined with ``global_sum``,
  whose identity backward makes the gradient exact under ``shard_map`` and
  ``pmap``.

  Returns:
    ``(terms_p, terms_n)``, each ``[C]``.
  """
  def global_max(logits, mask):
    m = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=0, keepdims=True)
    return _pmax_const(m, axis_name)

  e, m_p, m_n = ops.two_set_exp(
      logit_p, logit_n, pos, neg,
      shift=(global_max(logit_p, pos), global_max(logit_n, neg)), axis=0)

  def term(mask, m):
    s = ops.maybe_global_sum(
        jnp.sum(jnp.where(mask, e, 0.0), axis=0, keepdims=True), axis_name)
    return jnp.logaddexp(0.0, ops.log_of_shifted_sum(s, m)[0])

  return term(pos, m_p), term(neg, m_n)


def _num_proxies_with_positives(pos: Array, block) -> Array:
  per_proxy = _psum_const(jnp.sum(pos.astype(jnp.float32), axis=0),
                          block.batch_axis)
  return block.class_count(jnp.sum((per_proxy > 0).astype(jnp.float32)))


# ----------------------------------------------------------------------------
# Proxy-Anchor.
# ----------------------------------------------------------------------------


def proxy_anchor_loss_from_similarity(similarity: Array, labels: Array, *,
                                      margin: float = ProxyAnchor.margin,
                                      alpha: float = ProxyAnchor.alpha,
                                      axis_name=None) -> Array:
  r"""Proxy-Anchor loss of a ``[B, C]`` sample-to-proxy similarity block.

  .. math::

    L = \frac{1}{|P^+|} \sum_{p \in P^+}
          \log\Big(1 + \sum_{x \in X_p^+} e^{-\alpha (s(x, p) - \delta)}\Big)
      + \frac{1}{C} \sum_{p=1}^{C}
          \log\Big(1 + \sum_{x \in X_p^-} e^{\alpha (s(x, p) + \delta)}\Big)

  :math:`X_p^+` are the batch samples of class :math:`p`, :math:`X_p^-` the
  samples of the other classes, :math:`P^+` the proxies with at least one
  positive in the batch and :math:`C` the number of classes (the official
  code's normalisation). Both inner sums are max-shifted log-sum-exps. A
  batch without positives for any proxy gives a positive term of 0 (the
  official code divides by zero there).

  Args:
    similarity: ``[B, C]`` float cosine similarities of samples to proxies.
    labels: ``[B]`` integer labels in ``[0, C)``; others are ignored (see
      the module docstring and :func:`circle_jax.losses.validate_labels`).
    margin: the margin :math:`\delta`.
    alpha: the scale :math:`\alpha`.
    axis_name: optional mapped axis; the block is this device's rows and the
      sums run over the global batch (see :func:`proxy_anchor_loss`).

  Returns:
    A float32 scalar.
  """
  hp = ProxyAnchor(margin=margin, alpha=alpha)
  similarity, labels = _check_sample_to_proxy(similarity, labels, "similarity")
  return _proxy_anchor(similarity, labels, hp,
                       class_shard.whole(similarity.shape[1], axis_name))


def _proxy_anchor(similarity, labels, hp: ProxyAnchor, block) -> Array:
  """Proxy-Anchor of a ``[B, R]`` block of rows laid out by ``block``."""
  ranges.check_range(hp.alpha, "alpha", ranges.POSITIVE_RANGE)
  pos, neg = _proxy_masks(labels, block)
  pos_terms, neg_terms = _batch_log1p_sum_exp_two_sets(
      -hp.alpha * (similarity - hp.margin),
      hp.alpha * (similarity + hp.margin), pos, neg,
      block.batch_axis)
  num_valid = _num_proxies_with_positives(pos, block)
  loss = (block.class_sum(jnp.sum(pos_terms)) / jnp.maximum(num_valid, 1.0)
          + block.class_sum(jnp.sum(neg_terms)) / block.num_classes)
  return reductions.to_float32_scalar(loss)


def proxy_anchor_loss(
    embeddings: Array, labels: Array, proxies: Array, *,
    margin: float = ProxyAnchor.margin, alpha: float = ProxyAnchor.alpha,
    axis_name=None, shard_classes: bool = class_shard.Layout.shard_classes,
    num_classes: Optional[int] = class_shard.Layout.num_classes) -> Array:
  r"""Proxy-Anchor loss: each class proxy is an anchor over the whole batch.

  With :math:`s(x, p)` the cosine similarity of a sample and a proxy,

  .. math::

    L = \frac{1}{|P^+|} \sum_{p \in P^+}
          \log\Big(1 + \sum_{x \in X_p^+} e^{-\alpha (s(x, p) - \delta)}\Big)
      + \frac{1}{C} \sum_{p=1}^{C}
          \log\Big(1 + \sum_{x \in X_p^-} e^{\alpha (s(x, p) + \delta)}\Big)

  where :math:`P^+` is the set of proxies with at least one positive sample
  in the (global) batch and :math:`C` the number of proxies (the official
  code's normalisation of the negative term). The log-sum-exps are
  max-shifted, so ``alpha = 32`` is safe in float32 and bfloat16.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 embeddings (normalised inside).
    labels: ``[B]`` integer labels in ``[0, C)``. Out-of-range labels cannot
      be detected under ``jit``; such samples are ignored. Validate labels on
      the host with :func:`circle_jax.losses.validate_labels`.
    proxies: ``[C, D]`` float proxies, one per class (normalised inside).
    margin: the margin :math:`\delta` (paper: 0.1).
    alpha: the scale :math:`\alpha` (paper: 32).
    axis_name: optional mapped axis (``jax.shard_map`` / ``jax.pmap``) over
      which the batch is split. The per-proxy sums and the count
      :math:`|P^+|` are global; the value is the global-batch loss on every
      device and the gradient w.r.t. the local embeddings is exact. Proxy
      gradients: exact under ``shard_map`` with replicated proxies; under
      ``pmap`` ``psum`` them over the axis.
    shard_classes: the proxies are sharded over ``axis_name``: pass this
      device's ``[ceil(C / n), D]`` rows; each device runs its proxies' sums
      over the gathered global batch (:mod:`circle_jax.losses.class_shard`).
    num_classes: ``C`` with ``shard_classes`` (the rows beyond are padding).

  Returns:
    A float32 scalar.

  References:
    Kim et al., "Proxy Anchor Loss for Deep Metric Learning", CVPR 2020,
    https://arxiv.org/abs/2003.13911
  """
  # No negative-class sampling: every proxy is an anchor of its own term.
  layout = class_shard.Layout(shard_classes=shard_classes,
                              num_classes=num_classes)
  hp = ProxyAnchor(margin=margin, alpha=alpha)
  x, labels, p, block = class_shard.class_block(
      embeddings, labels, proxies, name="proxies", axis_name=axis_name,
      layout=layout)
  return _proxy_anchor(ops.cosine_similarity(x, p), labels, hp, block)


# ----------------------------------------------------------------------------
# Ranked Proxy-Anchor.
# ----------------------------------------------------------------------------


def ranked_proxy_anchor_loss_from_distance(
    distance: Array, labels: Array, *, alpha: float = RankedProxyAnchor.alpha,
    margin: float = RankedProxyAnchor.margin,
    t_neg: float = RankedProxyAnchor.t_neg, axis_name=None) -> Array:
  r"""Ranked Proxy-Anchor loss of a ``[B, C]`` sample-to-proxy distance block.

  .. math::

    L = \frac{1}{|P^+|} \sum_{p \in P^+} \frac{1}{|X_p^{+*}|}
          \sum_{x \in X_p^{+*}} \big(d(x, p) - (\alpha - m)\big)
      + \frac{1}{C} \sum_{p=1}^{C} \sum_{x \in X_p^{-*}}
          \frac{w_{xp}}{\sum_{x' \in X_p^{-*}} w_{x'p}} \big(\alpha - d(x, p)\big)

  with :math:`w_{xp} = e^{T_n (\alpha - d(x, p))}` (normalised
  overflow-safely, constants in backpropagation as in RLL), the non-trivial
  positives :math:`X_p^{+*} = \{x \in X_p^+: d(x, p) > \alpha - m\}`, the
  non-trivial negatives :math:`X_p^{-*} = \{x \in X_p^-: d(x, p) < \alpha\}`,
  :math:`P^+` the proxies with at least one positive in the batch and
  :math:`C` the number of proxies. Empty sets contribute 0.

  Args:
    distance: ``[B, C]`` float distances of samples to proxies.
    labels: ``[B]`` integer labels in ``[0, C)``; others are ignored.
    alpha: the negative boundary :math:`\alpha`, in (0, 2].
    margin: the gap :math:`m`, in [0, 2]; positives are pulled within
      :math:`\alpha - m`.
    t_neg: temperature :math:`T_n` of the negative weighting, in [0, 1e4]
      (0: plain mean).
    axis_name: optional mapped axis; the block is this device's rows and the
      per-proxy sums run over the global batch.

  Returns:
    A float32 scalar.
  """
  hp = RankedProxyAnchor(alpha=alpha, margin=margin, t_neg=t_neg)
  # RLL's boundaries, hinges and non-trivial sets, with proxies as anchors
  # (the rule's range checks included).
  distance, labels = _check_sample_to_proxy(distance, labels, "distance")
  return _ranked_proxy_anchor(
      distance, labels, hp, class_shard.whole(distance.shape[1], axis_name))


def _ranked_proxy_anchor(distance, labels, hp: RankedProxyAnchor,
                         block) -> Array:
  """Ranked Proxy-Anchor of a ``[B, R]`` block laid out by ``block``."""
  rule = _ranked_list.RankedList(alpha=hp.alpha, margin=hp.margin,
                                 t_neg=hp.t_neg, on_distance=True)
  axis_name = block.batch_axis
  pos, neg = _proxy_masks(labels, block)
  pos_hinge, neg_hinge = rule.hinges(distance)
  pos_set, neg_set = rule.select(distance, pos, neg, ())

  # Positive term: per proxy, the plain mean over its non-trivial positives.
  pos_sum = ops.maybe_global_sum(
      jnp.sum(jnp.where(pos_set, pos_hinge, 0.0), axis=0), axis_name)
  pos_count = _psum_const(jnp.sum(pos_set.astype(jnp.float32), axis=0),
                          axis_name)
  pos_per_proxy = pos_sum / jnp.maximum(pos_count, 1.0)
  num_valid = _num_proxies_with_positives(pos, block)
  pos_term = (block.class_sum(jnp.sum(pos_per_proxy))
              / jnp.maximum(num_valid, 1.0))

  # Negative term: per proxy, the exp(T_n (alpha - d))-weighted mean over its
  # non-trivial negatives, max-shifted with the global per-proxy maximum.
  _, logits = rule.logits(distance)
  m = _pmax_const(jnp.max(jnp.where(neg_set, logits, -jnp.inf), axis=0),
                  axis_name)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jax.lax.stop_gradient(jnp.exp(jnp.where(neg_set, logits - m, -jnp.inf)))
  w_sum = _psum_const(jnp.sum(w, axis=0), axis_name)  # 0 only when empty
  neg_num = ops.maybe_global_sum(
      jnp.sum(jnp.where(neg_set, w * neg_hinge, 0.0), axis=0), axis_name)
  neg_per_proxy = neg_num / jnp.where(w_sum == 0, 1.0, w_sum)
  neg_term = block.class_sum(jnp.sum(neg_per_proxy)) / block.num_classes
  return reductions.to_float32_scalar(pos_term + neg_term)


def ranked_proxy_anchor_loss(
    embeddings: Array, labels: Array, proxies: Array, *,
    alpha: float = RankedProxyAnchor.alpha,
    margin: float = RankedProxyAnchor.margin,
    t_neg: float = RankedProxyAnchor.t_neg, distance: str = "euclidean",
    axis_name=None, shard_classes: bool = class_shard.Layout.shard_classes,
    num_classes: Optional[int] = class_shard.Layout.num_classes) -> Array:
  r"""Ranked Proxy-Anchor loss (RPAL): RLL's boundaries with proxies as anchors.

  Each proxy is an anchor over the batch. Its positives farther than
  :math:`\alpha - m` contribute the mean of :math:`d - (\alpha - m)`; this
  positive term is averaged over the proxies that have positives in the
  batch. Its negatives closer than :math:`\alpha` contribute the
  :math:`e^{T_n (\alpha - d)}`-weighted mean of :math:`\alpha - d`; this
  negative term is summed over all proxies and divided by the number of
  classes :math:`C`:

  .. math::

    L = \frac{1}{|P^+|} \sum_{p \in P^+}
          \operatorname{mean}_{x \in X_p^{+*}} \big(d(x, p) - (\alpha - m)\big)
      + \frac{1}{C} \sum_{p} \operatorname{wmean}_{x \in X_p^{-*}}
          \big(\alpha - d(x, p)\big)

  Reconstruction note: the equations of the Ranked Proxy-Anchor paper (Zhang
  Bing, Chen Haiyan, Hou Xiaye, Yuan Ligang, Liu Zhenya, Nanjing University
  of Aeronautics and Astronautics; in Chinese) are images missing from the
  text available to us, so the formula above is our reconstruction from the
  paper's prose and from the two losses it combines, Ranked List (Wang et al.,
  CVPR 2019) and Proxy-Anchor (Kim et al., CVPR 2020): Proxy-Anchor's structure (proxies as
  anchors, positive term over proxies with positives, negative term over all
  ``C`` proxies) combined with Ranked List Loss's non-trivial sets, hinge
  terms and loss-based negative weighting (weights normalised per proxy,
  max-shifted, constant in backpropagation as in RLL). The positive mean is
  over the *non-trivial* positives, as in RLL; there is no ``imbalance``
  factor (the two terms are added as in Proxy-Anchor).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 embeddings (normalised inside).
    labels: ``[B]`` integer labels in ``[0, C)``. Out-of-range labels cannot
      be detected under ``jit``; such samples are ignored. Validate them on
      the host with :func:`circle_jax.losses.validate_labels`.
    proxies: ``[C, D]`` float proxies (normalised inside).
    alpha: the negative boundary :math:`\alpha`, in (0, 2].
    margin: the gap :math:`m` (positive boundary :math:`\alpha - m`), in
      [0, 2].
    t_neg: temperature :math:`T_n` of the negative weighting, in [0, 1e4].
    distance: ``"euclidean"`` (default), :math:`\|\hat x - \hat p\| = \sqrt{2 -
      2\cos}` between normalised vectors, as in RLL; or ``"cosine"``,
      :math:`1 - \cos` (the RPAL paper's wording). The defaults ``alpha = 1.4``,
      ``margin = 0.4`` are on the Euclidean scale ``[0, 2]``; both distances
      share that range.
    axis_name: optional mapped axis over which the batch is split; the
      per-proxy sums, counts and weight normalisers are global, the value is
      the global-batch loss on every device and the gradient w.r.t. the local
      embeddings is exact (proxy gradients: as in :func:`proxy_anchor_loss`).
    shard_classes, num_classes: the proxies sharded over ``axis_name``, as
      in :func:`proxy_anchor_loss`.

  Returns:
    A float32 scalar.

  References:
    Zhang Bing, Chen Haiyan, Hou Xiaye, Yuan Ligang, Liu Zhenya (Nanjing
    University of Aeronautics and Astronautics), the Ranked Proxy-Anchor
    loss, Chinese-language journal paper (equations reconstructed here).
    Kim, Kim, Cho, Kwak, "Proxy Anchor Loss for Deep Metric Learning", CVPR
    2020.
    Wang, Hua, Kodirov, Hu, Garnier, Robertson, "Ranked List Loss for Deep
    Metric Learning", CVPR 2019.
  """
  # No negative-class sampling: every proxy is an anchor of its own term.
  layout = class_shard.Layout(shard_classes=shard_classes,
                              num_classes=num_classes)
  hp = RankedProxyAnchor(alpha=alpha, margin=margin, t_neg=t_neg)
  if distance not in _DISTANCES:
    raise ValueError(
        f"`distance` must be one of {_DISTANCES}; got {distance!r}.")
  x, labels, p, block = class_shard.class_block(
      embeddings, labels, proxies, name="proxies", axis_name=axis_name,
      layout=layout)
  similarity = ops.cosine_similarity(x, p)
  if distance == "euclidean":
    dist = ops.euclidean_from_cosine(similarity)
  else:
    dist = 1.0 - similarity
  return _ranked_proxy_anchor(dist, labels, hp, block)


_PROXY_ANCHOR_PAPER = (
    "Kim, Kim, Cho, Kwak, \"Proxy Anchor Loss for Deep Metric Learning\", "
    "CVPR 2020")

REGISTRY = (
    entries.entry("proxy_anchor", proxy_anchor_loss, "proxy",
        param_name="proxies", init=entries.kaiming_normal_fan_out,
        param_init="kaiming normal, fan_out (std sqrt(2/C))",
        paper=_PROXY_ANCHOR_PAPER,
        reduction="positive term / #proxies with positives + negative "
                  "term / #classes"),
    entries.entry("ranked_proxy_anchor", ranked_proxy_anchor_loss,
        "proxy", param_name="proxies", init=entries.kaiming_normal_fan_out,
        rule=_ranked_list.RankedList,
        param_init="kaiming normal, fan_out (std sqrt(2/C))",
        paper="Zhang, Chen, Hou, Yuan, Liu (Nanjing University of "
              "Aeronautics and Astronautics), Ranked Proxy-Anchor loss "
              "(Chinese-language journal paper; equations reconstructed "
              "from its prose, Ranked List and Proxy-Anchor), built on " +
              _PROXY_ANCHOR_PAPER,
        reduction="positive term / #proxies with positives + negative "
                  "term / #classes"),
)
