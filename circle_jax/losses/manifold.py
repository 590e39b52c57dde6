r"""Manifold loss: random-walk similarities to hard proxies (Aziere &
Todorovic 2019).

The ``N`` embeddings and ``K`` proxies form one graph, with edge weights
``S = \exp(2 \max(\cos, 0))`` (zero diagonal). Its symmetric normalisation
``\bar S = D^{-1/2} S D^{-1/2}`` diffuses by a random walk with restart,

.. math::

  F = (1 - \alpha)(I - \alpha \bar S)^{-1},

and each sample ``i`` is pushed towards its proxy ``m_i`` with two margin
losses over the other proxies ``c``: the intrinsic one on the manifold
similarities ``F_{i, c}``, the context one on the cosine of the rows
``\cos(F_i, F_c)``,

.. math::

  \ell(i) = \log\Big(1 + \sum_{c \ne m_i,\ t_{ic} \ge 0} e^{t_{ic}}\Big),
  \quad t_{ic} = G_{ic} - G_{i m_i} + \mathrm{margin},
  \qquad L = \overline{\ell_{F}} + \lambda_C\, \overline{\ell_{\cos F}},

means over the samples. The graph is the whole (global) batch and every
proxy at once (a matrix inverse), so the loss cannot be tiled: it runs on
the gathered batch and the gathered proxies.

``labels`` are the meta-classes ``m_i`` (PML's ``indices_tuple``): the
index of each sample's proxy in ``[0, K)``. With class labels and ``K = C``
proxies the proxies are class proxies (what the trainer does). Differences
from pytorch-metric-learning 2.9: PML takes no labels and, without an
``indices_tuple``, draws the meta-classes at random every call (each proxy
at least once, so it needs ``N >= K``); ``K`` here is the class matrix's
number of rows (PML's ``K``, default 50); and ``lambdaC = inf`` gives the
context loss alone, as PML's docstring says, where PML 2.9 returns
``0 + inf * loss_ctx`` (``inf``, or ``nan`` when the context loss is 0).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import checks
from circle_jax.losses import class_shard
from circle_jax.losses import entries
from circle_jax.losses import ranges

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Manifold:
  """The Manifold loss's hyperparameters, named and defaulted as PML 2.9's
  ``ManifoldLoss`` (the paper's ``\\lambda_C``, ``\\alpha`` and margin).

  Attributes:
    lambdaC: ``\\lambda_C`` in ``[0, inf]``, the context loss's weight
      (``inf``: the context loss alone).
    alpha: the random walk's ``\\alpha`` in (0, 1).
    margin: the margin of both losses.
  """

  lambdaC: float = 1.0  # noqa: N815 (PML's name)
  alpha: float = 0.8
  margin: float = 5e-4

  ranges = types.MappingProxyType({
      "lambdaC": ranges.HyperRange(0.0, math.inf, True, True),
      "alpha": ranges.HyperRange(0.0, 1.0, False, False)})


def _margin_term(g: Array, onehot: Array, margin) -> Array:
  """``[N]``: ``log(1 + sum_{c != m_i, t >= 0} exp(t_ic))``."""
  own = jnp.sum(jnp.where(onehot, g, 0.0), axis=1, keepdims=True)
  t = g - own + margin
  keep = ~onehot & (t >= 0.0)
  return jnp.log1p(jnp.sum(jnp.where(keep, jnp.exp(jnp.where(keep, t, 0.0)),
                                     0.0), axis=1))


def _row_cosines(a: Array, b: Array) -> Array:
  """``[N, K]`` cosines of the rows, torch's ``cosine_similarity`` (eps
  1e-8 on each norm)."""
  na = jnp.maximum(ops.safe_sqrt(jnp.sum(a * a, axis=1)), 1e-8)
  nb = jnp.maximum(ops.safe_sqrt(jnp.sum(b * b, axis=1)), 1e-8)
  dots = jnp.matmul(a, b.T, precision=jax.lax.Precision.HIGHEST)
  return dots / (na[:, None] * nb[None, :])


def _whole_loss(x, labels, proxies, hp):
  n, k = x.shape[0], proxies.shape[0]
  z = jnp.concatenate([x, proxies], axis=0)
  s = jnp.exp(jnp.maximum(ops.cosine_similarity(z, z), 0.0) / 0.5)
  s = jnp.where(jnp.eye(n + k, dtype=bool), 0.0, s)
  d = jax.lax.rsqrt(jnp.sum(s, axis=1))
  s_bar = d[:, None] * s * d[None, :]
  f = (1.0 - hp.alpha) * jnp.linalg.inv(
      jnp.eye(n + k, dtype=s.dtype) - hp.alpha * s_bar)
  onehot = labels[:, None] == jnp.arange(k)[None, :]
  context = jnp.mean(_margin_term(_row_cosines(f[:n], f[n:]), onehot,
                                  hp.margin))
  if hp.lambdaC == math.inf:
    return context
  intrinsic = jnp.mean(_margin_term(f[:n, n:], onehot, hp.margin))
  return intrinsic + hp.lambdaC * context


def manifold_loss(
    embeddings: Array,
    labels: Array,
    proxies: Array,
    *,
    lambdaC: float = Manifold.lambdaC,  # noqa: N803 (PML's name)
    alpha: float = Manifold.alpha,
    margin: float = Manifold.margin,
    axis_name: Optional[str] = None,
    shard_classes: bool = class_shard.Layout.shard_classes,
    num_classes: Optional[int] = class_shard.Layout.num_classes,
) -> Array:
  r"""Manifold loss of the embeddings and the proxies (module docstring).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer meta-classes in ``[0, K)``: each sample's proxy.
    proxies: ``[K, D]``; with ``shard_classes`` this device's ``[ceil(K /
      n), D]`` rows (:func:`circle_jax.losses.pad_rows`).
    lambdaC: ``\lambda_C`` in ``[0, inf]`` (PML's name).
    alpha: the random walk's ``\alpha`` in (0, 1).
    margin: the margin.
    axis_name: the mapped axis of the batch: the graph is the global batch
      (gathered), the value the same on every device, the gradients exact.
    shard_classes, num_classes: the proxies sharded over ``axis_name``
      (gathered for the graph; each device's rows get their gradient).

  Returns:
    float32 scalar: the intrinsic loss's mean over the (global) samples plus
    ``\lambda_C`` times the context loss's (PML's ``already_reduced``).

  References:
    Aziere, Todorovic, "Ensemble Deep Manifold Similarity Learning using
    Hard Proxies", CVPR 2019.
  """
  hp = Manifold(lambdaC=lambdaC, alpha=alpha, margin=margin)
  ranges.check_ranges({"lambdaC": lambdaC, "alpha": alpha}, hp.ranges,
                      "Manifold loss")
  x = checks.check_embeddings(embeddings)
  labels = checks.check_labels(labels, x.shape[0])
  w = checks.check_class_vectors(proxies, x.shape[1], "proxies")
  if shard_classes:
    if axis_name is None:
      raise ValueError("shard_classes=True needs the mapped `axis_name` the "
                       "proxies are split over.")
    devices = math.prod(jax.lax.axis_size(a) for a in ops.axis_names(axis_name))
    total = num_classes or devices * w.shape[0]
    if -(-total // devices) != w.shape[0]:
      raise ValueError(
          f"num_classes={total} over {devices} devices needs ceil(K / n) = "
          f"{-(-total // devices)} proxies per device; got {w.shape[0]}. "
          "Build the rows with circle_jax.losses.pad_rows.")
    w = ops.gather_global(w, axis_name)[:total]
  elif num_classes is not None and num_classes != w.shape[0]:
    raise ValueError(f"num_classes={num_classes} but `proxies` has "
                     f"{w.shape[0]} rows; pass num_classes only with "
                     "shard_classes=True.")
  if axis_name is None:
    return _whole_loss(x, labels, w, hp)
  # Every device computes the whole loss of the gathered graph; each adds
  # 1/n of it, so the all-gathers' transposes sum exactly one gradient.
  devices = jax.lax.psum(1, axis_name)
  loss = _whole_loss(ops.gather_global(x, axis_name),
                     ops.gather_global(labels, axis_name), w, hp)
  return ops.global_sum(loss / devices, axis_name)


REGISTRY = (
    entries.entry("manifold", manifold_loss, "proxy", rule=Manifold,
        param_name="proxies", init=entries.normal(1.0),
        param_init="normal, std 1 (PML)",
        paper="Aziere, Todorovic, \"Ensemble Deep Manifold Similarity "
              "Learning using Hard Proxies\", CVPR 2019",
        reduction="mean over samples (intrinsic) + lambdaC x mean over "
                  "samples (context)"),
)
