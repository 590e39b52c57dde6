r"""VICReg: variance, invariance and covariance of two views (Bardes et al.).

Two batches of embeddings ``Z, Z'`` (``[N, D]``, row ``i`` of each: two
views of one image), no labels:

.. math::

  L = \lambda\, s(Z, Z') + \mu\, [v(Z) + v(Z')] + \nu\, [c(Z) + c(Z')],

  s(Z, Z') = \frac{1}{N D} \sum_i \|z_i - z'_i\|^2, \qquad
  v(Z) = \frac{1}{2D} \sum_j \max\!\left(0, 1 - \sqrt{\mathrm{Var}(z^j)
         + \epsilon}\right), \qquad
  c(Z) = \frac{1}{D} \sum_{j \ne k} C(Z)_{jk}^2 ,

with the unbiased variance and covariance ``C(Z) = \frac{1}{N-1} \sum_i
(z_i - \bar z)(z_i - \bar z)^\top`` over the batch. ``v`` carries the
official code's (and PML 2.9's) ``1/2``, which the paper's eq. 1-6 do not
write; ``\gamma = 1``. The value is PML 2.9's ``VICRegLoss`` (its four
sub-losses, each mean-reduced, summed).

With ``axis_name`` the batch statistics (mean, covariance) and the
invariance mean run over the global batch by global sums: the value is the
single-device loss of the gathered batch on every device, and the gradients
are exact. Embeddings are not normalised.

:func:`vicreg_loss` takes the two views as two arrays (PML's ``(embeddings,
ref_emb)``). The registry's ``vicreg`` is :func:`vicreg_loss_of_views`: the
trainer's batch whose rows ``2i`` and ``2i + 1`` pair up, from the
``'views'`` sampler with two views per image (two augmentations of one
image) or the P x K sampler with an even ``K`` (two images of one class);
its labels are not used. The config check refuses the other samplers.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import checks
from circle_jax.losses import entries
from circle_jax.losses import ranges
from circle_jax.losses.engine import reductions

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class VICReg:
  """VICReg's weights and epsilon; defaults are the paper's and PML 2.9's
  (``λ = μ = 25``, ``ν = 1``, ``ε = 1e-4``), named as PML's constructor."""

  invariance_lambda: float = 25.0
  variance_mu: float = 25.0
  covariance_v: float = 1.0
  eps: float = 1e-4


def _statistics(z: Array, axis_name) -> tuple[Array, Array]:
  """``(v(Z), c(Z))`` of the module docstring over the (global) batch."""
  n = z.shape[0] * (1 if axis_name is None else jax.lax.psum(1, axis_name))
  # The covariance's derivative w.r.t. the mean is -sum_i (z_i - mean) = 0
  # over the global batch, but not over one device's rows: without the
  # stop_gradient a device would add its share of that zero alone (wrong
  # gradients under pmap). With it, the gradient is exact everywhere.
  mean = jax.lax.stop_gradient(
      ops.maybe_global_sum(jnp.sum(z, axis=0), axis_name) / n)
  zc = z - mean
  cov = ops.maybe_global_sum(
      jnp.matmul(zc.T, zc, precision=jax.lax.Precision.HIGHEST),
      axis_name) / (n - 1)
  return jnp.diagonal(cov), cov


def vicreg_loss(embeddings: Array, ref_emb: Array, *,
                invariance_lambda: float = VICReg.invariance_lambda,
                variance_mu: float = VICReg.variance_mu,
                covariance_v: float = VICReg.covariance_v,
                eps: float = VICReg.eps,
                axis_name: Optional[str] = None) -> Array:
  r"""VICReg of two views (module docstring).

  Args:
    embeddings: ``[N, D]`` float32 or bfloat16, the first views ``Z``.
    ref_emb: ``[N, D]``, the second views ``Z'`` (row ``i`` pairs with
      ``embeddings[i]``).
    invariance_lambda: ``\lambda``.
    variance_mu: ``\mu``.
    covariance_v: ``\nu``.
    eps: ``\epsilon`` under the standard deviation's square root.
    axis_name: the mapped axis the pairs are split over (global batch).

  Returns:
    float32 scalar: ``\lambda s + \mu (v + v') + \nu (c + c')``, ``s`` the
    mean over the (global) pairs and dimensions.

  References:
    Bardes, Ponce, LeCun, "VICReg: Variance-Invariance-Covariance
    Regularization for Self-Supervised Learning", ICLR 2022, eqs. 1-6 (and
    its official code's ``1/2`` on the variance term).
  """
  z = checks.check_embeddings(embeddings)
  z2 = checks.check_embeddings(ref_emb, "ref_emb")
  if z.shape != z2.shape:
    raise ValueError(f"`embeddings` and `ref_emb` must have the same shape "
                     f"(two views of the same images); got {z.shape} and "
                     f"{z2.shape}.")
  if z.shape[0] < 2 and axis_name is None:
    raise ValueError(f"VICReg needs at least 2 pairs for the batch variance; "
                     f"got {z.shape[0]}.")
  for name, value in (("invariance_lambda", invariance_lambda),
                      ("variance_mu", variance_mu),
                      ("covariance_v", covariance_v)):
    ranges.check_range(value, name, ranges.NONNEGATIVE_RANGE)
  ranges.check_range(eps, "eps", ranges.POSITIVE_RANGE)
  dim = z.shape[1]
  invariance = reductions.sum_over_batch(
      jnp.mean((z - z2) ** 2, axis=1), axis_name)
  off_diagonal = ~jnp.eye(dim, dtype=bool)
  variance = covariance = 0.0
  for view in (z, z2):
    var, cov = _statistics(view, axis_name)
    variance += jnp.mean(jax.nn.relu(1.0 - jnp.sqrt(var + eps))) / 2.0
    covariance += jnp.sum(jnp.where(off_diagonal, cov * cov, 0.0)) / dim
  return (invariance_lambda * invariance + variance_mu * variance
          + covariance_v * covariance)


def vicreg_loss_of_views(
    embeddings: Array, labels: Array, *,
    invariance_lambda: float = VICReg.invariance_lambda,
    variance_mu: float = VICReg.variance_mu,
    covariance_v: float = VICReg.covariance_v, eps: float = VICReg.eps,
    axis_name: Optional[str] = None) -> Array:
  r"""VICReg of a batch whose rows ``2i`` and ``2i + 1`` are two views.

  ``vicreg_loss(embeddings[0::2], embeddings[1::2], ...)``; the registry's
  ``vicreg``, which the trainer calls with the sampler's labels (unused).
  The ``'views'`` sampler with two views per image gives two augmentations
  of one image (the paper's setting); the P x K sampler with an even ``K``
  (class-major rows) gives two images of one class (a supervised use).
  With ``axis_name`` and an odd number of rows per device, the global batch
  is gathered and split in pairs there.

  Args:
    embeddings: ``[2N, D]`` (the global batch's rows ``2i``, ``2i + 1``
      pair up).
    labels: ``[2N]`` integer labels (the image indices); not used.
    invariance_lambda, variance_mu, covariance_v, eps, axis_name: as
      :func:`vicreg_loss`.

  Returns:
    float32 scalar, as :func:`vicreg_loss`.
  """
  z = checks.check_embeddings(embeddings)
  labels = checks.check_labels(labels, z.shape[0], multi_hot=True)
  hyper = dict(invariance_lambda=invariance_lambda, variance_mu=variance_mu,
               covariance_v=covariance_v, eps=eps)
  if z.shape[0] % 2 == 0:
    return vicreg_loss(z[0::2], z[1::2], axis_name=axis_name, **hyper)
  if axis_name is None:
    raise ValueError(
        f"vicreg takes two views of each image in consecutive rows; got an "
        f"odd batch of {z.shape[0]}. Use batch.sampler='views' with "
        f"batch.images_per_class=2 (or 'pk' with an even images_per_class).")
  # This device's rows split a pair: every device computes the loss of the
  # gathered global batch and adds 1/n of it, so the all-gather's transpose
  # sums exactly one gradient.
  devices = jax.lax.psum(1, axis_name)
  loss = vicreg_loss_of_views(ops.gather_global(z, axis_name),
                              ops.gather_global(labels, axis_name), **hyper)
  return ops.global_sum(loss / devices, axis_name)


# The registry's facts of this module's loss (circle_jax.losses.registry
# collects them): a "pair" loss without pairs compared (no geometry, no
# references), fed the views or P x K batch (the config check).
REGISTRY = (
    entries.entry("vicreg", vicreg_loss_of_views, "pair",
        reduction="weighted sum of the mean invariance (over pairs and "
                  "dims) and the batch variance and covariance terms",
        paper="Bardes, Ponce, LeCun, \"VICReg: Variance-Invariance-"
              "Covariance Regularization for Self-Supervised Learning\", "
              "ICLR 2022"),
)
