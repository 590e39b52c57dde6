"""Classification losses: softmax, NormFace, CosFace (AM-Softmax), ArcFace.

All take ``(embeddings [B, D], labels [B], class_weights [C, D])`` and return
the mean cross-entropy over the batch, computed as a max-shifted log-softmax
in float32. NormFace, CosFace and ArcFace normalise embeddings and class
weights (cosine logits times ``scale``); the plain softmax loss uses raw inner
products. ``labels`` must lie in ``[0, C)`` (out-of-range labels cannot be
detected at trace time; see ``validate_labels``).

With ``axis_name`` the per-sample terms are summed globally and divided by the
global batch size (no gather): the same value on every device, exact
gradients for the local embeddings; the replicated ``class_weights`` get the
full gradient inside ``jax.shard_map`` and a per-device share under
``jax.pmap`` (``psum`` them, as for any replicated parameter).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import ranges
from circle_jax.losses import _common

Array = jax.Array


def _inputs(embeddings, labels, class_weights):
  embeddings = _common.check_embeddings(embeddings)
  labels = _common.check_labels(labels, embeddings.shape[0])
  class_weights = _common.check_class_vectors(
      class_weights, embeddings.shape[1], "class_weights")
  return embeddings, labels, class_weights


def _cross_entropy(logits, onehot, axis_name):
  per_sample = (jax.nn.logsumexp(logits, axis=1)
                - jnp.sum(jnp.where(onehot, logits, 0.0), axis=1))
  return _common.sum_over_batch(per_sample, axis_name)


def softmax_loss(
    embeddings: Array,
    labels: Array,
    class_weights: Array,
    *,
    bias: Optional[Array] = None,
    axis_name: Optional[str] = None,
) -> Array:
  r"""Softmax cross-entropy on a linear classifier of the raw embeddings.

  .. math::

    L = \frac{1}{B} \sum_i -\log
        \frac{e^{W_{y_i} \cdot x_i + b_{y_i}}}{\sum_c e^{W_c \cdot x_i + b_c}} .

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (not normalised).
    labels: ``[B]`` integer labels in ``[0, C)``.
    class_weights: ``[C, D]`` classifier weights ``W``.
    bias: optional ``[C]`` bias ``b`` (default none).
    axis_name: global-batch mean across devices (module docstring).

  Returns:
    float32 scalar: the mean over the (global) batch.
  """
  x, labels, w = _inputs(embeddings, labels, class_weights)
  logits = jnp.matmul(x, w.T, precision=jax.lax.Precision.HIGHEST)
  if bias is not None:
    bias = _common.check_shape(
        bias, (w.shape[0],), f"`bias` must have shape [num_classes] = "
        f"({w.shape[0]},); got {jnp.shape(bias)}.")
    logits = logits + bias.astype(jnp.float32)
  onehot = jax.nn.one_hot(labels, w.shape[0], dtype=bool)
  return _cross_entropy(logits, onehot, axis_name)


def cosface_loss(
    embeddings: Array,
    labels: Array,
    class_weights: Array,
    *,
    margin: float = 0.35,
    scale: float = 64.0,
    axis_name: Optional[str] = None,
) -> Array:
  r"""CosFace / AM-Softmax: additive cosine margin (Wang et al. 2018).

  With ``cos_c = \hat x \cdot \hat W_c``:

  .. math::

    L = \frac{1}{B} \sum_i -\log
        \frac{e^{s (\cos_{y_i} - m)}}
             {e^{s (\cos_{y_i} - m)} + \sum_{c \ne y_i} e^{s \cos_c}} .

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (normalised inside).
    labels: ``[B]`` integer labels in ``[0, C)``.
    class_weights: ``[C, D]`` (normalised inside).
    margin: ``m``.
    scale: ``s``.
    axis_name: global-batch mean across devices (module docstring).

  Returns:
    float32 scalar: the mean over the (global) batch.

  References:
    Wang et al., "CosFace: Large Margin Cosine Loss for Deep Face
    Recognition", CVPR 2018, eq. 4. Wang, Cheng, Liu, Liu, "Additive Margin
    Softmax for Face Verification", IEEE SPL 2018.
  """
  ranges.check_range(scale, "scale", ranges.POSITIVE_RANGE)
  x, labels, w = _inputs(embeddings, labels, class_weights)
  cos = ops.cosine_similarity(x, w)
  onehot = jax.nn.one_hot(labels, w.shape[0], dtype=bool)
  logits = scale * jnp.where(onehot, cos - margin, cos)
  return _cross_entropy(logits, onehot, axis_name)


def normface_loss(
    embeddings: Array,
    labels: Array,
    class_weights: Array,
    *,
    scale: float = 20.0,
    axis_name: Optional[str] = None,
) -> Array:
  r"""NormFace: softmax on scaled cosines (Wang et al. 2017).

  .. math::

    L = \frac{1}{B} \sum_i -\log
        \frac{e^{s \cos_{y_i}}}{\sum_c e^{s \cos_c}},
    \qquad \cos_c = \hat x \cdot \hat W_c ,

  i.e. :func:`cosface_loss` with ``margin=0``. The paper learns ``s`` (and
  shows it must be large enough for the loss to be able to go low); here it
  is a fixed hyperparameter, 20 by default: temperature 0.05 of the
  normalised-softmax baseline of Zhai & Wu (2019) for metric learning.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (normalised inside).
    labels: ``[B]`` integer labels in ``[0, C)``.
    class_weights: ``[C, D]`` (normalised inside).
    scale: ``s``.
    axis_name: global-batch mean across devices (module docstring).

  Returns:
    float32 scalar: the mean over the (global) batch.

  References:
    Wang, Xiang, Cheng, Yuille, "NormFace: L2 Hypersphere Embedding for Face
    Verification", ACM MM 2017, eq. 5. Zhai, Wu, "Classification is a Strong
    Baseline for Deep Metric Learning", BMVC 2019.
  """
  return cosface_loss(embeddings, labels, class_weights, margin=0.0,
                      scale=scale, axis_name=axis_name)


def arcface_loss(
    embeddings: Array,
    labels: Array,
    class_weights: Array,
    *,
    margin: float = 0.5,
    scale: float = 64.0,
    easy_margin: bool = False,
    axis_name: Optional[str] = None,
) -> Array:
  r"""ArcFace: additive angular margin (Deng et al. 2019).

  With ``\theta_c = \arccos(\hat x \cdot \hat W_c)`` the target logit is
  ``s \cos(\theta_y + m)``, computed as
  ``\cos\theta \cos m - \sin\theta \sin m`` with
  ``\sin\theta = \sqrt{1 - \cos^2\theta}`` (zero gradient at
  ``|\cos\theta| = 1``):

  .. math::

    L = \frac{1}{B} \sum_i -\log
        \frac{e^{s\,\phi(\theta_{y_i})}}
             {e^{s\,\phi(\theta_{y_i})} + \sum_{c \ne y_i} e^{s \cos\theta_c}} .

  ``phi(theta) = cos(theta + m)`` while ``theta + m <= pi``; beyond, where
  ``cos(theta + m)`` would start to increase again, the official code uses
  ``cos(theta) - m sin(m)`` (a CosFace-like margin that keeps the target logit
  monotonic in ``theta``). ``easy_margin=True`` instead applies the margin
  only for ``cos(theta) > 0``.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (normalised inside).
    labels: ``[B]`` integer labels in ``[0, C)``.
    class_weights: ``[C, D]`` (normalised inside).
    margin: ``m`` in radians.
    scale: ``s``.
    easy_margin: the official code's ``easy_margin`` switch.
    axis_name: global-batch mean across devices (module docstring).

  Returns:
    float32 scalar: the mean over the (global) batch.

  References:
    Deng, Guo, Xue, Zafeiriou, "ArcFace: Additive Angular Margin Loss for
    Deep Face Recognition", CVPR 2019, eq. 3 (and the insightface code).
  """
  ranges.check_range(scale, "scale", ranges.POSITIVE_RANGE)
  x, labels, w = _inputs(embeddings, labels, class_weights)
  cos = jnp.clip(ops.cosine_similarity(x, w), -1.0, 1.0)
  onehot = jax.nn.one_hot(labels, w.shape[0], dtype=bool)
  sin = ops.safe_sqrt(1.0 - cos * cos)
  cos_m, sin_m = jnp.cos(margin), jnp.sin(margin)
  phi = cos * cos_m - sin * sin_m
  if easy_margin:
    phi = jnp.where(cos > 0.0, phi, cos)
  else:
    # cos(pi - m) = -cos m;  sin(pi - m) * m = m sin m.
    phi = jnp.where(cos > -cos_m, phi, cos - margin * sin_m)
  logits = scale * jnp.where(onehot, phi, cos)
  return _cross_entropy(logits, onehot, axis_name)
