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


def prompt_init(rows: int, tokens: int):
  """PyTorch's ``xavier_normal_`` of the VPTSP-G code's ``[rows, tokens,
  D]`` prompt tensors (``rows`` 1 for the shared prompts, ``C`` for the class
  prompts; ``tokens`` the first block's count, of which deeper blocks use
  the first ``n_i``): std ``sqrt(2 / ((tokens + rows) D))``, for a
  parameter of any shape ``[..., D]``."""
  def init(key, shape, dtype=jnp.float32):
    std = (2.0 / ((tokens + rows) * shape[-1])) ** 0.5
    return jax.random.normal(key, shape, dtype) * std
  return init


class Prompts(nn.Module):
  """The learned prompt tokens, ``layer_{i}`` of shape ``[1, n_i, D]``."""

  counts: Tuple[int, ...]
  width: int

  @nn.compact
  def __call__(self):
    init = prompt_init(1, max(self.counts))
    return [self.param(f"layer_{i}", init, (1, n, self.width))
            if n else None for i, n in enumerate(self.counts)]
