"""BN-Inception (Inception v2 / GoogLeNet with BatchNorm), the DML trunk.

The network of Ioffe & Szegedy as ported to PyTorch by Cadene's
``pretrainedmodels.bninception`` and used by the Multi-Similarity, Proxy-NCA
and Proxy-Anchor codes. Layer by layer the same computation:

* every convolution has a bias and is followed by BatchNorm (``eps=1e-5``) and
  ReLU (the PyTorch port applies the ReLU in place, so the branch outputs that
  are concatenated are post-ReLU);
* max pools use PyTorch's ``ceil_mode=True`` rounding
  (:func:`layers.max_pool_ceil`); the 3x3/1 average pools count the zero
  padding (``count_include_pad=True``);
* the ten inception blocks ``3a ... 5b`` have the channel counts of the
  Cadene port (1024 output channels).

Parameter names are the PyTorch module names: ``inception_3a_1x1`` is a conv
(``kernel``, ``bias``) and ``inception_3a_1x1_bn`` its BatchNorm, so the state
dict converts one-to-one (:func:`circle_jax.models.load_bn_inception`).

Input: BGR, 0-255, minus ``(104, 117, 128)`` (see
:func:`circle_jax.models.input_spec`). The reduction blocks 3c and 4e
concatenate a stride-2 convolution with a ceil-mode pool, which only agree
when their input is even-sized: input sides that are multiples of 32 from 64
on (e.g. 224, 256) always work, some others too (227);
:meth:`BNInception.input_problem` tells which before anything is traced, and
the others raise a ``ValueError``. Output:
``[B, ~H/32, ~W/32, 1024]``.

References:
  Ioffe & Szegedy, "Batch Normalization: Accelerating Deep Network Training by
  Reducing Internal Covariate Shift", ICML 2015.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from circle_jax.models import layers

BN_EPSILON = 1e-5


_SIDES = ("use image sides that are multiples of 32, at least 64 (e.g. 224), "
          "or 227")


def _conv_size(size: int, kernel: int, stride: int) -> int:
  """Output side of a convolution with padding ``kernel // 2``."""
  return (size + 2 * (kernel // 2) - kernel) // stride + 1


class _Block(NamedTuple):
  """Channel counts of one inception block (0: branch absent)."""

  c1x1: int
  c3x3_reduce: int
  c3x3: int
  cdouble_reduce: int
  cdouble: int
  pool: str           # 'avg' (3x3/1), 'max' (3x3/1) or 'max_s2' (reduction)
  pool_proj: int


INCEPTION_BLOCKS = {
    "3a": _Block(64, 64, 64, 64, 96, "avg", 32),
    "3b": _Block(64, 64, 96, 64, 96, "avg", 64),
    "3c": _Block(0, 128, 160, 64, 96, "max_s2", 0),
    "4a": _Block(224, 64, 96, 96, 128, "avg", 128),
    "4b": _Block(192, 96, 128, 96, 128, "avg", 128),
    "4c": _Block(160, 128, 160, 128, 160, "avg", 128),
    "4d": _Block(96, 128, 192, 160, 192, "avg", 128),
    "4e": _Block(0, 128, 192, 192, 256, "max_s2", 0),
    "5a": _Block(352, 192, 320, 160, 224, "avg", 128),
    "5b": _Block(352, 192, 320, 192, 224, "max", 128),
}


class BNInception(layers.BatchNormBackbone):
  """BN-Inception trunk; returns the ``inception_5b`` output map.

  Attributes:
    bn_momentum: Flax-convention running-average momentum (0.9 = PyTorch's
      default 0.1; the Cadene port declares ``momentum=0.9`` in PyTorch's
      convention, i.e. 0.1 here, a porting artefact we do not copy).
    freeze_bn, bn_axis_name, dtype: see
      :class:`circle_jax.models.layers.BatchNormBackbone`.
  """

  bn_momentum: float = 0.9

  def _conv_bn_relu(self, x, name, features, kernel, stride, train):
    pad = kernel // 2
    x = nn.Conv(features, (kernel, kernel), strides=(stride, stride),
                padding=((pad, pad), (pad, pad)), use_bias=True,
                dtype=self.dtype, param_dtype=jnp.float32, name=name)(x)
    x = self.bn(f"{name}_bn", train, epsilon=BN_EPSILON)(x)
    return nn.relu(x)

  def _inception(self, x, key, spec, train):
    p = f"inception_{key}"
    stride = 2 if spec.pool == "max_s2" else 1
    branches = []
    if spec.c1x1:
      branches.append(
          self._conv_bn_relu(x, f"{p}_1x1", spec.c1x1, 1, 1, train))
    y = self._conv_bn_relu(x, f"{p}_3x3_reduce", spec.c3x3_reduce, 1, 1, train)
    branches.append(
        self._conv_bn_relu(y, f"{p}_3x3", spec.c3x3, 3, stride, train))
    y = self._conv_bn_relu(x, f"{p}_double_3x3_reduce", spec.cdouble_reduce,
                           1, 1, train)
    y = self._conv_bn_relu(y, f"{p}_double_3x3_1", spec.cdouble, 3, 1, train)
    branches.append(self._conv_bn_relu(y, f"{p}_double_3x3_2", spec.cdouble,
                                       3, stride, train))
    if spec.pool == "avg":
      y = nn.avg_pool(x, (3, 3), strides=(1, 1), padding=((1, 1), (1, 1)),
                      count_include_pad=True)
    elif spec.pool == "max":
      y = layers.max_pool_ceil(x, 3, 1, pad=1)
    else:
      y = layers.max_pool_ceil(x, 3, 2)
    if spec.pool_proj:
      y = self._conv_bn_relu(y, f"{p}_pool_proj", spec.pool_proj, 1, 1, train)
    branches.append(y)
    sizes = {b.shape[1:3] for b in branches}
    if len(sizes) != 1:
      raise ValueError(
          f"BN-Inception block {key}: the stride-2 convolution and the "
          f"ceil-mode pool disagree on a {x.shape[1]}x{x.shape[2]} input "
          f"(branch sizes {sorted(sizes)}); {_SIDES}.")
    return jnp.concatenate(branches, axis=-1)

  def input_problem(self, height: int, width: int) -> str:
    """Why the trunk cannot take ``height x width`` images ("" if it can).

    Follows each side through the stem and the two reduction blocks, whose
    stride-2 convolution and ceil-mode pool must give the same size
    (sides that are multiples of 32 from 64 on always do; so does 227).
    """
    for side in sorted({height, width}):
      n = side
      try:
        n = layers.ceil_pool_size(_conv_size(n, 7, 2), 3, 2, 0)
        n = layers.ceil_pool_size(n, 3, 2, 0)
        for key, spec in INCEPTION_BLOCKS.items():
          if spec.pool != "max_s2":
            continue
          conv, pool = _conv_size(n, 3, 2), layers.ceil_pool_size(n, 3, 2, 0)
          if conv != pool:
            return (f"in block {key} the stride-2 convolution and the "
                    f"ceil-mode pool disagree on its {n}-pixel side; "
                    f"{_SIDES}")
          n = conv
      except ValueError:
        n = 0
      if n < 1:
        return f"{side} pixels is too small; {_SIDES}"
    return ""

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    x = x.astype(self.dtype)
    x = self._conv_bn_relu(x, "conv1_7x7_s2", 64, 7, 2, train)
    x = layers.max_pool_ceil(x, 3, 2)
    x = self._conv_bn_relu(x, "conv2_3x3_reduce", 64, 1, 1, train)
    x = self._conv_bn_relu(x, "conv2_3x3", 192, 3, 1, train)
    x = layers.max_pool_ceil(x, 3, 2)
    for key, spec in INCEPTION_BLOCKS.items():
      x = self._inception(x, key, spec, train)
    return x
