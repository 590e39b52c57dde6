"""Plugging a Flax NNX backbone into circle_jax's (linen) model and trainer.

The trainer works with linen-style ``(variables, images, train=...)``
functions. :func:`nnx_backbone` wraps an ``nnx.Module`` class with
``flax.nnx.bridge.ToLinen``, so that its parameters land in
``params['backbone']``, its ``nnx.BatchStat`` variables (``nnx.BatchNorm``'s
running statistics) in the ``batch_stats`` collection, and its ``nnx.Rngs``
draw from the trainer's per-step ``'dropout'`` key. Register it like any
other backbone::

  from circle_jax import models

  class MyNet(nnx.Module):
    def __init__(self, *, width, rngs: nnx.Rngs):
      self.conv = nnx.Conv(3, width, (3, 3), rngs=rngs)
      self.bn = nnx.BatchNorm(width, rngs=rngs)

    def __call__(self, x, *, train: bool):   # [B, H, W, C] -> [B, h, w, C']
      return nnx.relu(self.bn(self.conv(x), use_running_average=not train))

  models.MODELS["my_net"] = models.nnx_backbone(MyNet)
  # config: model.name = "my_net", model.kwargs.width = 32

The module's ``__call__`` takes the images and ``train`` (keyword) and
returns a ``[B, h, w, C]`` feature map or a ``[B, C]`` vector (treated as a
1 x 1 map), which :class:`circle_jax.models.EmbeddingHead` pools and embeds.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.linen as nn
from flax import nnx
from flax.core import FrozenDict


class NnxBackbone(nn.Module):
  """A linen backbone around an ``nnx.Module`` class (``ToLinen``).

  Attributes:
    module_cls: the NNX class, constructed as ``module_cls(**kwargs,
      rngs=nnx.Rngs(...))``.
    kwargs: its constructor arguments.
    freeze_bn, dtype, bn_momentum, bn_axis_name: the arguments every backbone
      of :data:`circle_jax.models.MODELS` receives; passed to the NNX class
      only when it names them in ``pass_options``.
    pass_options: which of those options the NNX class accepts.
  """

  module_cls: Callable[..., Any]
  kwargs: FrozenDict = FrozenDict()
  pass_options: tuple = ()
  freeze_bn: bool = False
  dtype: Any = None
  bn_momentum: float = 0.9
  bn_axis_name: Optional[str] = None

  @nn.compact
  def __call__(self, x, *, train: bool):
    kwargs = dict(self.kwargs)
    for name in self.pass_options:
      kwargs[name] = getattr(self, name)
    y = nnx.bridge.ToLinen(self.module_cls, kwargs=FrozenDict(kwargs),
                           name="nnx")(x, train=train)
    if y.ndim == 2:
      y = y[:, None, None, :]
    if y.ndim != 4:
      raise ValueError(
          f"The NNX backbone {self.module_cls.__name__} returned shape "
          f"{y.shape}; return [B, h, w, C] or [B, C].")
    return y


def nnx_backbone(module_cls: Callable[..., Any],
                 pass_options: tuple = ()) -> Callable[..., NnxBackbone]:
  """A :data:`circle_jax.models.MODELS` constructor for an NNX class.

  Args:
    module_cls: an ``nnx.Module`` class whose constructor takes keyword
      arguments and ``rngs``, and whose ``__call__(x, *, train)`` returns
      features.
    pass_options: names among ``freeze_bn``, ``dtype``, ``bn_momentum``,
      ``bn_axis_name`` that the class's constructor accepts.

  Returns:
    ``make(freeze_bn=..., dtype=..., **kwargs) -> NnxBackbone``.
  """
  def make(freeze_bn=False, dtype=None, bn_momentum=0.9, bn_axis_name=None,
           **kwargs):
    return NnxBackbone(module_cls=module_cls, kwargs=FrozenDict(kwargs),
                       pass_options=tuple(pass_options), freeze_bn=freeze_bn,
                       dtype=dtype, bn_momentum=bn_momentum,
                       bn_axis_name=bn_axis_name)
  return make
