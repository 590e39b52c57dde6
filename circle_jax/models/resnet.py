"""ResNet-50 (and -101/-152) with the layout of ``keras.applications``.

This is the original ("v1") bottleneck ResNet exactly as Keras builds it, so
that Keras' ImageNet weights convert one-to-one (:func:`load_keras_resnet50`):

* stem: zero-pad 3, 7x7/2 convolution (with bias), BN, ReLU, zero-pad 1,
  3x3/2 max pool;
* bottleneck blocks ``1x1 -> 3x3 -> 1x1 (x4)``, the stride on the *first* 1x1
  convolution (torchvision's "v1.5" puts it on the 3x3), every convolution with
  a bias, BatchNorm with ``epsilon=1.001e-5``; a projection shortcut
  (1x1 convolution + BN) in the first block of every stage.

Parameter names follow the Keras layer names: Keras ``conv3_block2_1_conv`` is
``params['backbone']['conv3_block2']['conv_1']`` and ``conv3_block2_1_bn`` is
``.../bn_1`` (``_0_`` is the projection shortcut); the stem is ``conv1_conv``
and ``conv1_bn``.

Input: Keras' "caffe" preprocessing (BGR, 0-255, minus the ImageNet mean; see
:func:`circle_jax.models.input_spec`). Output: ``[B, H/32, W/32, 2048]``.

References:
  He et al., "Deep Residual Learning for Image Recognition", CVPR 2016.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from circle_jax.models import layers

KERAS_BN_EPSILON = 1.001e-5
STAGE_SIZES = {
    "resnet50": (3, 4, 6, 3),
    "resnet101": (3, 4, 23, 3),
    "resnet152": (3, 8, 36, 3),
}


class _Bottleneck(nn.Module):
  """Keras ``stack1`` block: 1x1/s, 3x3, 1x1 (4x) + (projection) shortcut."""

  filters: int
  stride: int
  project: bool
  freeze_bn: bool
  bn_momentum: float
  bn_axis_name: Optional[str]
  dtype: Any

  def _bn(self, name, train):
    return layers.batch_norm(
        train=train, freeze_bn=self.freeze_bn, name=name,
        momentum=self.bn_momentum, epsilon=KERAS_BN_EPSILON, dtype=self.dtype,
        axis_name=self.bn_axis_name)

  def _conv(self, features, kernel, stride, padding, name):
    return nn.Conv(features, (kernel, kernel), strides=(stride, stride),
                   padding=padding, use_bias=True, dtype=self.dtype,
                   param_dtype=jnp.float32, name=name)

  @nn.compact
  def __call__(self, x, *, train: bool):
    if self.project:
      shortcut = self._conv(4 * self.filters, 1, self.stride, "VALID",
                            "conv_0")(x)
      shortcut = self._bn("bn_0", train)(shortcut)
    else:
      shortcut = x
    y = self._conv(self.filters, 1, self.stride, "VALID", "conv_1")(x)
    y = nn.relu(self._bn("bn_1", train)(y))
    y = self._conv(self.filters, 3, 1, ((1, 1), (1, 1)), "conv_2")(y)
    y = nn.relu(self._bn("bn_2", train)(y))
    y = self._conv(4 * self.filters, 1, 1, "VALID", "conv_3")(y)
    y = self._bn("bn_3", train)(y)
    return nn.relu(shortcut + y)


class ResNet(layers.BatchNormBackbone):
  """Keras-layout bottleneck ResNet trunk; returns the last feature map.

  Attributes:
    stage_sizes: blocks per stage, e.g. ``(3, 4, 6, 3)`` for ResNet-50.
    bn_momentum: Flax-convention running-average momentum (Keras: 0.99).
    freeze_bn, bn_axis_name, dtype: see
      :class:`circle_jax.models.layers.BatchNormBackbone`.
  """

  stage_sizes: Sequence[int] = STAGE_SIZES["resnet50"]
  bn_momentum: float = 0.99

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    x = x.astype(self.dtype)
    x = nn.Conv(64, (7, 7), strides=(2, 2), padding=((3, 3), (3, 3)),
                dtype=self.dtype, param_dtype=jnp.float32,
                name="conv1_conv")(x)
    x = self.bn("conv1_bn", train, epsilon=KERAS_BN_EPSILON)(x)
    x = nn.relu(x)
    # Keras zero-pads before the max pool; after the ReLU (x >= 0) that equals
    # the -inf padding of nn.max_pool.
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for stage, num_blocks in enumerate(self.stage_sizes):
      filters = 64 * 2**stage
      for block in range(num_blocks):
        x = _Bottleneck(
            filters=filters,
            stride=2 if (block == 0 and stage > 0) else 1,
            project=block == 0,
            freeze_bn=self.freeze_bn,
            bn_momentum=self.bn_momentum,
            bn_axis_name=self.bn_axis_name,
            dtype=self.dtype,
            name=f"conv{stage + 2}_block{block + 1}",
        )(x, train=train)
    return x
