"""Conv-4: four conv-BN-ReLU-max-pool blocks, the CPU-scale backbone.

The backbone of Matching Networks and Prototypical Networks for Omniglot: each
block is a 3x3 convolution with ``width`` channels, BatchNorm, ReLU and a 2x2
max pool. On 28x28 Omniglot images the output is 1x1x64 with
``pool_padding='VALID'`` (the original); the default ``'SAME'`` rounds the
pooled size up so that tiny inputs (the 8x8 scikit-learn digits) still give a
non-empty map (8 -> 4 -> 2 -> 1 -> 1).

References:
  Vinyals et al., "Matching Networks for One Shot Learning", NeurIPS 2016.
  Snell et al., "Prototypical Networks for Few-shot Learning", NeurIPS 2017.
"""

from __future__ import annotations


import flax.linen as nn
import jax
import jax.numpy as jnp

from circle_jax.models import layers


class Conv4(layers.BatchNormBackbone):
  """Four conv-BN-ReLU-pool blocks; returns a ``[B, h, w, width]`` map.

  Attributes:
    width: channels of every convolution (64 in the papers).
    num_blocks: number of blocks (4).
    pool_padding: ``'SAME'`` (ceil, works for any input size) or ``'VALID'``
      (floor, as the original PyTorch code).
    bn_momentum: Flax-convention running-average momentum.
    freeze_bn, bn_axis_name, dtype: see
      :class:`circle_jax.models.layers.BatchNormBackbone`.
  """

  width: int = 64
  num_blocks: int = 4
  pool_padding: str = "SAME"
  bn_momentum: float = 0.9

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
    if self.pool_padding not in ("SAME", "VALID"):
      raise ValueError(
          f"`pool_padding` must be 'SAME' or 'VALID'; got {self.pool_padding!r}.")
    x = x.astype(self.dtype)
    for i in range(self.num_blocks):
      x = nn.Conv(self.width, (3, 3), padding=((1, 1), (1, 1)),
                  dtype=self.dtype, param_dtype=jnp.float32,
                  name=f"block{i + 1}_conv")(x)
      x = self.bn(f"block{i + 1}_bn", train, epsilon=1e-5)(x)
      x = nn.relu(x)
      if min(x.shape[1:3]) < 2 and self.pool_padding == "VALID":
        raise ValueError(
            f"Conv4 block {i + 1} input is {x.shape[1]}x{x.shape[2]}, too small "
            "for a 2x2 'VALID' max pool; use larger images or "
            "pool_padding='SAME'.")
      # = nn.max_pool(x, (2, 2), strides=(2, 2), padding=...), values and
      # gradients, with a gradient XLA:CPU runs much faster.
      x = layers.max_pool_disjoint(x, 2, self.pool_padding)
    return x
