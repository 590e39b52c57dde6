"""VPTSP-G's semantic proxies in the train step: a loss hook and its memory.

The step of Ren et al. (ICLR 2024) runs the ViT twice on the batch: once
with the shared visual prompts (the embeddings), and once with each image's
*class* prompts in their place (:class:`circle_jax.models.semantic_proxies.
SemanticProxyNet`); the second pass's class tokens, through the proxy head,
update the rows of the batch's classes in a ``[C, E]`` memory of semantic
proxies ``H`` with a GRU, and the loss
(:func:`circle_jax.losses.vptsp.vptsp_proxy_anchor_loss`) mixes ``H`` with
the learned proxies. :class:`SemanticHook` is that second pass as the
step's loss hook (``extra`` of :func:`circle_jax.train.step.make_loss_fn`):
it returns ``{'semantic_proxies': H}`` for the loss (with gradient into the
class prompts, the proxy head, the GRU and the ViT's trained parameters)
and ``H`` without gradient as the new memory, carried in the train state's
``loss_state`` (saved with the checkpoint, as the cross-batch memory is).

Where things live: the semantic branch's parameters under
``params['loss']['semantic']`` (:data:`PARAMS`; the official code trains
them at the backbone's rate, so recipes give ``'loss/semantic'`` the
multiplier 1 beside the learned proxies' ``'loss'``), its settings in
``config.semantic_proxies``, and the batch must come as runs of
``batch.images_per_class`` images of one class, distinct classes in the
global batch (the ``pk`` sampler).

Several devices: each device runs the class-prompt pass on its own images,
then the proxy features and labels of the global batch are gathered
(:func:`gather_rows`) and every device runs the same GRU update on them, so
every device holds the same memory, equal to one device's on the global
batch, and each device's features get the whole gradient of the loss. The
official code runs on one GPU; the GRU's dropout mask
(``config.semantic_proxies.dropout``) is drawn from the step's loss key, the
same on every device.

References:
  Ren, Chen, Wang, Hua, "Learning Semantic Proxies from Visual Prompts for
  Parameter-Efficient Fine-Tuning in Deep Metric Learning", ICLR 2024;
  code: github.com/Noahsark/ParameterEfficient-DML
  (``architectures/peft_vit.py``: ``forward``, ``forward_proxy_mix_bias``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from circle_jax import models as models_lib
from circle_jax.models import semantic_proxies as semantic_lib
from circle_jax.train import config_checks

Array = jax.Array
# The losses that take semantic proxies, and where the branch's parameters
# lie in params['loss'].
LOSSES = ("vptsp_proxy_anchor",)
PARAMS = "semantic"


def semantic_proxies(net, net_params, apply_fn, model_params, images: Array,
                     labels: Array, memory: Array, *, k: int,
                     dropout: float = 0.0, key: Optional[Array] = None,
                     dropout_key: Optional[Array] = None, axis_name=None):
  """The semantic proxies ``H`` of this step (module docstring).

  Args:
    net: the :class:`circle_jax.models.semantic_proxies.SemanticProxyNet`.
    net_params: its parameters.
    apply_fn: the embedding model's ``apply`` (a ViT backbone).
    model_params: ``params['model']``.
    images: ``[b, H, W, C]`` this device's images.
    labels: ``[b]`` their labels, runs of ``k`` per class.
    memory: ``[C, E]`` the semantic proxies of the last step.
    k: images per class.
    dropout: the GRU's dropout rate, drawn with ``key``.
    key: the GRU's dropout key (the same on every device).
    dropout_key: the ViT's dropout key for the class-prompt pass.
    axis_name: the device axis (None on one device).

  Returns:
    ``H [C, E]`` float32 unit rows, carrying gradient.
  """
  variables = {"params": net_params}
  tokens = net.apply(variables, labels, method="prompt_tokens")
  pooled = apply_fn({"params": model_params}, images, train=True,
                    prompt_tokens=tokens, method="features",
                    rngs={} if dropout_key is None else
                    {"dropout": dropout_key})
  features = net.apply(variables, pooled.reshape(pooled.shape[0], -1),
                       method="features")
  if axis_name is not None:  # the global batch, in device order
    features, labels = (gather_rows(x, axis_name) for x in (features, labels))
  new, _ = net.apply(variables, features, labels, memory, k=k,
                     dropout=dropout, key=key if dropout else None,
                     method="mix")
  return new


def gather_rows(x: Array, axis_name) -> Array:
  """The devices' ``x`` ``[b, ...]`` stacked in device order, ``[n b, ...]``,
  the same on every device.

  A ``psum`` of zero-padded copies rather than an ``all_gather``: its
  result is device-invariant in ``shard_map``'s types (so the memory made
  from it is replicated), and its transpose hands each device the whole
  gradient of its rows under both wrappers (``shard_map`` sums the
  replicated result's cotangent where the loss meets the device's
  embeddings; under ``pmap`` the ``psum`` transposes to a ``psum`` of the
  devices' partial cotangents). Adding zeros is exact.
  """
  b = x.shape[0]
  full = jnp.zeros((jax.lax.axis_size(axis_name) * b,) + x.shape[1:],
                   x.dtype)
  full = jax.lax.dynamic_update_slice_in_dim(
      full, x, jax.lax.axis_index(axis_name) * b, 0)
  return jax.lax.psum(full, axis_name)


@dataclasses.dataclass(frozen=True)
class SemanticHook:
  """The step's loss hook for VPTSP-G (module docstring).

  Attributes:
    net: the :class:`circle_jax.models.semantic_proxies.SemanticProxyNet`.
    k: images per class of the batch.
    dropout: the GRU's dropout rate (the code's ``rnn_dropout``).
  """

  net: Any
  k: int
  dropout: float = 0.0

  def init(self, key: Array):
    """``(parameters, memory [C, E])`` at step 0: the memory's rows are
    the normalised xavier-uniform rows of the official code."""
    k_net, k_mem = jax.random.split(key)
    c, e = self.net.num_classes, self.net.embedding_dim
    limit = (6.0 / (c + e)) ** 0.5
    memory = jax.random.uniform(k_mem, (c, e), jnp.float32, -limit, limit)
    memory = memory / jnp.linalg.norm(memory, axis=-1, keepdims=True)
    params = self.net.init(k_net, jnp.zeros((self.k, self.net.width)),
                           jnp.zeros((self.k,), jnp.int32), memory,
                           k=self.k)["params"]
    return params, memory

  def __call__(self, params, loss_state, batch, *, apply_fn, key,
               dropout_key=None, axis_name=None):
    """``({'semantic_proxies': H}, H without gradient)``."""
    h = semantic_proxies(
        self.net, params["loss"][PARAMS], apply_fn, params["model"],
        batch["image"], batch["label"], loss_state, k=self.k,
        dropout=self.dropout, key=jax.random.fold_in(key, 2),
        dropout_key=dropout_key, axis_name=axis_name)
    return {"semantic_proxies": h}, jax.lax.stop_gradient(h)


def from_config(config, model, num_classes: int) -> Optional[SemanticHook]:
  """The hook of ``config.semantic_proxies`` when ``config.loss.name`` takes
  semantic proxies (:data:`LOSSES`), else None.

  Raises:
    ConfigError: the model is not a ViT (the class prompts enter its blocks).
  """
  if config.loss.name not in LOSSES:
    return None
  backbone = getattr(model, "backbone", None)
  if not isinstance(backbone, models_lib.ViT) or backbone.remat:
    raise config_checks.ConfigError(
        f"config.model.name: loss {config.loss.name!r} passes class prompts "
        f"through a ViT's blocks; use a vit_* model with remat=False (got "
        f"{config.model.name!r}).")
  if config.batch.sampler != "pk":
    raise config_checks.ConfigError(
        f"config.batch.sampler: loss {config.loss.name!r} updates each "
        "class's semantic proxy from a run of batch.images_per_class images "
        f"of that class; use 'pk' (got {config.batch.sampler!r}).")
  s = config.semantic_proxies
  if s.prompt_depth > backbone.depth:
    raise config_checks.ConfigError(
        f"config.semantic_proxies.prompt_depth: {s.prompt_depth} blocks of "
        f"class prompts in a ViT of {backbone.depth} blocks; use at most "
        f"{backbone.depth}.")
  net = semantic_lib.SemanticProxyNet(
      num_classes=num_classes, width=backbone.width,
      embedding_dim=config.model.embedding_dim, num_prompts=s.num_prompts,
      prompt_depth=s.prompt_depth,
      prompt_step=s.prompt_step, gru=s.gru)
  return SemanticHook(net, k=config.batch.images_per_class,
                      dropout=float(s.dropout))
