"""Small layers shared by the backbones: BatchNorm with freezing, pooling.

Conventions (all models in :mod:`circle_jax.models`):

* Images and feature maps are NHWC (``[batch, height, width, channels]``).
* ``dtype`` is the *compute* dtype of convolutions (e.g. ``jnp.bfloat16`` for
  mixed precision); parameters are always stored in float32, and BatchNorm
  statistics are always computed in float32.
* BatchNorm statistics live in the ``batch_stats`` collection. A BatchNorm uses
  its running averages when ``train=False`` *or* when the model was built with
  ``freeze_bn=True`` (see :func:`circle_jax.models.frozen_bn_paths` for the
  matching optimiser side: frozen affine parameters).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax.numpy as jnp

Array = Any


def batch_norm(
    *,
    train: bool,
    freeze_bn: bool,
    name: str,
    momentum: float,
    epsilon: float,
    dtype: Any,
    axis_name: Optional[str] = None,
) -> nn.BatchNorm:
  """A BatchNorm in eval mode when ``not train`` or ``freeze_bn``.

  ``momentum`` follows the Flax/Keras convention (weight of the *old* running
  value): PyTorch's ``momentum=0.1`` is Flax's ``momentum=0.9``.
  ``axis_name`` synchronises the batch statistics over a named device axis
  (SyncBN); ``None`` keeps per-device statistics as PyTorch ``DataParallel``
  does.
  """
  return nn.BatchNorm(
      use_running_average=(not train) or freeze_bn,
      momentum=momentum,
      epsilon=epsilon,
      dtype=dtype,
      param_dtype=jnp.float32,
      axis_name=axis_name if (train and not freeze_bn) else None,
      name=name,
  )


def ceil_pool_size(size: int, window: int, stride: int, pad: int) -> int:
  """Output size of a PyTorch ``ceil_mode=True`` pooling along one dimension.

  ``out = ceil((size + 2 pad - window) / stride) + 1``, minus one if the last
  window would start inside the right padding (``(out - 1) stride >= size +
  pad``), exactly as ``torch.nn.MaxPool2d`` / ``AvgPool2d``.
  """
  if size + 2 * pad < window:
    raise ValueError(
        f"Pooling window {window} does not fit a spatial size {size} with "
        f"padding {pad}; use larger input images."
    )
  out = -(-(size + 2 * pad - window) // stride) + 1
  if (out - 1) * stride >= size + pad:
    out -= 1
  return out


def max_pool_ceil(x: Array, window: int, stride: int, pad: int = 0) -> Array:
  """Max pooling as PyTorch's ``MaxPool2d(window, stride, pad, ceil_mode=True)``.

  Padded cells are ``-inf`` and never win the max.

  Args:
    x: ``[B, H, W, C]`` feature map.
    window: square window size.
    stride: stride in both spatial dims.
    pad: symmetric implicit padding.

  Returns:
    ``[B, H', W', C]`` with ``H' = ceil_pool_size(H, window, stride, pad)``.
  """
  outs = [ceil_pool_size(s, window, stride, pad) for s in x.shape[1:3]]
  # Right padding so that a VALID pooling covers exactly `out` windows (it may
  # produce fewer rows than needed only if `high` < 0, handled by the slice).
  padding = tuple(
      (pad, max((o - 1) * stride + window - s - pad, 0))
      for o, s in zip(outs, x.shape[1:3]))
  y = nn.max_pool(x, (window, window), strides=(stride, stride),
                  padding=padding)
  return y[:, :outs[0], :outs[1], :]


def global_pool(x: Array, pooling: str) -> Array:
  """Global spatial pooling of a ``[B, H, W, C]`` map to ``[B, C]`` (float32).

  ``pooling='avg'`` is the mean over ``H, W``; ``'avg+max'`` is the mean plus
  the max (summed, as in the Proxy-Anchor code); ``'max'`` the max alone.
  """
  x = x.astype(jnp.float32)
  if pooling == "avg":
    return jnp.mean(x, axis=(1, 2))
  if pooling == "max":
    return jnp.max(x, axis=(1, 2))
  if pooling == "avg+max":
    return jnp.mean(x, axis=(1, 2)) + jnp.max(x, axis=(1, 2))
  raise ValueError(
      f"`pooling` must be one of 'avg', 'max', 'avg+max'; got {pooling!r}.")


POOLINGS: Sequence[str] = ("avg", "max", "avg+max")
