r"""Multiplicative angular margins: L-Softmax and SphereFace (A-Softmax).

Both take ``(embeddings [B, D], labels [B], class_weights [C, D])`` and
replace the target class's ``cos(theta)`` by the monotonic extension of
``cos(m theta)`` (Liu et al. 2016, eq. 6):

.. math::

  \psi(\theta) = (-1)^k \cos(m\theta) - 2k, \qquad
  \theta \in [k\pi/m, (k+1)\pi/m], \; k \in \{0, \dots, m-1\},

with ``cos(m theta)`` written as the polynomial of ``cos(theta)`` of eq. 7
(``\sum_n (-1)^n \binom{m}{2n} \cos^{m-2n}\theta\,(1-\cos^2\theta)^n``; no
``arccos`` in the gradient; ``k`` is a constant). They differ in the
magnitudes that multiply the cosines: L-Softmax keeps both norms
(``\|W_c\| \|x\|``), SphereFace normalises the class weights (``\|x\|``).
The loss is the mean softmax cross-entropy over the (global) batch, as
PML 2.9's (``MeanReducer`` over per-sample terms).

Both take the class matrix sharded over the devices and PartialFC's
negative-class sampling (``shard_classes``, ``num_classes``, ``sample_rate``,
``key``; :mod:`circle_jax.losses.class_shard`), and ``axis_name`` for the
global batch, as :mod:`circle_jax.losses.classification`'s losses.

Differences from pytorch-metric-learning 2.9: the class matrix is ``[C, D]``
(PML's ``W`` is ``[D, C]``); PML's miner weights (``indices_tuple``) and
weight regularizers are not taken; zero-norm rows (the padding rows of a
sharded matrix) have a zero gradient where PML's ``torch.norm`` gives NaN.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import class_shard
from circle_jax.losses import entries
from circle_jax.losses import ranges

Array = jax.Array

@dataclasses.dataclass(frozen=True)
class LargeMargin:
  """L-Softmax's and SphereFace's hyperparameters, named and defaulted as
  PML 2.9's ``LargeMarginSoftmaxLoss`` and ``SphereFaceLoss``: the integer
  angular margin ``m`` and the logits' scale ``s``."""

  margin: int = 4
  scale: float = 1.0


def _check_margin(margin) -> int:
  """``m``: a positive integer (PML's ``int(margin)``; the paper's ``m``)."""
  if (isinstance(margin, bool) or not isinstance(margin, (int, float))
      or margin != int(margin) or margin < 1):
    raise ValueError(
        f"`margin` (L-Softmax's m) must be a positive integer; got "
        f"{margin!r}.")
  return int(margin)


def cos_with_margin(cos: Array, margin: int) -> Array:
  r"""``\psi(\theta)`` of the module docstring, elementwise on ``cos(theta)``.

  Args:
    cos: float array of cosines.
    margin: ``m``, a positive integer.

  Returns:
    ``(-1)^k \cos(m\theta) - 2k`` with ``cos(m theta)`` as eq. 7's
    polynomial of ``cos`` and ``k = floor(theta m / pi)`` (no gradient).
  """
  m = _check_margin(margin)
  sin2 = 1.0 - cos * cos
  cos_m = sum((-1) ** n * math.comb(m, 2 * n) * cos ** (m - 2 * n)
              * sin2 ** n for n in range(m // 2 + 1))
  theta = jnp.arccos(jnp.clip(jax.lax.stop_gradient(cos), -1.0, 1.0))
  k = jnp.floor(theta / (math.pi / m))
  sign = 1.0 - 2.0 * jnp.mod(k, 2.0)
  return sign * cos_m - 2.0 * k


def _norms(v: Array) -> Array:
  """Row norms with a zero gradient at zero rows."""
  return ops.safe_sqrt(jnp.sum(v * v, axis=1))


def _margin_logits(embeddings, labels, class_weights, *, margin, scale,
                   weight_norms, axis_name, layout):
  m = _check_margin(margin)
  ranges.check_range(scale, "scale", ranges.POSITIVE_RANGE)
  x, labels, w, block = class_shard.class_block(
      embeddings, labels, class_weights, axis_name=axis_name, layout=layout)
  cos = ops.cosine_similarity(x, w)
  onehot = block.onehot(labels)
  magnitude = _norms(x)[:, None]
  if weight_norms:
    magnitude = magnitude * _norms(w)[None, :]
  logits = scale * magnitude * jnp.where(onehot, cos_with_margin(cos, m), cos)
  return block.cross_entropy(logits, onehot)


def large_margin_softmax_loss(embeddings: Array, labels: Array,
                              class_weights: Array, *,
                              margin: int = LargeMargin.margin,
                              scale: float = LargeMargin.scale,
                              axis_name: Optional[str] = None,
                              **layout) -> Array:
  r"""L-Softmax: a multiplicative angular margin (Liu et al. 2016).

  With ``\cos\theta_c = \hat x \cdot \hat W_c`` and ``\psi`` of the module
  docstring:

  .. math::

    L = \frac{1}{B} \sum_i -\log
        \frac{e^{s \|W_{y_i}\| \|x_i\| \psi(\theta_{y_i})}}
             {e^{s \|W_{y_i}\| \|x_i\| \psi(\theta_{y_i})}
              + \sum_{c \ne y_i} e^{s\, W_c \cdot x_i}} .

  ``m = 1`` is the plain softmax loss on ``s W_c \cdot x`` (no bias).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (not normalised: their norm
      is part of the logits).
    labels: ``[B]`` integer labels in ``[0, C)``.
    class_weights: ``[C, D]`` (not normalised); with ``shard_classes`` this
      device's ``[ceil(C / n), D]`` rows.
    margin: ``m``, a positive integer (PML's ``margin``, default 4).
    scale: ``s``, multiplies every logit (PML's ``scale``, default 1; not in
      the paper).
    axis_name, **layout: the global batch and the class matrix's layout
      (``shard_classes``, ``num_classes``, ``sample_rate``, ``key``; module
      docstring).

  Returns:
    float32 scalar: the mean over the (global) batch.

  References:
    Liu, Wen, Yu, Yang, "Large-Margin Softmax Loss for Convolutional Neural
    Networks", ICML 2016, eqs. 5-7.
  """
  return _margin_logits(embeddings, labels, class_weights, margin=margin,
                        scale=scale, weight_norms=True, axis_name=axis_name,
                        layout=class_shard.Layout(**layout))


def sphereface_loss(embeddings: Array, labels: Array, class_weights: Array,
                    *, margin: int = LargeMargin.margin,
                    scale: float = LargeMargin.scale,
                    axis_name: Optional[str] = None, **layout) -> Array:
  r"""SphereFace / A-Softmax: L-Softmax on normalised weights (Liu et al.
  2017).

  With ``\cos\theta_c = \hat x \cdot \hat W_c`` and ``\psi`` of the module
  docstring:

  .. math::

    L = \frac{1}{B} \sum_i -\log
        \frac{e^{s \|x_i\| \psi(\theta_{y_i})}}
             {e^{s \|x_i\| \psi(\theta_{y_i})}
              + \sum_{c \ne y_i} e^{s \|x_i\| \cos\theta_c}} .

  As PML 2.9, this is the paper's eq. 8 without its training-time annealing
  (the official code mixes ``\psi`` with ``\cos\theta`` through a decaying
  ``\lambda``; here ``\lambda = 0`` throughout).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (not normalised: their norm
      is part of the logits).
    labels: ``[B]`` integer labels in ``[0, C)``.
    class_weights: ``[C, D]`` (normalised inside); with ``shard_classes``
      this device's ``[ceil(C / n), D]`` rows.
    margin: ``m``, a positive integer (PML's ``margin``, default 4).
    scale: ``s`` (PML's ``scale``, default 1; not in the paper).
    axis_name, **layout: as :func:`large_margin_softmax_loss`.

  Returns:
    float32 scalar: the mean over the (global) batch.

  References:
    Liu, Wen, Yu, Li, Raj, Song, "SphereFace: Deep Hypersphere Embedding for
    Face Recognition", CVPR 2017, eq. 7-8.
  """
  return _margin_logits(embeddings, labels, class_weights, margin=margin,
                        scale=scale, weight_norms=False, axis_name=axis_name,
                        layout=class_shard.Layout(**layout))


REGISTRY = (
    entries.classifier("large_margin_softmax", large_margin_softmax_loss,
        init=entries.normal(1.0), param_init="normal, std 1 (PML)",
        paper="Liu, Wen, Yu, Yang, \"Large-Margin Softmax Loss for "
              "Convolutional Neural Networks\", ICML 2016"),
    entries.classifier("sphereface", sphereface_loss,
        init=entries.normal(1.0), param_init="normal, std 1 (PML)",
        paper="Liu et al., \"SphereFace: Deep Hypersphere Embedding for "
              "Face Recognition\", CVPR 2017"),
)
