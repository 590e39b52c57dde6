"""Flax backbones and embedding heads for deep metric learning.

``get_model(name, embedding_dim=...)`` returns an :class:`EmbeddingModel`:
``model.apply(variables, images, train=...)`` maps ``[B, H, W, C]`` images to
``[B, embedding_dim]`` unit-norm float32 embeddings. Variables are::

  {'params':      {'backbone': ..., 'head': {'embedding': {kernel, bias}}},
   'batch_stats': {'backbone': ...}}

Training: ``model.apply(variables, x, train=True, mutable=['batch_stats'])``.
Optimiser groups: :func:`param_labels` (``'backbone'``, ``'head'`` and, with
``freeze_bn``, ``'frozen'`` for BatchNorm scale/bias) for
``optax.multi_transform``. Pretrained trunks: :func:`load_keras_resnet50`,
:func:`load_bn_inception` and :func:`replace_backbone`. Input preprocessing:
:func:`input_spec`. See ``docs/models.md``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import (Any, Callable, Dict, FrozenSet, NamedTuple, Optional,
                    Tuple)

import chex
import flax
import jax.numpy as jnp
import numpy as np

from circle_jax.models import layers
from circle_jax.models.bn_inception import BNInception
from circle_jax.models.conv4 import Conv4
from circle_jax.models.convert import adapt_input_channels
from circle_jax.models.convert import ConversionError
from circle_jax.models.convert import convert_bn_inception
from circle_jax.models.convert import convert_keras_resnet
from circle_jax.models.convert import load_bn_inception
from circle_jax.models.convert import load_keras_resnet
from circle_jax.models.convert import load_keras_resnet50
from circle_jax.models.convert import load_state_dict
from circle_jax.models.convert import replace_backbone
from circle_jax.models.head import EmbeddingHead
from circle_jax.models.head import EmbeddingModel
from circle_jax.models.resnet import ResNet
from circle_jax.models.resnet import STAGE_SIZES
# ViT backbones and their timm weights (issue: Vision Transformer backbones).
from circle_jax.models import vit_prompts
from circle_jax.models.vit import FAMILIES as VIT_FAMILIES
from circle_jax.models.vit import ViT
from circle_jax.models.vit import vit_options
from circle_jax.models.vit_weights import load_timm_vit
from circle_jax.models.nnx_backbone import NnxBackbone
from circle_jax.models.nnx_backbone import nnx_backbone

__all__ = [
    "BNInception", "Conv4", "ConversionError", "EmbeddingHead",
    "adapt_input_channels",
    "EmbeddingModel", "InputSpec", "MODELS", "ResNet", "backbone_defaults",
    "check_input", "convert_bn_inception",
    "convert_keras_resnet", "frozen_bn_paths", "get_model", "input_spec",
    "load_bn_inception", "load_keras_resnet", "load_keras_resnet50",
    "load_state_dict", "param_labels", "replace_backbone",
    "VIT_FAMILIES", "ViT", "load_timm_vit", "vit_options", "NnxBackbone",
    "nnx_backbone",
]


def _resnet(depth):
  def make(**kw):
    return ResNet(stage_sizes=STAGE_SIZES[f"resnet{depth}"], **kw)
  return make


def _vit(size, patch):
  def make(family="augreg", image_size=224, **kw):
    return ViT(**vit_options(size, patch, family, image_size, **kw))
  return make


# name -> backbone constructor (keyword arguments: freeze_bn, dtype, ...).
MODELS: Dict[str, Callable[..., Any]] = {
    "conv4": Conv4,
    "resnet50": _resnet(50),
    "resnet101": _resnet(101),
    "resnet152": _resnet(152),
    "bn_inception": BNInception,
    # ViTs: kwargs family (VIT_FAMILIES), image_size (sets the position grid),
    # and any ViT attribute (depth, pool, drop_path, remat, ...).
    **{f"vit_{size}{patch}": _vit(size, patch)
       for size in ("ti", "s", "b", "l") for patch in (16, 14)},
}


def get_model(name: str, *, embedding_dim: int, pooling: str = "avg",
              freeze_bn: bool = False, dtype: Any = jnp.float32,
              normalize: bool = True, **kw) -> EmbeddingModel:
  """Builds a backbone + embedding head.

  Args:
    name: one of :data:`MODELS` (``conv4``, ``resnet50``, ``resnet101``,
      ``resnet152``, ``bn_inception``).
    embedding_dim: output dimension (positive int).
    pooling: global pooling of the head, ``'avg'``, ``'max'`` or ``'avg+max'``
      (sum of both, the Proxy-Anchor head).
    freeze_bn: BatchNorm layers always use their running statistics, and
      :func:`param_labels` marks their scale/bias ``'frozen'`` (the MS and
      Proxy-Anchor codes' ``bn_freeze``).
    dtype: compute dtype of the backbone's convolutions (``jnp.bfloat16`` for
      mixed precision). Parameters, BatchNorm statistics, the head and the
      output stay float32.
    normalize: the head L2-normalises the embeddings (default); ``False``
      for a loss geometry that takes raw features (Poincaré).
    **kw: backbone options: ``bn_momentum`` (Flax convention),
      ``bn_axis_name`` (synchronised BatchNorm over a device axis); for
      ``conv4`` also ``width``, ``num_blocks``, ``pool_padding``; for the
      ``vit_*`` models ``family`` (a key of :data:`VIT_FAMILIES`),
      ``image_size`` and any :class:`ViT` attribute.

  Returns:
    An :class:`EmbeddingModel`; call it as ``model.apply(variables, images,
    train=...)``.
  """
  if name not in MODELS:
    raise ValueError(
        f"Unknown model {name!r}; known models: {', '.join(sorted(MODELS))}.")
  if (isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int)
      or embedding_dim <= 0):
    raise ValueError(
        f"`embedding_dim` must be a positive int; got {embedding_dim!r}.")
  if pooling not in layers.POOLINGS:
    raise ValueError(
        f"`pooling` must be one of {', '.join(layers.POOLINGS)}; got "
        f"{pooling!r}.")
  try:
    backbone = MODELS[name](freeze_bn=freeze_bn, dtype=dtype, **kw)
  except TypeError as e:
    raise TypeError(f"Bad option for model {name!r}: {e}") from None
  return EmbeddingModel(backbone=backbone, embedding_dim=embedding_dim,
                        pooling=pooling, freeze_bn=freeze_bn,
                        normalize=bool(normalize))


# Backbone fields that are not ``model.kwargs`` options: set from other
# config fields (freeze_bn, dtype, sync_bn), by the model name (ResNet's
# depth) or by Flax.
_NOT_OPTIONS = ("parent", "name", "freeze_bn", "dtype", "stage_sizes",
                "bn_axis_name")


def backbone_defaults(name: str) -> Dict[str, Any]:
  """The options (``model.kwargs``) of model ``name``'s backbone, with their
  defaults: what ``--config.model.name=NAME`` starts from."""
  backbone = MODELS[name]()
  return {f.name: getattr(backbone, f.name)
          for f in dataclasses.fields(backbone)
          if f.init and f.name not in _NOT_OPTIONS}


def check_input(name: str, kwargs: Dict[str, Any],
                image_shape: Tuple[int, int]) -> Optional[Tuple[str, str]]:
  """Whether model ``name`` with options ``kwargs`` can take these images.

  Checked before anything is built, so that a config that cannot run fails
  in one line instead of a traceback from inside the traced model. A
  backbone declares what images it takes with an ``input_problem(height,
  width)`` method returning the reason it cannot ("" if it can).

  Args:
    name: one of :data:`MODELS`.
    kwargs: the backbone options (``config.model.kwargs``).
    image_shape: ``(height, width)`` of the images the model will see.

  Returns:
    None if it can, else ``(config field, message)``: an option the backbone
    does not have (``model.kwargs.<option>``), or images it cannot take
    (``model.name``); the message says what to do.
  """
  try:
    backbone = MODELS[name](**kwargs)
  except TypeError as e:
    m = re.search(r"keyword argument '(\w+)'", str(e))
    option = m.group(1) if m else ""
    field = f"model.kwargs.{option}" if option else "model.kwargs"
    return field, (
        f"model {name!r} has no option {option or str(e)!r}; its options "
        f"are {sorted(backbone_defaults(name))} (give them as "
        "--config.model.kwargs.OPTION=VALUE).")
  problem = getattr(backbone, "input_problem", None)
  reason = problem(*image_shape) if problem is not None else ""
  if reason:
    h, w = image_shape
    return "model.name", (
        f"model {name!r} cannot take the {h}x{w} images of this config: "
        f"{reason} (--config.dataset.preprocess.image_size), or choose "
        "another model.")
  return None


class InputSpec(NamedTuple):
  """How a backbone expects its pixels (what its pretrained weights saw).

  Attributes:
    channel_order: ``'RGB'`` or ``'BGR'``.
    scale: pixels are first mapped from [0, 255] to [0, ``scale``].
    mean: per-channel mean subtracted after scaling (in ``channel_order``).
    std: per-channel divisor applied after the mean.
  """

  channel_order: str
  scale: float
  mean: Tuple[float, ...]
  std: Tuple[float, ...]

  def apply(self, images):
    """Maps RGB images with values in [0, 255] (uint8 or float) to inputs.

    Args:
      images: ``[..., H, W, C]`` RGB; C must be 3 for a BGR spec.

    Returns:
      float32 ``(flip(images) * scale / 255 - mean) / std``.
    """
    x = jnp.asarray(images).astype(jnp.float32)
    if self.channel_order == "BGR":
      chex.assert_axis_dimension(
          x, -1, 3, exception_type=ValueError,
          custom_message="A BGR input spec needs 3-channel RGB images; tile "
                         "grayscale images to 3 channels first.")
      x = x[..., ::-1]
    x = x * (self.scale / 255.0)
    return (x - jnp.asarray(self.mean, jnp.float32)) / jnp.asarray(
        self.std, jnp.float32)


_INPUT_SPECS = {
    "conv4": InputSpec("RGB", 1.0, (0.0,), (1.0,)),
    # keras.applications.resnet.preprocess_input ("caffe" mode).
    "resnet": InputSpec("BGR", 255.0, (103.939, 116.779, 123.68),
                        (1.0, 1.0, 1.0)),
    # pretrainedmodels' bninception settings.
    "bn_inception": InputSpec("BGR", 255.0, (104.0, 117.0, 128.0),
                              (1.0, 1.0, 1.0)),
    # ViT families (VIT_FAMILIES[family].preprocess).
    "imagenet": InputSpec("RGB", 1.0, (0.485, 0.456, 0.406),
                          (0.229, 0.224, 0.225)),
    "clip": InputSpec("RGB", 1.0, (0.48145466, 0.4578275, 0.40821073),
                      (0.26862954, 0.26130258, 0.27577711)),
    "inception": InputSpec("RGB", 1.0, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}


def input_spec(name: str, family: str = "augreg") -> InputSpec:
  """The :class:`InputSpec` of model ``name`` (that of its ImageNet weights;
  for a ``vit_*`` model, that of its checkpoint ``family``)."""
  if name not in MODELS:
    raise ValueError(
        f"Unknown model {name!r}; known models: {', '.join(sorted(MODELS))}.")
  if name.startswith("vit_"):
    if family not in VIT_FAMILIES:
      raise ValueError(f"Unknown ViT family {family!r}; known families: "
                       f"{', '.join(VIT_FAMILIES)}.")
    return _INPUT_SPECS[VIT_FAMILIES[family].preprocess]
  return _INPUT_SPECS["resnet" if name.startswith("resnet") else name]


def frozen_bn_paths(variables) -> FrozenSet[Tuple[str, ...]]:
  """Paths into ``variables['params']`` of every BatchNorm scale and bias.

  A BatchNorm is recognised by its entry in ``batch_stats`` (whatever the
  architecture), so the set is exactly the affine parameters that
  ``freeze_bn`` must keep fixed.

  Args:
    variables: ``{'params': ..., 'batch_stats': ...}`` (e.g. ``model.init``'s
      result or ``jax.eval_shape`` of it).

  Returns:
    A frozenset of key tuples such as ``('backbone', 'conv1_bn', 'scale')``.
  """
  if "params" not in variables or "batch_stats" not in variables:
    raise ValueError(
        "`variables` must hold 'params' and 'batch_stats' (the result of "
        "model.init); got keys " + str(sorted(variables)))
  params = flax.traverse_util.flatten_dict(variables["params"])
  stats = flax.traverse_util.flatten_dict(variables["batch_stats"])
  modules = {p[:-1] for p in stats}
  return frozenset(p for p in params if p[:-1] in modules)


def frozen_module_paths(variables, kwargs) -> FrozenSet[Tuple[str, ...]]:
  """Paths into ``variables['params']`` of the modules a backbone option
  freezes: the ViT's patch projection under ``frozen_patch_embed`` (Hyp-ViT
  trains with it fixed, as PyTorch's ``requires_grad=False``: no step, no
  weight decay, no optimiser moments), and under ``tune='bitfit'`` or
  ``'prompt'`` every ViT parameter that :func:`circle_jax.models.vit.
  trainable` does not train.

  Args:
    variables: ``{'params': ...}`` (``model.init``'s result).
    kwargs: the backbone options (``config.model.kwargs``).

  Returns:
    A frozenset of key tuples such as ``('backbone', 'patch_embed', 'kernel')``.
  """
  kwargs = dict(kwargs)
  tune = kwargs.get("tune", "full")
  if not kwargs.get("frozen_patch_embed", False) and tune == "full":
    return frozenset()
  params = flax.traverse_util.flatten_dict(variables["params"])
  frozen = set()
  if kwargs.get("frozen_patch_embed", False):
    frozen |= {p for p in params
               if len(p) > 2 and p[:2] == ("backbone", "patch_embed")}
  if tune != "full":  # The ViT's prompt tuning / BitFit (vit.trainable).
    frozen |= {p for p in params if p[0] == "backbone"
               and not vit_prompts.trainable(p[1:], tune)}
  return frozenset(frozen)


def param_labels(variables, *, freeze_bn: bool):
  """Optimiser group of every parameter, for ``optax.multi_transform``.

  Labels: ``'head'`` under ``params['head']``, ``'backbone'`` under
  ``params['backbone']``, and ``'frozen'`` for BatchNorm scale/bias when
  ``freeze_bn`` (map it to ``optax.set_to_zero()`` so that neither the
  gradient nor weight decay moves them)::

    tx = optax.multi_transform(
        {'backbone': optax.adamw(lr), 'head': optax.adamw(10 * lr),
         'frozen': optax.set_to_zero()},
        param_labels(variables, freeze_bn=model.freeze_bn))

  Args:
    variables: ``{'params', 'batch_stats'}`` of an :class:`EmbeddingModel`.
    freeze_bn: whether BatchNorm affine parameters are frozen.

  Returns:
    A pytree with the structure of ``variables['params']`` and string leaves.
  """
  frozen = frozen_bn_paths(variables) if freeze_bn else frozenset()
  flat = flax.traverse_util.flatten_dict(variables["params"])
  labels = {}
  for path in flat:
    if path[0] not in ("backbone", "head"):
      raise ValueError(
          f"Parameter {'/'.join(path)} is neither under 'backbone' nor "
          "'head'; param_labels expects an EmbeddingModel's params.")
    labels[path] = "frozen" if path in frozen else path[0]
  return flax.traverse_util.unflatten_dict(labels)
