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

NormFace, CosFace, ArcFace and SubCenter-ArcFace also take the class matrix
sharded over the devices (``shard_classes=True``: each device passes its
``ceil(C / n)`` rows, the softmax is PartialFC's model-parallel one) and
PartialFC's negative-class sampling (``sample_rate``, ``key``); see
:mod:`circle_jax.losses.class_shard`. Without them the same code runs on the
whole matrix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import entries
from circle_jax.losses import class_shard
from circle_jax.losses import ranges
from circle_jax.losses import checks

Array = jax.Array


def softmax_loss(embeddings: Array, labels: Array, class_weights: Array, *,
                 bias: Optional[Array] = None,
                 axis_name: Optional[str] = None) -> Array:
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
  x, labels, w, block = class_shard.class_block(
      embeddings, labels, class_weights, axis_name=axis_name)
  logits = jnp.matmul(x, w.T, precision=jax.lax.Precision.HIGHEST)
  if bias is not None:
    bias = checks.check_shape(
        bias, (w.shape[0],), f"`bias` must have shape [num_classes] = "
        f"({w.shape[0]},); got {jnp.shape(bias)}.")
    logits = logits + bias.astype(jnp.float32)
  onehot = block.onehot(labels)
  return block.cross_entropy(logits, onehot)


def cosface_loss(embeddings: Array, labels: Array, class_weights: Array, *,
                 margin: float = 0.35, scale: float = 64.0,
                 axis_name: Optional[str] = None, **layout) -> Array:
  r"""CosFace / AM-Softmax: additive cosine margin (Wang et al. 2018).

  With ``cos_c = \hat x \cdot \hat W_c``:

  .. math::

    L = \frac{1}{B} \sum_i -\log
        \frac{e^{s (\cos_{y_i} - m)}}
             {e^{s (\cos_{y_i} - m)} + \sum_{c \ne y_i} e^{s \cos_c}} .

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (normalised inside).
    labels: ``[B]`` integer labels in ``[0, C)``.
    class_weights: ``[C, D]`` (normalised inside); with ``shard_classes``
      this device's ``[ceil(C / n), D]`` rows.
    margin: ``m``.
    scale: ``s``.
    axis_name: the global batch (module docstring).
    **layout: the class matrix's layout (``shard_classes``, ``num_classes``,
      ``sample_rate``, ``key``), documented once at
      :class:`circle_jax.losses.class_shard.Layout`.

  Returns:
    float32 scalar: the mean over the (global) batch.

  References:
    Wang et al., "CosFace: Large Margin Cosine Loss for Deep Face
    Recognition", CVPR 2018, eq. 4. Wang, Cheng, Liu, Liu, "Additive Margin
    Softmax for Face Verification", IEEE SPL 2018.
  """
  layout = class_shard.Layout(**layout)
  ranges.check_range(scale, "scale", ranges.POSITIVE_RANGE)
  x, labels, w, block = class_shard.class_block(
      embeddings, labels, class_weights, axis_name=axis_name, layout=layout)
  cos = ops.cosine_similarity(x, w)
  onehot = block.onehot(labels)
  logits = scale * jnp.where(onehot, cos - margin, cos)
  return block.cross_entropy(logits, onehot)


def normface_loss(embeddings: Array, labels: Array, class_weights: Array, *,
                  scale: float = 20.0, axis_name: Optional[str] = None,
                  **layout) -> Array:
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
    embeddings, labels, class_weights, axis_name, **layout: as
      :func:`cosface_loss`.
    scale: ``s``.

  Returns:
    float32 scalar: the mean over the (global) batch.

  References:
    Wang, Xiang, Cheng, Yuille, "NormFace: L2 Hypersphere Embedding for Face
    Verification", ACM MM 2017, eq. 5. Zhai, Wu, "Classification is a Strong
    Baseline for Deep Metric Learning", BMVC 2019.
  """
  return cosface_loss(
      embeddings, labels, class_weights, margin=0.0, scale=scale,
      axis_name=axis_name, **layout)


def _arcface_logits(cos, onehot, *, margin, scale, easy_margin):
  """ArcFace's logits of the cosines: the angular margin on the target."""
  cos = jnp.clip(cos, -1.0, 1.0)
  sin = ops.safe_sqrt(1.0 - cos * cos)
  cos_m, sin_m = jnp.cos(margin), jnp.sin(margin)
  phi = cos * cos_m - sin * sin_m
  if easy_margin:
    phi = jnp.where(cos > 0.0, phi, cos)
  else:
    # cos(pi - m) = -cos m;  sin(pi - m) * m = m sin m.
    phi = jnp.where(cos > -cos_m, phi, cos - margin * sin_m)
  return scale * jnp.where(onehot, phi, cos)


@dataclasses.dataclass(frozen=True)
class SubCenterArcFace:
  """(Sub-center) ArcFace's hyperparameters and their defaults (the
  papers'): ``K`` sub-centres per class, the angular margin ``m``, the scale
  ``s`` and insightface's ``easy_margin`` switch. ArcFace fixes ``K = 1``."""

  centers_per_class: int = 3
  margin: float = 0.5
  scale: float = 64.0
  easy_margin: bool = False


def arcface_loss(embeddings: Array, labels: Array, class_weights: Array, *,
                 margin: float = SubCenterArcFace.margin,
                 scale: float = SubCenterArcFace.scale,
                 easy_margin: bool = SubCenterArcFace.easy_margin,
                 axis_name: Optional[str] = None, **layout) -> Array:
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
    class_weights: ``[C, D]`` (normalised inside); with ``shard_classes``
      this device's ``[ceil(C / n), D]`` rows.
    margin: ``m`` in radians.
    scale: ``s``.
    easy_margin: the official code's ``easy_margin`` switch.
    axis_name, **layout: as :func:`cosface_loss`.

  Returns:
    float32 scalar: the mean over the (global) batch.

  References:
    Deng, Guo, Xue, Zafeiriou, "ArcFace: Additive Angular Margin Loss for
    Deep Face Recognition", CVPR 2019, eq. 3 (and the insightface code).
  """
  hp = SubCenterArcFace(margin=margin, scale=scale, easy_margin=easy_margin,
                        centers_per_class=1)
  layout = class_shard.Layout(**layout)
  return _subcenter_arcface(embeddings, labels, class_weights, hp,
                            axis_name, layout)


def subcenter_arcface_loss(
    embeddings: Array, labels: Array, class_weights: Array, *,
    centers_per_class: int = SubCenterArcFace.centers_per_class,
    margin: float = SubCenterArcFace.margin,
    scale: float = SubCenterArcFace.scale,
    easy_margin: bool = SubCenterArcFace.easy_margin,
    axis_name: Optional[str] = None, **layout) -> Array:
  r"""Sub-center ArcFace: ``K`` sub-centres per class (Deng et al. 2020).

  Each class ``c`` has ``K`` sub-centres ``W_c^k`` (row ``c K + k`` of
  ``class_weights``); a sample's cosine to the class is the largest over
  them, and ArcFace (:func:`arcface_loss`, the same margin rule) runs on
  those cosines:

  .. math::

    \cos\theta_c = \max_k \hat x \cdot \hat W_c^k, \qquad
    L = \frac{1}{B} \sum_i -\log
        \frac{e^{s\,\phi(\theta_{y_i})}}
             {e^{s\,\phi(\theta_{y_i})} + \sum_{c \ne y_i} e^{s \cos\theta_c}} .

  The gradient of the max reaches only the closest sub-centre of each
  (sample, class) pair. ``K = 1`` is ArcFace. The paper's later step (drop
  the non-dominant sub-centres and go on with ``K = 1``) is a training
  schedule, not part of this loss.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (normalised inside).
    labels: ``[B]`` integer labels in ``[0, C)``.
    class_weights: ``[C K, D]`` sub-centres, class-major (normalised
      inside); with ``shard_classes`` this device's ``[ceil(C / n) K, D]``.
    centers_per_class: ``K`` (static; paper: 3).
    margin: ``m`` in radians (paper: 0.5).
    scale: ``s`` (paper: 64).
    easy_margin: the insightface code's ``easy_margin`` switch.
    axis_name, **layout: as for :func:`arcface_loss`.

  Returns:
    A float32 scalar, the mean of the per-sample terms over the global batch.

  References:
    Deng, Guo, Liu, Zafeiriou, Kotsia, "Sub-center ArcFace: Boosting Face
    Recognition by Large-scale Noisy Web Faces", ECCV 2020.
  """
  hp = SubCenterArcFace(centers_per_class=centers_per_class, margin=margin,
                        scale=scale, easy_margin=easy_margin)
  layout = class_shard.Layout(**layout)
  return _subcenter_arcface(embeddings, labels, class_weights, hp,
                            axis_name, layout)


def _subcenter_arcface(embeddings, labels, class_weights, hp, axis_name,
                       layout):
  k = hp.centers_per_class
  if not isinstance(k, int) or k < 1:
    raise ValueError(
        f"`centers_per_class` must be a positive Python int; got {k!r}.")
  ranges.check_range(hp.scale, "scale", ranges.POSITIVE_RANGE)
  x, labels, w, block = class_shard.class_block(
      embeddings, labels, class_weights, per_class=k, axis_name=axis_name,
      layout=layout)
  cos = ops.cosine_similarity(x, w)
  if k > 1:
    cos = jnp.max(cos.reshape(x.shape[0], -1, k), axis=2)
  onehot = block.onehot(labels)
  logits = _arcface_logits(cos, onehot, margin=hp.margin, scale=hp.scale,
                           easy_margin=hp.easy_margin)
  return block.cross_entropy(logits, onehot)


@dataclasses.dataclass(frozen=True)
class SubspaceArcFace:
  """Unicom's fine-tuning hyperparameters (the official retrieval scripts:
  ``--margin_loss_s 32 --margin_loss_m2 0.25 --num_feat 512``)."""

  margin: float = 0.25
  scale: float = 32.0
  num_features: int = 512
  straight_through: bool = True


def subspace_indices(key: Array, dim: int, num_features: int) -> Array:
  """The ``[min(k, D)]`` feature dimensions one step of
  :func:`subspace_arcface_loss` keeps: the first ``k`` of a uniformly random
  permutation of ``range(D)`` (all ``D``, in order, when ``k >= D``).

  Args:
    key: the step's PRNG key (as passed to the loss).
    dim: ``D``.
    num_features: ``k``.
  """
  if num_features >= dim:
    return jnp.arange(dim)
  return jax.random.permutation(key, dim)[:num_features]


def subspace_arcface_loss(embeddings: Array, labels: Array,
                          class_weights: Array, *,
                          margin: float = SubspaceArcFace.margin,
                          scale: float = SubspaceArcFace.scale,
                          num_features: int = SubspaceArcFace.num_features,
                          straight_through: bool = (
                              SubspaceArcFace.straight_through),
                          features: Optional[Array] = None,
                          axis_name: Optional[str] = None,
                          **layout) -> Array:
  r"""Unicom's subspace ArcFace: ArcFace on a random ``k`` of the ``D``
  feature dimensions each step (An et al. 2023).

  Each call keeps one random set ``S`` of ``k`` dimensions, the same for
  every sample, every class vector and every device
  (``subspace_indices(key, D, k)`` of the step's ``key``), and runs ArcFace on the
  embeddings and class vectors restricted to ``S`` and *then* normalised:

  .. math::

    \cos\theta_{ic} = \frac{x_{i,S} \cdot W_{c,S}}
                           {\|x_{i,S}\| \|W_{c,S}\|}, \qquad
    L = \frac{1}{B} \sum_i -\log
        \frac{e^{s \cos(\theta_{i y_i} + m)}}
             {e^{s \cos(\theta_{i y_i} + m)}
              + \sum_{c \ne y_i} e^{s \cos\theta_{ic}}} .

  The dimensions outside ``S`` get zero gradient this step. ``k >= D`` keeps
  every dimension (no key needed). Evaluation uses the whole embedding (the
  official code evaluates on the first ``k`` dimensions of the normalised
  embedding; a recipe's concern, not the loss's).

  The official code (``unicom/partial_fc.py``, ``PartialFC_V2`` with
  ``CombinedMarginLoss``), read for this function: ``S`` is drawn once per
  forward pass (``argsort`` of ``torch.rand(D)``, first ``k``), applied to
  the gathered embeddings and the (PartialFC-sampled) class rows alike,
  before ``normalize``; the cosines are clamped to ``[-1, 1]``; the target
  logit is ``cos(arccos(cos) + m)`` computed under ``torch.no_grad`` on the
  logits in place, so its gradient is the plain cosine's (``s`` times the
  softmax residual: a straight-through margin) and there is no extension
  beyond ``theta + m > pi``. ``straight_through=True`` (default) is that
  code: the same value and gradient. The paper gives ArcFace's value only;
  ``straight_through=False`` is :func:`arcface_loss` on ``S`` (the true
  gradient of ``cos(theta + m)`` and its monotonic extension
  ``cos(theta) - m sin(m)`` beyond ``pi - m``). The code's ranks draw ``S``
  from an unseeded, identical CUDA generator stream, so every rank keeps
  the same ``S``; here one key, the same on every device. PartialFC's class
  sampling (``sample_rate``) is :mod:`circle_jax.losses.class_shard`'s, with
  the key ``fold_in(key, 1)``.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (normalised inside, after the
      selection).
    labels: ``[B]`` integer labels in ``[0, C)``.
    class_weights: ``[C, D]`` (normalised inside, after the selection); with
      ``shard_classes`` this device's ``[ceil(C / n), D]`` rows.
    margin: ``m`` in radians (the code's ``m2``; SOP and In-Shop scripts:
      0.25).
    scale: ``s`` (scripts: 32).
    num_features: ``k``, the dimensions kept per step (static; the code's
      ``--num_feat``, 512 of 768).
    straight_through: the official code's gradient (above).
    features: optional ``[k]`` int array, the dimensions to keep instead of
      drawing them (to replay a step; ``subspace_indices`` gives the drawn
      ones).
    axis_name, **layout: as :func:`cosface_loss`; ``key`` (the step's PRNG
      key) is required when ``k < D`` and ``features`` is not given.

  Returns:
    float32 scalar: the mean over the (global) batch.

  References:
    An, Deng, Yang, Li, Feng, Guo, Yang, Liu, "Unicom: Universal and Compact
    Representation Learning for Image Retrieval", ICLR 2023 (random feature
    selection, Sec. 3); code: github.com/deepglint/unicom
    (``unicom/partial_fc.py``, ``unicom/retrieval.py``,
    ``unicom/scripts/sop_vit_b_16.sh``). Deng et al., ArcFace, CVPR 2019.
  """
  layout = dict(layout)
  key = layout.get("key")
  dim = jnp.shape(embeddings)[-1]
  if (isinstance(num_features, bool) or not isinstance(num_features, int)
      or num_features < 1):
    raise ValueError(f"`num_features` (the subspace's k) must be a positive "
                     f"Python int; got {num_features!r}.")
  if features is None:
    if num_features < dim and key is None:
      raise ValueError(
          f"num_features={num_features} < D={dim} draws a random subspace: "
          "pass the step's PRNG `key` (or the dimensions as `features`).")
    if key is not None:  # PartialFC's classes: a key of their own
      layout["key"] = jax.random.fold_in(key, 1)
    features = subspace_indices(key, dim, num_features)
  features = jnp.asarray(features)
  if features.ndim != 1 or not jnp.issubdtype(features.dtype, jnp.integer):
    raise ValueError(f"`features` must be a 1-D integer array of feature "
                     f"indices; got {features.dtype} {features.shape}.")
  ranges.check_range(scale, "scale", ranges.POSITIVE_RANGE)
  checks.check_class_vectors(class_weights, dim, "class_weights")
  x = jnp.take(embeddings, features, axis=1)
  w = jnp.take(class_weights, features, axis=1)
  x, labels, w, block = class_shard.class_block(
      x, labels, w, axis_name=axis_name, layout=class_shard.Layout(**layout))
  cos = ops.cosine_similarity(x, w)
  onehot = block.onehot(labels)
  if straight_through:
    cos = jnp.clip(cos, -1.0, 1.0)
    shifted = jnp.cos(jnp.arccos(jax.lax.stop_gradient(cos)) + margin)
    logits = scale * jnp.where(
        onehot, cos + jax.lax.stop_gradient(shifted - cos), cos)
  else:
    logits = _arcface_logits(cos, onehot, margin=margin, scale=scale,
                             easy_margin=False)
  return block.cross_entropy(logits, onehot)


def subcenter_arcface_outliers(
    embeddings: Array, labels: Array, class_weights: Array, *,
    centers_per_class: int = SubCenterArcFace.centers_per_class,
    threshold: float = 75.0):
  r"""Sub-center ArcFace's outliers and dominant sub-centres (Deng et al.
  2020, Sec. 3.2): pytorch-metric-learning's
  ``SubCenterArcFaceLoss.get_outliers``, as a plain function.

  For each class ``c``, every sample of the class votes for its closest
  sub-centre ``rg\max_k \hat x \cdot \hat W_c^k``; the dominant
  sub-centre ``k_c`` has the most votes (the lowest ``k`` among ties), and a
  sample whose cosine to its class's dominant sub-centre is below
  ``\cos(	ext{threshold})`` is an outlier, a likely noisy label (the
  paper drops them, keeps the dominant sub-centres and trains on with
  ``K = 1``).

  Differences from pytorch-metric-learning 2.9 (equal outliers and centres,
  tested): PML returns the outliers' indices, class by class; here a
  ``[B]`` mask (``jnp.flatnonzero(mask)`` gives the indices, sorted), which
  keeps the shapes static under ``jit``. PML leaves the column of a class
  without samples uninitialised; here it is the class's first sub-centre.
  PML returns the centres even with ``return_dominant_centers=False`` (its
  conditional expression binds before the tuple); here they are always
  returned. The whole class matrix (not a ``shard_classes`` shard).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels in ``[0, C)``.
    class_weights: ``[C K, D]`` sub-centres, class-major, as
      :func:`subcenter_arcface_loss` (PML's ``W`` transposed).
    centers_per_class: ``K`` (static).
    threshold: the angle in degrees (PML's name and default, 75).

  Returns:
    ``(is_outlier, dominant_centers)``: ``[B]`` bool and ``[C, D]`` (rows
    of ``class_weights``, as given).
  """
  k = centers_per_class
  if not isinstance(k, int) or k < 1:
    raise ValueError(
        f"`centers_per_class` must be a positive Python int; got {k!r}.")
  if class_weights.ndim != 2 or class_weights.shape[0] % k:
    raise ValueError(
        f"`class_weights` must be [C * centers_per_class, D] with "
        f"centers_per_class={k}; got shape {class_weights.shape}.")
  num_classes = class_weights.shape[0] // k
  own = jnp.asarray(labels)[:, None] * k + jnp.arange(k)  # [B, K] rows
  z = ops.l2_normalize(embeddings)
  cos = jnp.einsum("bd,bkd->bk", z, ops.l2_normalize(class_weights)[own],
                   precision=jax.lax.Precision.HIGHEST)
  votes = jax.ops.segment_sum(jax.nn.one_hot(jnp.argmax(cos, axis=1), k),
                              labels, num_classes)  # [C, K]
  dominant = jnp.argmax(votes, axis=1)  # [C]
  centers = class_weights[jnp.arange(num_classes) * k + dominant]
  to_dominant = jnp.take_along_axis(cos, dominant[labels][:, None], 1)[:, 0]
  cos_threshold = math.cos(math.radians(threshold))
  return to_dominant < cos_threshold, centers


# The registry's facts of this module's losses (circle_jax.losses.registry
# collects them).
REGISTRY = (
    entries.classifier("normface", normface_loss,
        paper="Wang et al., \"NormFace: L2 Hypersphere Embedding "
              "for Face Verification\", ACM MM 2017"),
    entries.classifier("cosface", cosface_loss,
        paper="Wang et al., \"CosFace: Large Margin Cosine Loss for "
              "Deep Face Recognition\", CVPR 2018 (= AM-Softmax)"),
    entries.classifier("arcface", arcface_loss,
        param_init="normal, std 0.01 (insightface)",
        paper="Deng et al., \"ArcFace: Additive Angular Margin Loss "
              "for Deep Face Recognition\", CVPR 2019"),
    entries.classifier("subcenter_arcface", subcenter_arcface_loss,
        init=entries.subcenters_normal(0.01),
        param_init="normal, std 0.01, [C K, D]",
        paper="Deng, Guo, Liu, Zafeiriou, Kotsia, \"Sub-center "
              "ArcFace: Boosting Face Recognition by Large-scale "
              "Noisy Web Faces\", ECCV 2020"),
    entries.classifier("softmax", softmax_loss,
        init=entries.glorot_uniform, param_init="glorot (xavier) uniform",
        paper="softmax cross-entropy on a linear classifier"),
    entries.classifier("subspace_arcface", subspace_arcface_loss,
        needs_key=True, param_init="normal, std 0.01 (PartialFC)",
        paper="An, Deng, et al., \"Unicom: Universal and Compact "
              "Representation Learning for Image Retrieval\", ICLR 2023"),
)
