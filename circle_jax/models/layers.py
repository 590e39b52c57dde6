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

import chex
import flax.linen as nn
import jax
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


class BatchNormBackbone(nn.Module):
  """The options every backbone with BatchNorm has, and its BatchNorm.

  A subclass declares ``bn_momentum``, the Flax-convention running-average
  momentum, with its own default (its place among the subclass's options is
  the backbone's, as ``--config.model.kwargs`` lists them).

  Attributes:
    freeze_bn: BatchNorm always in eval mode (:func:`batch_norm`).
    bn_axis_name: device axis to synchronise batch statistics over, or None.
    dtype: compute dtype of the convolutions.
  """

  freeze_bn: bool = False
  bn_axis_name: Optional[str] = None
  dtype: Any = jnp.float32

  def bn(self, name: str, train: bool, epsilon: float) -> nn.BatchNorm:
    """The :func:`batch_norm` layer ``name`` with this backbone's options."""
    return batch_norm(train=train, freeze_bn=self.freeze_bn, name=name,
                      momentum=self.bn_momentum, epsilon=epsilon,
                      dtype=self.dtype, axis_name=self.bn_axis_name)


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


def _same_pads(size: int, window: int) -> Tuple[int, int]:
  """``(low, high)`` padding of a stride-``window`` 'SAME' pooling."""
  total = -(-size // window) * window - size
  return total // 2, total - total // 2


def _blocks(x: Array, window: int) -> Array:
  """``[B, H, W, C]`` -> ``[B, H/k, W/k, C, k*k]``, window cells row-major."""
  b, h, w, c = x.shape
  k = window
  x = x.reshape(b, h // k, k, w // k, k, c)
  return x.transpose(0, 1, 3, 5, 2, 4).reshape(b, h // k, w // k, c, k * k)


def _index_dtype(window: int):
  return jnp.int8 if window * window <= 127 else jnp.int32


def _block_max(x: Array, window: int) -> Array:
  """Max over disjoint ``window x window`` blocks; ``H, W`` multiples of it."""
  return jnp.max(_blocks(x, window), axis=-1)


def _block_max_fwd(x, window):
  cells = _blocks(x, window)
  # The first maximal cell in row-major window order: the cell that
  # reduce_window's gradient (select_and_scatter with `>=`) picks on ties.
  first = jnp.argmax(cells, axis=-1).astype(_index_dtype(window))
  return jnp.max(cells, axis=-1), first


def _block_max_bwd(window, first, g):
  k = window
  b, ho, wo, c = first.shape
  onehot = first[..., None] == jnp.arange(k * k, dtype=first.dtype)
  cells = jnp.where(onehot, g[..., None], jnp.zeros((), g.dtype))
  dx = cells.reshape(b, ho, wo, c, k, k).transpose(0, 1, 4, 2, 5, 3)
  return (dx.reshape(b, ho * k, wo * k, c),)


_block_max = jax.custom_vjp(_block_max, nondiff_argnums=(1,))
_block_max.defvjp(_block_max_fwd, _block_max_bwd)


def max_pool_disjoint(x: Array, window: int, padding: str = "VALID") -> Array:
  """``window x window`` max pooling with stride ``window`` (disjoint windows).

  The same values and gradients as ``nn.max_pool(x, (k, k), strides=(k, k),
  padding=padding)``, including which cell of a window gets the gradient on
  ties (the first maximal cell in row-major order), written as a reshape and
  a reduction. XLA:CPU expands ``reduce_window``'s gradient into a variadic
  reduce-window over four int32 index maps and a scatter; on conv4 that was
  about 40 % of a training step (``experiments/bench/max_pool.py``).

  Args:
    x: ``[B, H, W, C]`` feature map.
    window: square window size, equal to the stride.
    padding: ``'VALID'`` (drops the last ``H mod k`` rows and columns) or
      ``'SAME'`` (``ceil(H / k)`` outputs; ``-inf`` padding split as
      ``lax.padtype_to_pads`` does, never the maximum).

  Returns:
    ``[B, H', W', C]``.
  """
  chex.assert_rank(x, 4, exception_type=ValueError,
                   custom_message="max_pool_disjoint expects [B, H, W, C].")
  if padding not in ("SAME", "VALID"):
    raise ValueError(f"padding must be 'SAME' or 'VALID'; got {padding!r}.")
  k = int(window)
  h, w = x.shape[1:3]
  if padding == "VALID":
    if min(h, w) < k:
      raise ValueError(f"A {k}x{k} 'VALID' max pool needs an input of at "
                       f"least {k}x{k}; got {h}x{w}.")
    x = x[:, :h - h % k, :w - w % k, :]
  else:
    pads = ((0, 0), _same_pads(h, k), _same_pads(w, k), (0, 0))
    if any(p for pair in pads for p in pair):
      x = jnp.pad(x, pads, constant_values=-jnp.inf)
  return _block_max(x, k)


def global_pool(x: Array, pooling: str) -> Array:
  """Global spatial pooling of a ``[B, H, W, C]`` map to ``[B, C]`` (float32).

  ``pooling='avg'`` is the mean over ``H, W``; ``'avg+max'`` is the mean plus
  the max (summed, as in the Proxy-Anchor code); ``'max'`` the max alone;
  ``'flatten'`` keeps every position, ``[B, H * W * C]`` (the spatial layout:
  Prototypical Networks flatten their conv4 output).
  """
  x = x.astype(jnp.float32)
  if pooling == "avg":
    return jnp.mean(x, axis=(1, 2))
  if pooling == "max":
    return jnp.max(x, axis=(1, 2))
  if pooling == "avg+max":
    return jnp.mean(x, axis=(1, 2)) + jnp.max(x, axis=(1, 2))
  if pooling == "flatten":
    return x.reshape(x.shape[0], -1)
  raise ValueError(
      f"`pooling` must be one of 'avg', 'max', 'avg+max', 'flatten'; got "
      f"{pooling!r}.")


POOLINGS: Sequence[str] = ("avg", "max", "avg+max", "flatten")
