"""Vision Transformer (ViT) backbones with the layout of timm's VisionTransformer.

One module covers the checkpoint families of the metric-learning papers since
2022 (:data:`FAMILIES`): supervised/AugReg ViTs, DINO, DINOv2 (layer scale,
register tokens, position embedding without the class token), CLIP image towers
(a LayerNorm before the blocks, ``norm_pre``, LayerNorm epsilon 1e-5) and
SigLIP (no class token, attention-pool "MAP" head). Weights convert one-to-one
from timm's parameter names (:mod:`circle_jax.models.vit_weights`).

Forward pass (pre-norm transformer, Dosovitskiy et al.)::

  x = PatchEmbed(image) + PosEmbed       # pos resampled to the image's grid
  x = concat(cls, registers, x)          # (pos of cls: see pos_embed_prefix)
  x = norm_pre(x)                        # CLIP only
  x = x + DropPath(LS1 * Attn(LN1(x)))   # depth times
  x = x + DropPath(LS2 * MLP(LN2(x)))
  x = LN(x); feature = pool(x)           # cls token, mean of patches, or MAP

Visual prompt tuning (Jia et al., VPT; Ren et al., VPTSP-G): with
``num_prompts`` > 0, block ``i < prompt_depth`` sees ``max(num_prompts - i *
prompt_step, 0)`` learned tokens prepended to its input and dropped from its
output (deep VPT; ``prompt_depth=1`` is shallow VPT, whose tokens are kept
only through the first block here, as in the VPTSP-G code, not carried
through the depth). The tokens carry no position embedding.
``prompt_tokens`` (a call argument) replaces the learned prompts by given
per-example tokens (VPTSP-G's class prompts: :mod:`circle_jax.models.
semantic_proxies`). ``tune`` says which backbone parameters train
(:func:`circle_jax.models.vit_prompts.trainable`): all (``'full'``), the
prompts, the added ``head_norm`` and every bias (``'bitfit'``, Ben Zaken et
al.), or the prompts and ``head_norm`` only (``'prompt'``); the trainer's
optimiser gives the others no update
(:func:`circle_jax.models.frozen_module_paths`).

The backbone returns the pooled feature as a ``[B, 1, 1, width]`` map so that
:class:`circle_jax.models.EmbeddingHead` (its global pooling is then the
identity) puts the linear embedding on it like on the conv trunks.

Any image size whose sides are multiples of the patch size works: the position
embedding parameter keeps the checkpoint's grid (``pos_grid``) and is
resampled at trace time to the input's grid with the bicubic, antialiased
interpolation timm uses (``resample_abs_pos_embed``; ``jax.image.resize``'s
bicubic is Keys' a = -0.5 kernel with antialiasing, as PyTorch's
``F.interpolate(..., mode='bicubic', antialias=True)``).

Precision: ``dtype`` is the compute dtype of the matmuls (bfloat16 for mixed
precision); parameters, the patch/position embeddings, LayerNorm statistics
and the attention softmax stay float32.

References:
  Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image
  Recognition at Scale", ICLR 2021.
  Caron et al., "Emerging Properties in Self-Supervised Vision Transformers"
  (DINO), ICCV 2021.
  Oquab et al., "DINOv2: Learning Robust Visual Features without
  Supervision", TMLR 2024; Darcet et al., "Vision Transformers Need
  Registers", ICLR 2024.
  Radford et al., "Learning Transferable Visual Models From Natural Language
  Supervision" (CLIP), ICML 2021.
  Zhai et al., "Sigmoid Loss for Language Image Pre-Training" (SigLIP), ICCV
  2023.
  Visual prompts and BitFit: see :mod:`circle_jax.models.vit_prompts`.
  Wightman, "PyTorch Image Models" (timm), github.com/huggingface/
  pytorch-image-models, 2019-2026.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from circle_jax.models import vit_prompts

Array = jax.Array

# name -> (width, depth, heads).
SIZES: Dict[str, Tuple[int, int, int]] = {
    "ti": (192, 12, 3),
    "s": (384, 12, 6),
    "b": (768, 12, 12),
    "l": (1024, 24, 16),
}
POOLS = ("cls", "mean", "map")
ACTIVATIONS = ("gelu", "quick_gelu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class Family:
  """What a checkpoint family fixes: structure and input normalisation.

  Attributes:
    options: :class:`ViT` attributes of the family (pooling, registers, ...).
    preprocess: the :mod:`circle_jax.data.augment` preset with the family's
      mean and std (``imagenet``, ``clip`` or ``inception``, the last being
      mean = std = 0.5).
    timm_example: a timm model whose weights are of this family.
  """

  options: Dict[str, Any]
  preprocess: str
  timm_example: str


FAMILIES: Dict[str, Family] = {
    # timm's AugReg / ImageNet-21k ViTs (mean = std = 0.5).
    "augreg": Family({}, "inception", "vit_small_patch16_224.augreg_in21k"),
    # DeiT and the original ImageNet-1k ViTs (ImageNet mean/std).
    "imagenet": Family({}, "imagenet", "deit_small_patch16_224.fb_in1k"),
    "dino": Family({}, "imagenet", "vit_small_patch16_224.dino"),
    "dinov2": Family({"layer_scale": True}, "imagenet",
                     "vit_small_patch14_dinov2.lvd142m"),
    "dinov2_reg": Family({"layer_scale": True, "num_registers": 4,
                          "pos_embed_prefix": False}, "imagenet",
                         "vit_small_patch14_reg4_dinov2.lvd142m"),
    "clip": Family({"pre_norm": True, "patch_bias": False, "ln_eps": 1e-5},
                   "clip", "vit_base_patch16_clip_224.openai"),
    "siglip": Family({"class_token": False, "pool": "map"}, "inception",
                     "vit_base_patch16_siglip_224.webli"),
}


def vit_options(size: str, patch: int, family: str = "augreg",
                image_size: int = 224, **overrides) -> Dict[str, Any]:
  """:class:`ViT` attributes of a size (``ti``, ``s``, ``b``, ``l``), patch size
  and checkpoint family, with ``overrides`` (any attribute) on top; the
  position grid is ``image_size // patch_size``."""
  size = size.lower()
  if size not in SIZES:
    raise ValueError(f"Unknown ViT size {size!r}; known sizes: "
                     f"{', '.join(SIZES)}.")
  if family not in FAMILIES:
    raise ValueError(f"Unknown ViT family {family!r}; known families: "
                     f"{', '.join(FAMILIES)}.")
  width, depth, heads = SIZES[size]
  opts = dict(width=width, depth=depth, num_heads=heads, patch_size=patch)
  opts.update(FAMILIES[family].options)
  opts.update(overrides)
  if image_size % opts["patch_size"]:
    raise ValueError(f"`image_size` {image_size} is not a multiple of the "
                     f"patch size {opts['patch_size']}.")
  opts.setdefault("pos_grid", image_size // opts["patch_size"])
  return opts


def _activation(name: str):
  if name == "gelu":
    return lambda x: nn.gelu(x, approximate=False)
  if name == "gelu_tanh":
    return lambda x: nn.gelu(x, approximate=True)
  if name == "quick_gelu":
    return lambda x: x * nn.sigmoid(1.702 * x)
  raise ValueError(f"`act` must be one of {', '.join(ACTIVATIONS)}; got "
                   f"{name!r}.")


def resample_pos_embed(pos: Array, new_grid: Tuple[int, int]) -> Array:
  """Resamples a ``[1, gh * gw, D]`` grid of position embeddings (square old
  grid) to ``new_grid`` with antialiased bicubic interpolation (float32)."""
  n, d = pos.shape[1:]
  old = int(round(n ** 0.5))
  if old * old != n:
    raise ValueError(f"The position embedding has {n} grid entries, not a "
                     "square grid.")
  if (old, old) == tuple(new_grid):
    return pos
  grid = pos.astype(jnp.float32).reshape(old, old, d)
  grid = jax.image.resize(grid, (new_grid[0], new_grid[1], d), "bicubic",
                          antialias=True)
  return grid.reshape(1, new_grid[0] * new_grid[1], d)


class _LayerNorm(nn.Module):
  """LayerNorm with float32 statistics and parameters, output in ``dtype``."""

  eps: float
  dtype: Any

  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm(epsilon=self.eps, dtype=jnp.float32,
                     param_dtype=jnp.float32, name="ln")(x.astype(jnp.float32))
    return y.astype(self.dtype)


def _dense(features, dtype, name, use_bias=True):
  return nn.Dense(features, use_bias=use_bias, dtype=dtype,
                  param_dtype=jnp.float32,
                  kernel_init=nn.initializers.xavier_uniform(), name=name)


def _attend(q, k, v, dtype, drop=None):
  """Softmax attention ``[B, H, Lq, d], [B, H, L, d] -> [B, Lq, H * d]`` with
  float32 logits and softmax; ``drop`` (dropout) acts on the weights."""
  scale = q.shape[-1] ** -0.5
  logits = jnp.einsum("bhqd,bhkd->bhqk", q * jnp.asarray(scale, q.dtype), k,
                      preferred_element_type=jnp.float32)
  weights = jax.nn.softmax(logits, axis=-1)
  if drop is not None:
    weights = drop(weights)
  weights = weights.astype(dtype)
  out = jnp.einsum("bhqk,bhkd->bqhd", weights, v)
  return out.reshape(out.shape[0], out.shape[1], -1)


class _Mlp(nn.Module):
  hidden: int
  act: str
  dropout: float
  dtype: Any

  @nn.compact
  def __call__(self, x, deterministic):
    width = x.shape[-1]
    y = _activation(self.act)(_dense(self.hidden, self.dtype, "fc1")(x))
    y = nn.Dropout(self.dropout)(y, deterministic=deterministic)
    y = _dense(width, self.dtype, "fc2")(y)
    return nn.Dropout(self.dropout)(y, deterministic=deterministic)


class _Attention(nn.Module):
  num_heads: int
  attention_dropout: float
  dropout: float
  dtype: Any

  @nn.compact
  def __call__(self, x, deterministic):
    b, n, width = x.shape
    h = self.num_heads
    qkv = _dense(3 * width, self.dtype, "qkv")(x)
    qkv = qkv.reshape(b, n, 3, h, width // h).transpose(2, 0, 3, 1, 4)
    drop = nn.Dropout(self.attention_dropout)
    y = _attend(qkv[0], qkv[1], qkv[2], self.dtype,
                lambda w: drop(w, deterministic=deterministic))
    y = _dense(width, self.dtype, "proj")(y)
    return nn.Dropout(self.dropout)(y, deterministic=deterministic)


def _drop_path(module, x, rate, deterministic):
  """Stochastic depth: drops the whole residual branch per example (``rate``
  a float or, inside the scanned blocks, a traced scalar)."""
  if deterministic or (isinstance(rate, float) and rate == 0.0):
    return x
  keep = 1.0 - rate
  mask = jax.random.bernoulli(module.make_rng("dropout"), keep,
                              (x.shape[0],) + (1,) * (x.ndim - 1))
  return jnp.where(mask, x / jnp.asarray(keep, x.dtype), jnp.zeros_like(x))


class _Block(nn.Module):
  num_heads: int
  mlp_dim: int
  act: str
  ln_eps: float
  layer_scale: bool
  dropout: float
  attention_dropout: float
  drop_path: float
  dtype: Any

  @nn.compact
  def __call__(self, x, deterministic, rate=None):
    width = x.shape[-1]
    rate = self.drop_path if rate is None else rate

    def branch(y, name):
      if self.layer_scale:
        gamma = self.param(name, nn.initializers.constant(1e-5), (width,),
                           jnp.float32)
        y = y * gamma.astype(y.dtype)
      return _drop_path(self, y, rate, deterministic)

    y = _LayerNorm(self.ln_eps, self.dtype, name="norm1")(x)
    y = _Attention(self.num_heads, self.attention_dropout, self.dropout,
                   self.dtype, name="attn")(y, deterministic)
    x = x + branch(y, "ls1")
    y = _LayerNorm(self.ln_eps, self.dtype, name="norm2")(x)
    y = _Mlp(self.mlp_dim, self.act, self.dropout, self.dtype,
             name="mlp")(y, deterministic)
    return x + branch(y, "ls2")


class _ScannedBlock(nn.Module):
  """One :class:`_Block` as the body of ``nn.scan`` (``remat``): carries the
  tokens, takes the block's drop-path rate as the scanned input."""

  block: Dict[str, Any]
  deterministic: bool

  @nn.compact
  def __call__(self, x, rate):
    return _Block(**self.block, name="block")(x, self.deterministic,
                                              rate), None


class _MapHead(nn.Module):
  """timm's ``AttentionPoolLatent``: one learned query attends to the tokens,
  then a residual MLP (SigLIP's "MAP" head)."""

  num_heads: int
  mlp_dim: int
  act: str
  ln_eps: float
  dtype: Any

  @nn.compact
  def __call__(self, x):
    b, n, width = x.shape
    h = self.num_heads
    latent = self.param("latent", nn.initializers.normal(width ** -0.5),
                        (1, 1, width), jnp.float32)
    q = _dense(width, self.dtype, "q")(latent.astype(self.dtype))
    q = jnp.broadcast_to(q.reshape(1, 1, h, width // h).transpose(0, 2, 1, 3),
                         (b, h, 1, width // h))
    kv = _dense(2 * width, self.dtype, "kv")(x)
    kv = kv.reshape(b, n, 2, h, width // h).transpose(2, 0, 3, 1, 4)
    y = _attend(q, kv[0], kv[1], self.dtype)
    y = _dense(width, self.dtype, "proj")(y)
    z = _LayerNorm(self.ln_eps, self.dtype, name="norm")(y)
    y = y + _Mlp(self.mlp_dim, self.act, 0.0, self.dtype, name="mlp")(
        z, True)
    return y[:, 0]


class _PatchEmbed(nn.Module):
  """The ``p x p`` stride-``p`` patch projection, float32 (optionally frozen:
  its parameters pass through ``stop_gradient``)."""

  width: int
  patch: int
  bias: bool
  frozen: bool

  @nn.compact
  def __call__(self, x):
    p = self.patch
    kernel = self.param("kernel", nn.initializers.lecun_normal(),
                        (p, p, x.shape[-1], self.width), jnp.float32)
    if self.frozen:
      kernel = jax.lax.stop_gradient(kernel)
    y = jax.lax.conv_general_dilated(
        x, kernel, (p, p), "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))
    if self.bias:
      b = self.param("bias", nn.initializers.zeros, (self.width,),
                     jnp.float32)
      y = y + (jax.lax.stop_gradient(b) if self.frozen else b)
    return y


class ViT(nn.Module):
  """Vision Transformer trunk; returns the pooled ``[B, 1, 1, width]`` feature.

  Attributes:
    width: token dimension ``D`` (Ti 192, S 384, B 768, L 1024).
    depth: number of blocks.
    num_heads: attention heads (``width`` must be a multiple).
    mlp_dim: hidden units of the MLPs (default ``4 * width``).
    patch_size: side of the square patches (16 or 14).
    pos_grid: side of the position-embedding grid stored in the parameters
      (the checkpoint's: 224 / 16 = 14; 518 / 14 = 37 for DINOv2).
    class_token: a learned class token is prepended.
    num_registers: register tokens after the class token (DINOv2: 4).
    pos_embed_prefix: the position embedding has entries for the class and
      register tokens (timm's default); False adds it to the patches only
      (timm's ``no_embed_class``, DINOv2 with registers).
    pre_norm: a LayerNorm before the blocks (CLIP's ``norm_pre``).
    patch_bias: the patch projection has a bias (not CLIP's).
    layer_scale: per-channel scales on both residual branches (DINOv2).
    pool: ``'cls'`` (class token), ``'mean'`` (mean of the patch tokens) or
      ``'map'`` (attention pooling with a learned query, SigLIP).
    fc_norm: the final LayerNorm is applied after pooling (timm's ``fc_norm``
      for mean pooling) instead of to every token.
    ln_eps: LayerNorm epsilon (1e-6; CLIP 1e-5).
    act: MLP activation, ``'gelu'`` (exact, erf), ``'quick_gelu'`` (OpenAI
      CLIP) or ``'gelu_tanh'``.
    dropout: dropout after the MLP and attention projections, in [0, 1).
    attention_dropout: dropout on the attention weights.
    drop_path: stochastic-depth rate of the last block (linearly increasing
      from 0 at the first, as timm's ``drop_path_rate``).
    frozen_patch_embed: no gradient reaches the patch projection (Hyp-ViT's
      ``--freeze 0``), and the trainer's optimiser puts its parameters in
      the ``frozen`` group (:func:`circle_jax.models.frozen_module_paths`,
      ``optax.set_to_zero`` in :func:`circle_jax.train.optim.
      optimizer_from_config`): no step, no weight decay and no optimiser
      moments, as PyTorch's ``requires_grad=False``. An optimiser built
      outside the trainer must freeze them the same way, or AdamW's
      decoupled decay shrinks them by ``lr * wd`` per step.
    remat: recompute each block's activations in the backward pass
      (``nn.remat`` under ``nn.scan``): less memory, about one more forward
      pass of time. The blocks' parameters are then stacked over the depth
      (``params['blocks']``; :func:`circle_jax.models.vit_weights.
      stack_blocks` converts).
    dtype: compute dtype of the matmuls.
    num_prompts: prompt tokens of the first block (0: no prompts).
    prompt_depth: blocks that get prompts (None: all, deep VPT; 1:
      shallow).
    prompt_step: each next block gets this many fewer tokens (the VPTSP-G
      code's ``prompt_block_step``).
    head_norm: a new LayerNorm (epsilon 1e-5, scale 1, bias 0) on the pooled
      feature, trained under every ``tune`` (the VPTSP-G code's ``fc_norm``
      before its linear head).
    tune: which parameters train: ``'full'``, ``'bitfit'`` or ``'prompt'``
      (see the module docstring and
      :func:`circle_jax.models.vit_prompts.trainable`).
    freeze_bn, bn_momentum, bn_axis_name: accepted for the interface shared
      with the conv trunks; a ViT has no BatchNorm.
  """

  width: int = 384
  depth: int = 12
  num_heads: int = 6
  mlp_dim: Optional[int] = None
  patch_size: int = 16
  pos_grid: int = 14
  class_token: bool = True
  num_registers: int = 0
  pos_embed_prefix: bool = True
  pre_norm: bool = False
  patch_bias: bool = True
  layer_scale: bool = False
  pool: str = "cls"
  fc_norm: bool = False
  ln_eps: float = 1e-6
  act: str = "gelu"
  dropout: float = 0.0
  attention_dropout: float = 0.0
  drop_path: float = 0.0
  frozen_patch_embed: bool = False
  remat: bool = False
  num_prompts: int = 0
  prompt_depth: Optional[int] = None
  prompt_step: int = 0
  head_norm: bool = False
  tune: str = "full"
  dtype: Any = jnp.float32
  freeze_bn: bool = False
  bn_momentum: float = 0.9
  bn_axis_name: Optional[str] = None

  def _check(self, x):
    if self.pool not in POOLS:
      raise ValueError(f"`pool` must be one of {', '.join(POOLS)}; got "
                       f"{self.pool!r}.")
    if self.pool == "cls" and not self.class_token:
      raise ValueError("pool='cls' needs class_token=True; use pool='mean' "
                       "or 'map'.")
    if self.width % self.num_heads:
      raise ValueError(f"`width` {self.width} is not a multiple of "
                       f"`num_heads` {self.num_heads}.")
    for name in ("dropout", "attention_dropout", "drop_path"):
      rate = getattr(self, name)
      if not 0.0 <= rate < 1.0:
        raise ValueError(f"`{name}` must be in [0, 1); got {rate}.")
    if self.tune not in vit_prompts.TUNES:
      raise ValueError("`tune` must be one of "
                       f"{', '.join(vit_prompts.TUNES)}; got {self.tune!r}.")
    if self.num_prompts < 0 or self.prompt_step < 0:
      raise ValueError("`num_prompts` and `prompt_step` must be >= 0; got "
                       f"{self.num_prompts} and {self.prompt_step}.")
    if self.num_prompts and self.remat:
      raise ValueError("Prompt tokens need remat=False (the scanned blocks "
                       "take no per-block tokens).")
    problem = self.input_problem(*x.shape[1:3])
    if problem:
      raise ValueError(f"ViT: {problem}.")

  def input_problem(self, height: int, width: int) -> str:
    """Why the ViT cannot take ``height x width`` images ("" if it can):
    each side must be a multiple of the patch size (read by
    :func:`circle_jax.models.check_input` at config-check time)."""
    if height % self.patch_size or width % self.patch_size:
      return (f"input {height}x{width} is not a multiple of the patch size "
              f"{self.patch_size}; resize the images to a multiple of "
              f"{self.patch_size}")
    return ""

  def _layer_prompts(self, prompt_tokens, batch):
    """Per-block prompt tokens (None where a block has none)."""
    counts = vit_prompts.prompt_counts(self.num_prompts, self.prompt_depth,
                                       self.prompt_step, self.depth)
    learned = (vit_prompts.Prompts(counts, self.width, name="prompts")()
               if counts else [])
    if prompt_tokens is None:
      return learned
    tokens = list(prompt_tokens)
    if len(tokens) > self.depth:
      raise ValueError(f"`prompt_tokens` has {len(tokens)} entries for "
                       f"{self.depth} blocks.")
    for t in tokens:
      if t.ndim != 3 or t.shape[0] not in (1, batch) or (
          t.shape[2] != self.width):
        raise ValueError(f"Each of `prompt_tokens` must be [{batch} or 1, n, "
                         f"{self.width}]; got {tuple(t.shape)}.")
    return tokens

  @nn.compact
  def __call__(self, x: Array, *, train: bool,
               prompt_tokens: Optional[Sequence[Array]] = None) -> Array:
    """Pooled features ``[B, 1, 1, width]`` of images ``x [B, H, W, C]``;
    ``prompt_tokens`` (per-block ``[B or 1, n_i, width]``) replace the
    learned prompts (blocks beyond the list get none), and the feature is
    then returned before ``head_norm`` (VPTSP-G's class-prompt pass has a
    head of its own: :mod:`circle_jax.models.semantic_proxies`)."""
    self._check(x)
    deterministic = not train
    p, d = self.patch_size, self.width
    x = _PatchEmbed(d, p, self.patch_bias, self.frozen_patch_embed,
                    name="patch_embed")(x.astype(jnp.float32))
    b, gh, gw, _ = x.shape
    x = x.reshape(b, gh * gw, d)
    num_prefix = int(self.class_token) + self.num_registers
    n_pos = self.pos_grid ** 2 + (num_prefix if self.pos_embed_prefix else 0)
    pos = self.param("pos_embed", nn.initializers.normal(0.02), (1, n_pos, d),
                     jnp.float32)
    prefix_pos = pos[:, :n_pos - self.pos_grid ** 2]
    grid_pos = resample_pos_embed(pos[:, n_pos - self.pos_grid ** 2:],
                                  (gh, gw))
    x = x + grid_pos
    prefix = []
    if self.class_token:
      prefix.append(self.param("cls_token", nn.initializers.normal(1e-6),
                               (1, 1, d), jnp.float32))
    if self.num_registers:
      prefix.append(self.param("reg_token", nn.initializers.normal(1e-6),
                               (1, self.num_registers, d), jnp.float32))
    if prefix:
      tokens = jnp.concatenate(prefix, axis=1)
      if self.pos_embed_prefix:
        tokens = tokens + prefix_pos
      x = jnp.concatenate([jnp.broadcast_to(tokens, (b,) + tokens.shape[1:]),
                           x], axis=1)
    x = nn.Dropout(self.dropout)(x, deterministic=deterministic)
    x = x.astype(self.dtype)
    if self.pre_norm:
      x = _LayerNorm(self.ln_eps, self.dtype, name="norm_pre")(x)
    layer_prompts = self._layer_prompts(prompt_tokens, b)
    block = dict(num_heads=self.num_heads, mlp_dim=self.mlp_dim or 4 * d,
                 act=self.act, ln_eps=self.ln_eps,
                 layer_scale=self.layer_scale, dropout=self.dropout,
                 attention_dropout=self.attention_dropout, drop_path=0.0,
                 dtype=self.dtype)
    rates = [self.drop_path * i / max(self.depth - 1, 1)
             for i in range(self.depth)]
    if self.remat:
      # Rematerialised blocks under a scan: XLA then recomputes each block
      # inside the backward loop (an unrolled stack of nn.remat blocks is
      # not rematerialised by XLA:CPU). Parameters are stacked over the
      # depth under 'blocks' (see vit_weights.stack_blocks).
      x, _ = nn.scan(nn.remat(_ScannedBlock), variable_axes={"params": 0},
                     split_rngs={"params": True, "dropout": True},
                     length=self.depth)(block, deterministic, name="blocks")(
                         x, jnp.asarray(rates, jnp.float32))
    else:
      for i in range(self.depth):
        run = _Block(**dict(block, drop_path=rates[i]), name=f"blocks_{i}")
        tokens = layer_prompts[i] if i < len(layer_prompts) else None
        if tokens is None or not tokens.shape[1]:
          x = run(x, deterministic)
        else:  # Prepended, then dropped (the VPTSP-G code's order).
          n = tokens.shape[1]
          tokens = jnp.broadcast_to(tokens, (b, n, d)).astype(x.dtype)
          x = run(jnp.concatenate([tokens, x], axis=1), deterministic)[:, n:]
    if not self.fc_norm:
      x = _LayerNorm(self.ln_eps, self.dtype, name="norm")(x)
    if self.pool == "cls":
      y = x[:, 0]
    elif self.pool == "mean":
      y = jnp.mean(x[:, num_prefix:].astype(jnp.float32), axis=1)
    else:
      y = _MapHead(self.num_heads, self.mlp_dim or 4 * d, self.act,
                   self.ln_eps, self.dtype, name="attn_pool")(
                       x[:, num_prefix:])
    if self.fc_norm:
      y = _LayerNorm(self.ln_eps, self.dtype, name="fc_norm")(y)
    if self.head_norm and prompt_tokens is None:
      y = _LayerNorm(vit_prompts.HEAD_NORM_EPS, self.dtype,
                     name="head_norm")(y)
    return y.astype(jnp.float32)[:, None, None, :]
