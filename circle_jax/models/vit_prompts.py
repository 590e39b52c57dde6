"""Visual prompt tuning and BitFit for :class:`circle_jax.models.ViT`.

What the ViT's ``num_prompts``, ``prompt_depth``, ``prompt_step``,
``head_norm`` and ``tune`` options mean (the ViT's docstring): how many
prompt tokens each block gets (:func:`prompt_counts`), their initialisation
(:func:`prompt_init`, the VPTSP-G code's), and which parameters train under a
``tune`` (:func:`trainable`), which the trainer's optimiser freezes
(:func:`circle_jax.models.frozen_module_paths`).

References:
  Jia, Tang, Chen, Cardie, Belongie, Hariharan, Lim, "Visual Prompt
  Tuning", ECCV 2022.
  Ben Zaken, Ravfogel, Goldberg, "BitFit: Simple Parameter-efficient
  Fine-tuning for Transformer-based Masked Language-models", ACL 2022.
  Ren, Chen, Wang, Hua, "Learning Semantic Proxies from Visual Prompts for
  Parameter-Efficient Fine-Tuning in Deep Metric Learning" (VPTSP-G), ICLR
  2024, github.com/Noahsark/ParameterEfficient-DML.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

TUNES = ("full", "bitfit", "prompt")
# Top-level parameters that no checkpoint has (the loader keeps their init).
ADDED = ("prompts", "head_norm")
# PyTorch's nn.LayerNorm default epsilon, the VPTSP-G code's new fc_norm.
HEAD_NORM_EPS = 1e-5


def prompt_counts(num_prompts: int, prompt_depth: Optional[int],
                  prompt_step: int, depth: int) -> Tuple[int, ...]:
  """Prompt tokens of each prompted block: ``max(num_prompts - i *
  prompt_step, 0)`` for block ``i`` below ``prompt_depth`` (all blocks when
  None); ``()`` without prompts."""
  if num_prompts <= 0:
    return ()
  n = depth if prompt_depth is None else min(int(prompt_depth), depth)
  return tuple(max(num_prompts - i * prompt_step, 0) for i in range(n))


def trainable(path: Sequence[str], tune: str) -> bool:
  """Whether the ViT parameter at ``path`` (keys under the backbone's
  params, e.g. ``('blocks_0', 'attn', 'qkv', 'bias')``) trains under
  ``tune`` (one of :data:`TUNES`): BitFit trains every parameter named
  ``bias`` (LayerNorm biases included, their scales not: the VPTSP-G code's
  ``'bias' in name``) besides the prompts and ``head_norm``."""
  if tune not in TUNES:
    raise ValueError(f"`tune` must be one of {', '.join(TUNES)}; got "
                     f"{tune!r}.")
  if tune == "full" or path[0] in ADDED:
    return True
  return tune == "bitfit" and path[-1] == "bias"


def prompt_init(key, shape, dtype=jnp.float32):
  """PyTorch's ``xavier_normal_`` of a ``[1, n, D]`` tensor (the VPTSP-G
  code's prompts): std ``sqrt(2 / ((n + 1) D))``."""
  _, n, d = shape
  return jax.random.normal(key, shape, dtype) * (2.0 / ((n + 1) * d)) ** 0.5


class Prompts(nn.Module):
  """The learned prompt tokens, ``layer_{i}`` of shape ``[1, n_i, D]``."""

  counts: Tuple[int, ...]
  width: int

  @nn.compact
  def __call__(self):
    return [self.param(f"layer_{i}", prompt_init, (1, n, self.width))
            if n else None for i, n in enumerate(self.counts)]
