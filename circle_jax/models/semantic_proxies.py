"""VPTSP-G's semantic proxies: class prompts through the frozen ViT, a GRU mix.

Ren et al.'s proxies carry the image semantics of their class. Each class
``c`` owns prompt tokens ``P_c^i`` (``[n_i, D]`` for block ``i`` below
``prompt_depth``). In a training step every image ``x_b`` of class ``y_b`` is
passed once more through the same (frozen, BitFit-tuned) ViT with the class
prompts ``P_{y_b}`` in place of the shared prompts (:class:`circle_jax.models.
ViT`'s ``prompt_tokens``); its class token goes through a head of its own
(a new LayerNorm and a linear layer) and is L2-normalised, giving ``p_b``.
The ``k`` features ``p`` of a class's samples then update that class's row
``h_c`` of a memory of semantic proxies ``H`` (``[C, E]``, unit rows, not a
parameter) with a GRU cell, one sample after the other (the "G" of
VPTSP-G)::

  z = sigmoid(p W_iz + h W_hz + b_iz)
  r = sigmoid(p W_ir + h W_hr + b_ir)
  n = relu(p W_in + r * (h W_hn) + b_in)          # 'gru': tanh
  h = (1 - z) * n + z * h

and ``H`` is re-normalised. The loss mixes ``H`` with the learned proxies
(:func:`circle_jax.losses.vptsp.vptsp_proxy_anchor_loss`); the gradient
reaches the class prompts, the proxy head, the GRU and the ViT's biases
through the rows of this batch's classes, while ``H`` itself is carried
from step to step without gradient (the official code's ``detach``).

Batch layout: the ``B = m k`` samples come as ``m`` runs of ``k`` consecutive
samples of one class each (the official ``random_class`` sampler's order),
with ``m`` distinct classes; :func:`class_runs` reads the class of each run.

The official code differs in nothing this module computes; it gathers the
class prompts of ``B`` samples from a CPU memory bank on SOP and In-Shop
(``prompt_memory_bank``, a memory saving that does not change the maths)
and draws the GRU's dropout (``rnn_dropout``) on the updated rows, which
:func:`gru_mix` takes as ``dropout`` with a key.

References:
  Ren, Chen, Wang, Hua, "Learning Semantic Proxies from Visual Prompts for
  Parameter-Efficient Fine-Tuning in Deep Metric Learning", ICLR 2024;
  code: github.com/Noahsark/ParameterEfficient-DML
  (``architectures/peft_vit.py``: ``forward_proxy_mix_bias``,
  ``_semantic_mix_with_container``, ``Simple_GRUCell``).
  Cho et al., "Learning Phrase Representations using RNN Encoder-Decoder for
  Statistical Machine Translation" (the GRU), EMNLP 2014.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from circle_jax.models import vit_prompts

Array = jax.Array
GRU_TYPES = ("gru", "gru_relu")


def class_runs(labels: Array, k: int) -> Array:
  """The class of each run of ``k`` consecutive samples, ``[B // k]``."""
  if labels.ndim != 1 or labels.shape[0] % k:
    raise ValueError(f"`labels` must be [B] with B a multiple of k = {k} "
                     f"(runs of k samples per class); got {labels.shape}.")
  return labels[::k]


class SemanticProxyNet(nn.Module):
  """Class prompts, the proxy head and the GRU cell of VPTSP-G.

  Attributes:
    num_classes: ``C``.
    width: the ViT's token dimension ``D``.
    embedding_dim: ``E``.
    num_prompts: class prompt tokens of the first block (``num_p_prompt``).
    prompt_depth: blocks that get class prompts (``p_prompt_depth``).
    prompt_step: each next block gets this many fewer (``prompt_p_block_step``).
    gru: ``'gru_relu'`` (the official configs') or ``'gru'`` (tanh).
  """

  num_classes: int
  width: int
  embedding_dim: int
  num_prompts: int = 3
  prompt_depth: int = 12
  prompt_step: int = 0
  gru: str = "gru_relu"

  def setup(self):
    if self.gru not in GRU_TYPES:
      raise ValueError(f"`gru` must be one of {', '.join(GRU_TYPES)}; got "
                       f"{self.gru!r}.")
    counts = vit_prompts.prompt_counts(self.num_prompts, self.prompt_depth,
                                       self.prompt_step, self.prompt_depth)
    init = vit_prompts.prompt_init(self.num_classes, self.num_prompts)
    self.prompts = [
        self.param(f"prompts_{i}", init, (self.num_classes, n, self.width))
        if n else None for i, n in enumerate(counts)]
    self.head_norm = nn.LayerNorm(epsilon=vit_prompts.HEAD_NORM_EPS,
                                  param_dtype=jnp.float32)
    self.head = nn.Dense(self.embedding_dim, param_dtype=jnp.float32,
                         kernel_init=nn.initializers.xavier_uniform())
    e = self.embedding_dim
    glorot = nn.initializers.xavier_uniform()
    self.gru_w = {g: (self.param(f"W_i{g}", glorot, (e, e)),
                      self.param(f"W_h{g}", glorot, (e, e)),
                      self.param(f"b_i{g}", nn.initializers.zeros, (e,)))
                  for g in "rzn"}

  def prompt_tokens(self, labels: Array) -> List[Optional[Array]]:
    """Per-block ``[B, n_i, D]`` class prompts of ``labels`` ``[B]``, for
    :class:`circle_jax.models.ViT`'s ``prompt_tokens``."""
    empty = jnp.zeros((labels.shape[0], 0, self.width))
    return [empty if p is None else p[labels] for p in self.prompts]

  def features(self, tokens: Array) -> Array:
    """``p = normalize(head(LN(cls)))`` of the ViT's pooled ``[B, D]``
    class tokens (the ViT without its own ``head_norm``)."""
    return _l2n(self.head(self.head_norm(tokens.astype(jnp.float32))))

  def mix(self, features: Array, labels: Array, memory: Array, *, k: int,
          dropout: float = 0.0, key: Optional[Array] = None
          ) -> Tuple[Array, Array]:
    """The GRU update of ``memory`` ``[C, E]`` by ``features`` ``[B, E]``.

    Returns:
      ``(new_memory [C, E], classes [B // k])``: the re-normalised memory
      whose rows ``classes`` are the GRU's outputs (carrying gradient).
    """
    return gru_mix(features, labels, memory, self.gru_w, k=k, relu=(
        self.gru == "gru_relu"), dropout=dropout, key=key)

  def __call__(self, tokens: Array, labels: Array, memory: Array, *, k: int):
    """:meth:`mix` of :meth:`features` (also creates every parameter)."""
    self.prompt_tokens(labels)
    return self.mix(self.features(tokens), labels, memory, k=k)


def _l2n(x: Array) -> Array:
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def gru_mix(features: Array, labels: Array, memory: Array, weights, *,
            k: int, relu: bool = True, dropout: float = 0.0,
            key: Optional[Array] = None) -> Tuple[Array, Array]:
  """The GRU mix of :class:`SemanticProxyNet` (see the module docstring).

  Args:
    features: ``[B, E]`` unit proxy features ``p``, ``B = m k`` in runs of
      ``k`` samples of one class (distinct classes).
    labels: ``[B]`` integer labels in ``[0, C)``.
    memory: ``[C, E]`` semantic proxies ``H`` of the last step (its gradient
      is stopped here).
    weights: ``{'r'|'z'|'n': (W_i, W_h, b_i)}``, each ``W`` ``[E, E]``.
    k: samples per class (the sampler's ``samples_per_class``).
    relu: the candidate uses ReLU (``'gru_relu'``) instead of tanh.
    dropout: the official ``rnn_dropout`` on each GRU output (inverted
      scaling), drawn with ``key``; 0 needs no key.

  Returns:
    ``(new_memory [C, E], classes [B // k])``.
  """
  classes = class_runs(labels, k)
  if dropout and key is None:
    raise ValueError("`dropout` needs a `key` (a jax.random key) for its "
                     "masks; pass key=... or dropout=0.")
  m = classes.shape[0]
  x = features.astype(jnp.float32).reshape(m, k, -1)
  memory = jax.lax.stop_gradient(jnp.asarray(memory, jnp.float32))
  h = memory[classes]

  def gate(g, xi, hh, act):
    w_i, w_h, b = weights[g]
    return act(xi @ w_i + hh @ w_h + b)

  act = jax.nn.relu if relu else jnp.tanh
  for i in range(k):
    z = gate("z", x[:, i], h, jax.nn.sigmoid)
    r = gate("r", x[:, i], h, jax.nn.sigmoid)
    w_i, w_h, b = weights["n"]
    n = act(x[:, i] @ w_i + r * (h @ w_h) + b)
    h = (1.0 - z) * n + z * h
    if dropout:
      key, sub = jax.random.split(key)
      keep = jax.random.bernoulli(sub, 1.0 - dropout, h.shape)
      h = jnp.where(keep, h / (1.0 - dropout), 0.0)
  return _l2n(memory.at[classes].set(h)), classes
