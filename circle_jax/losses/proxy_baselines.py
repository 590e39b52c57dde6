"""Proxy baselines: Proxy-NCA and SoftTriple.

Both are per-sample losses against learnable class vectors, averaged over the
batch. With ``axis_name`` no gather is needed: each device computes its own
samples' terms and a global sum gives the mean over the global batch, so the
value is the same on every device and the gradient with respect to the local
embeddings equals the single-device gradient on the concatenated batch. The
proxies / centers are replicated: under ``jax.shard_map`` their gradient
taken inside the map is already the full-batch gradient (JAX sums the
replicated input's cotangent over devices); under ``jax.pmap`` each device
gets its share and the usual ``jax.lax.psum`` of the gradients gives the full
one. Regularisers that depend only on the class vectors are added to every
sample's term, so they are counted exactly once in both cases.

Both also take the class matrix sharded over the devices
(``shard_classes=True``: PartialFC's model-parallel softmax; SoftTriple's
regulariser is then each device's classes' part, summed over the devices)
and PartialFC's negative-class sampling (``sample_rate``, ``key``); see
:mod:`circle_jax.losses.class_shard`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import entries
from circle_jax.losses import class_shard
from circle_jax.losses import ranges

Array = jax.Array


def proxy_nca_loss(embeddings: Array, labels: Array, proxies: Array, *,
                   scale: float = 32.0, include_positive: bool = False,
                   axis_name: Optional[str] = None, **layout) -> Array:
  r"""Proxy-NCA (Movshovitz-Attias et al. 2017), scaled and normalised.

  With L2-normalised embeddings ``x`` and proxies ``p_c`` and the scaled
  squared distance ``d_c(x) = scale * ||x - p_c||^2 = scale (2 - 2 cos)``:

  .. math::

    \ell(x, y) = d_y(x) + \log \sum_{z \in Z} e^{-d_z(x)},
    \qquad Z = \{z \ne y\}\ \ (\text{or all classes}),

  i.e. ``-log(exp(-d_y) / sum_{z in Z} exp(-d_z))``. The paper's NCA
  denominator excludes the positive proxy (``include_positive=False``, the
  default), so the loss can be negative; ``include_positive=True`` is the
  softmax cross-entropy form of pytorch-metric-learning and ProxyNCA++.
  ``scale`` is the inverse temperature on squared distances; 32 is the
  scale of the Proxy-Anchor repository's Proxy-NCA baseline, which goes
  through pytorch-metric-learning's softmax form (``include_positive=True``). With a single class and the
  positive excluded the set ``Z`` is empty and the loss is 0.

  Reduction: mean over the (global) batch.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (normalised inside).
    labels: ``[B]`` integer labels in ``[0, C)``.
    proxies: ``[C, D]`` proxies (normalised inside); with ``shard_classes``
      this device's ``[ceil(C / n), D]`` rows.
    scale: inverse temperature on the squared distances.
    include_positive: whether the positive proxy is in the denominator.
    axis_name: the global batch (module docstring).
    **layout: the class matrix's layout (``shard_classes``, ``num_classes``,
      ``sample_rate``, ``key``), documented once at
      :class:`circle_jax.losses.class_shard.Layout`.

  Returns:
    float32 scalar.

  References:
    Movshovitz-Attias, Toshev, Leung, Ioffe, Singh, "No Fuss Distance Metric
    Learning using Proxies", ICCV 2017, eq. 5. Teh, DeVries, Taylor,
    "ProxyNCA++", ECCV 2020.
  """
  layout = class_shard.Layout(**layout)
  ranges.check_range(scale, "scale", ranges.POSITIVE_RANGE)
  x, labels, p, block = class_shard.class_block(
      embeddings, labels, proxies, name="proxies", axis_name=axis_name,
      layout=layout)
  cos = ops.cosine_similarity(x, p)  # [B, C]
  logits = -scale * jnp.maximum(2.0 - 2.0 * cos, 0.0)
  onehot = block.onehot(labels)
  target = block.target(logits, onehot)
  mask = jnp.ones_like(onehot) if include_positive else ~onehot
  lse = block.logsumexp(logits, mask)
  has = block.class_count(
      jnp.sum(mask & block.real[None, :], axis=1).astype(jnp.float32)) > 0
  per_sample = jnp.where(has, jnp.where(has, lse, 0.0) - target, 0.0)
  return block.batch_mean(per_sample)


def soft_triple_regularizer(centers: Array, *, centers_per_class: int) -> Array:
  r"""SoftTriple's center regulariser (Qian et al. 2019, eq. 12).

  ``sum_c sum_{t<s} sqrt(2 + 1e-5 - 2 <w_c^t, w_c^s>) / (C K (K-1))`` over the
  normalised centers of each class (the ``1e-5`` keeps ``sqrt`` smooth, as in
  the official code).
  """
  spread = _center_spread(centers, centers_per_class)
  k = centers_per_class
  return jnp.sum(spread) / (spread.shape[0] * k * (k - 1.0))


def _center_spread(centers: Array, k: int) -> Array:
  """``[C]``: each class's sum over its center pairs of the regulariser."""
  w = ops.l2_normalize(centers).reshape(-1, k, centers.shape[1])
  gram = jnp.einsum("ckd,cjd->ckj", w, w, precision=jax.lax.Precision.HIGHEST)
  upper = jnp.triu(jnp.ones((k, k), bool), 1)
  dist = jnp.sqrt(jnp.maximum(2.0 + 1e-5 - 2.0 * gram, 1e-5))
  return jnp.sum(jnp.where(upper[None], dist, 0.0), axis=(1, 2))


def soft_triple_loss(embeddings: Array, labels: Array, centers: Array, *,
                     centers_per_class: int = 10, la: float = 20.0,
                     gamma: float = 0.1, margin: float = 0.01, tau: float = 0.2,
                     axis_name: Optional[str] = None, **layout) -> Array:
  r"""SoftTriple loss (Qian et al. 2019): ``K`` centers per class.

  With normalised embeddings ``x`` and centers ``w_c^k`` (row ``c K + k`` of
  ``centers``), the relaxed class similarity is

  .. math::

    S'_c(x) = \sum_k \frac{e^{\frac{1}{\gamma} x^\top w_c^k}}
                          {\sum_{k'} e^{\frac{1}{\gamma} x^\top w_c^{k'}}}
              \, x^\top w_c^k,
    \qquad
    \ell(x, y) = -\log \frac{e^{\lambda (S'_y - \delta)}}
        {e^{\lambda (S'_y - \delta)} + \sum_{j \ne y} e^{\lambda S'_j}},

  and ``L = mean_x ell(x, y) + tau * R(centers)`` with the regulariser
  :func:`soft_triple_regularizer` (skipped when ``tau == 0`` or ``K == 1``).
  The cross-entropy is a max-shifted log-softmax in float32.

  Reduction: mean over the (global) batch, plus the regulariser once.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (normalised inside).
    labels: ``[B]`` integer labels in ``[0, C)``.
    centers: ``[C * K, D]`` centers, class-major (normalised inside); with
      ``shard_classes`` this device's ``[ceil(C / n) K, D]`` rows.
    centers_per_class: ``K`` (static).
    la: ``lambda``, the scale of the logits.
    gamma: ``gamma``, the temperature of the soft assignment to centers.
    margin: ``delta``, the margin on the target class.
    tau: ``tau``, the weight of the center regulariser.
    axis_name, **layout: as :func:`proxy_nca_loss`.

  Returns:
    float32 scalar.

  References:
    Qian, Shang, Sun, Hu, Li, Jin, "SoftTriple Loss: Deep Metric Learning
    Without Triplet Sampling", ICCV 2019, eqs. 8-12 (official defaults
    ``la=20, gamma=0.1, tau=0.2, margin=0.01, K=10``).
  """
  layout = class_shard.Layout(**layout)
  if not isinstance(centers_per_class, int) or centers_per_class < 1:
    raise ValueError(
        f"`centers_per_class` must be a positive Python int; got "
        f"{centers_per_class!r}.")
  ranges.check_range(gamma, "gamma", ranges.POSITIVE_RANGE)
  k = centers_per_class
  x, labels, w, block = class_shard.class_block(
      embeddings, labels, centers, name="centers", per_class=k,
      axis_name=axis_name, layout=layout)
  sim = ops.cosine_similarity(x, w).reshape(x.shape[0], -1, k)
  assign = jax.nn.softmax(sim / gamma, axis=2)
  class_sim = jnp.sum(assign * sim, axis=2)  # [B, C]
  onehot = block.onehot(labels)
  logits = la * (class_sim - margin * onehot)
  per_sample = (block.logsumexp(logits, jnp.ones_like(onehot))
                - block.target(logits, onehot))
  if k > 1 and not (isinstance(tau, (int, float)) and tau == 0):
    # Over all this device's real classes (sampled or not), added once.
    local = jnp.asarray(centers, jnp.float32)
    spread = jnp.where(block.local_real, _center_spread(local, k), 0.0)
    per_sample = per_sample + tau * block.class_sum(jnp.sum(spread)) / (
        block.num_classes * k * (k - 1.0))
  return block.batch_mean(per_sample)


REGISTRY = (
    entries.entry("proxy_nca", proxy_nca_loss, "proxy",
        param_name="proxies", init=entries.normal(1.0),
        param_init="standard normal",
        paper="Movshovitz-Attias et al., \"No Fuss Distance Metric "
              "Learning using Proxies\", ICCV 2017",
        reduction="mean over samples"),
    entries.entry("soft_triple", soft_triple_loss, "proxy",
        param_name="centers", init=entries.soft_triple_centers,
        param_init="uniform +-1/sqrt(C K) (official kaiming_uniform, "
                   "a=sqrt(5)), [C K, D]",
        paper="Qian et al., \"SoftTriple Loss: Deep Metric Learning "
              "Without Triplet Sampling\", ICCV 2019",
        reduction="mean over samples + tau * center regulariser"),
)
