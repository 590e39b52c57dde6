"""Embedding head and the backbone + head model returned by ``get_model``."""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from circle_jax.ops import l2_normalize
from circle_jax.models import layers

Array = jax.Array

# Kaiming-normal with fan_out, as the Proxy-Anchor code initialises its
# embedding layer (``nn.init.kaiming_normal_(w, mode='fan_out')``, bias 0).
default_embedding_init = nn.initializers.variance_scaling(
    2.0, "fan_out", "normal")


class EmbeddingHead(nn.Module):
  """Global pooling, a linear layer and (by default) L2 normalisation.

  .. math::
     z = W\\,\\mathrm{pool}(F) + b, \\qquad e = z / \\max(\\lVert z \\rVert_2,
     \\epsilon)

  where ``pool`` is the spatial mean (``'avg'``), max (``'max'``) or their sum
  (``'avg+max'``, Proxy-Anchor). Everything runs in float32 regardless of the
  backbone's compute dtype.

  Attributes:
    embedding_dim: output dimension ``D``.
    pooling: ``'avg'``, ``'max'`` or ``'avg+max'``.
    normalize: L2-normalise ``z`` (default); ``False`` returns ``z`` itself,
      for a loss geometry that maps raw features (the Poincaré ball's
      clipping and exponential map).
  """

  embedding_dim: int
  pooling: str = "avg"
  normalize: bool = True

  @nn.compact
  def __call__(self, features: Array) -> Array:
    """Maps a ``[B, H, W, C]`` feature map to ``[B, D]`` float32 (unit-norm
    with ``normalize``)."""
    pooled = layers.global_pool(features, self.pooling)
    z = nn.Dense(
        self.embedding_dim,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        kernel_init=default_embedding_init,
        bias_init=nn.initializers.zeros,
        name="embedding",
    )(pooled)
    return l2_normalize(z, axis=-1) if self.normalize else z


class EmbeddingModel(nn.Module):
  """A backbone followed by an :class:`EmbeddingHead`.

  Parameters are ``{'backbone': ..., 'head': {'embedding': ...}}`` so that an
  optimiser can treat the two groups differently (see
  :func:`circle_jax.models.param_labels`). BatchNorm statistics are in the
  ``batch_stats`` collection (under ``backbone``).

  Attributes:
    backbone: a module mapping ``(images, train=...)`` to ``[B, h, w, C]``.
    embedding_dim: output dimension ``D``.
    pooling: ``'avg'``, ``'max'`` or ``'avg+max'``.
    freeze_bn: whether the backbone was built with frozen BatchNorm (kept here
      so that the trainer can read it from the model).
    normalize: whether the head L2-normalises (:class:`EmbeddingHead`).
  """

  backbone: nn.Module
  embedding_dim: int
  pooling: str = "avg"
  freeze_bn: bool = False
  normalize: bool = True

  def setup(self):
    self.head = EmbeddingHead(self.embedding_dim, self.pooling,
                              self.normalize)

  def features(self, images: Array, *, train: bool, **kwargs) -> Array:
    """The backbone's ``[B, h, w, C]`` feature map (compute dtype);
    ``kwargs`` go to the backbone (a ViT's ``prompt_tokens``)."""
    return self.backbone(_check_images(images), train=train, **kwargs)

  def __call__(self, images: Array, *, train: bool) -> Array:
    """Embeds ``[B, H, W, C]`` images into ``[B, embedding_dim]`` float32.

    Args:
      images: ``[B, H, W, C]`` floating images, preprocessed as described by
        :func:`circle_jax.models.input_spec`.
      train: batch statistics (and their running-average update, with
        ``mutable=['batch_stats']``) when True and BatchNorm is not frozen.

    Returns:
      ``[B, embedding_dim]`` float32 embeddings of unit L2 norm.
    """
    return self.head(self.features(images, train=train))


def _check_images(images: Any) -> Array:
  images = jnp.asarray(images)
  chex.assert_rank(
      images, 4, exception_type=ValueError,
      custom_message="`images` must have rank 4 ([batch, height, width, "
                     "channels]); add a batch dimension with `images[None]`.")
  chex.assert_type(
      images, float, exception_type=TypeError,
      custom_message="`images` must be floating (float32 or bfloat16); "
                     "convert with `input_spec(name).apply(images)` or "
                     "`.astype(jnp.float32)`.")
  return images
