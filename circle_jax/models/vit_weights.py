"""timm ViT checkpoints (``.safetensors``, ``.pth``, ``.bin``, ``.npz``) -> :class:`ViT`.

Reads the weights without PyTorch: ``.safetensors`` through the
``safetensors`` package's NumPy API, ``.pth`` / ``.bin`` / ``.pt`` through the
allow-list unpickler of :mod:`circle_jax.models.torch_pickle` (no code in the
file runs), ``.npz`` through NumPy without pickles.

Names are those of timm's ``VisionTransformer.state_dict()`` (the files timm
writes with ``save_file(model.state_dict(), ...)`` or ``torch.save``)::

  patch_embed.proj.weight [D, 3, p, p]   -> patch_embed/kernel [p, p, 3, D]
  blocks.{i}.attn.qkv.weight [3D, D]     -> blocks_{i}/attn/qkv/kernel [D, 3D]
  blocks.{i}.norm1.weight                -> blocks_{i}/norm1/ln/scale
  blocks.{i}.ls1.gamma                   -> blocks_{i}/ls1      (DINOv2)
  norm_pre.weight                        -> norm_pre/ln/scale   (CLIP)
  attn_pool.latent, attn_pool.q.weight   -> attn_pool/...       (SigLIP MAP)
  cls_token, reg_token, pos_embed        -> the same names

The classifier (``head.*``) and DINOv2's ``mask_token`` are ignored. A
position embedding saved for another grid (e.g. DINOv2's 37 x 37 at 518 px)
is resampled to the model's ``pos_grid`` as timm's ``checkpoint_filter_fn``
does (bicubic, antialiased), and the patch projection adapts to the images'
channels as timm's ``adapt_input_conv`` does (RGB weights summed over their
channels for grayscale images). Any other misfit raises a one-line
:class:`~circle_jax.models.convert.ConversionError` naming the first
mismatching tensor and what the model expected.

Export from timm (in a PyTorch environment, once)::

  python -c "import timm, safetensors.torch as st; m = timm.create_model(
      'vit_small_patch16_224.dino', pretrained=True, num_classes=0);
      st.save_file(m.state_dict(), 'vit_s16_dino.safetensors')"
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from circle_jax import errors
from circle_jax.models import convert
from circle_jax.models import vit as vit_lib
from circle_jax.models import vit_prompts

IGNORED_PREFIXES = ("head.", "mask_token")
# The patch projection, which adapts to the images' channels.
PATCH_KERNEL = ("patch_embed", "kernel")


def read_checkpoint(path: str | os.PathLike) -> Dict[str, np.ndarray]:
  """``{name: array}`` of a ``.safetensors``, ``.pth``/``.bin``/``.pt`` or
  ``.npz`` file, read without PyTorch."""
  path = os.fspath(path)
  if path.endswith(".safetensors"):
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
    with errors.reading_weights(path, "a timm ViT state dict saved with "
                                "safetensors (.safetensors)"):
      return dict(load_file(path))
  return convert.load_state_dict(path)


def _timm_name(path: Tuple[str, ...]) -> Tuple[str, Optional[Tuple[int, ...]]]:
  """timm name and transposition of one flat Flax parameter path."""
  parts = [p.replace("blocks_", "blocks.") if p.startswith("blocks_") else p
           for p in path if p != "ln"]
  leaf = parts[-1]
  if leaf in ("ls1", "ls2"):
    return ".".join(parts) + ".gamma", None
  if leaf == "kernel":
    stem = ".".join(parts[:-1])
    if parts[0] == "patch_embed":
      return "patch_embed.proj.weight", (2, 3, 1, 0)
    return stem + ".weight", (1, 0)
  if leaf in ("scale", "bias"):
    stem = ".".join(parts[:-1])
    if parts[0] == "patch_embed":
      stem = "patch_embed.proj"
    return stem + (".weight" if leaf == "scale" else ".bias"), None
  return ".".join(parts), None


def _fit_pos_embed(value: np.ndarray, want: Tuple[int, ...],
                   module: vit_lib.ViT) -> Optional[np.ndarray]:
  """The checkpoint's position embedding on the model's grid, or None."""
  if value.ndim != 3 or value.shape[2] != want[2]:
    return None
  prefix = want[1] - module.pos_grid ** 2
  n = value.shape[1] - prefix
  side = int(round(max(n, 0) ** 0.5))
  if n <= 0 or side * side != n:
    return None
  grid = vit_lib.resample_pos_embed(jnp.asarray(value[:, prefix:]),
                                    (module.pos_grid, module.pos_grid))
  return np.concatenate([value[:, :prefix], np.asarray(grid)], axis=1)


def stack_blocks(params: Mapping[str, Any], depth: int) -> Dict[str, Any]:
  """Per-block parameters ``blocks_{i}`` -> ``blocks/block`` stacked over the
  depth (the layout of a ``remat=True`` :class:`ViT`)."""
  out = {k: v for k, v in params.items() if not k.startswith("blocks_")}
  out["blocks"] = {"block": jax.tree_util.tree_map(
      lambda *xs: np.stack([np.asarray(x) for x in xs]),
      *[params[f"blocks_{i}"] for i in range(depth)])}
  return out


def convert_timm_vit(state_dict: Mapping[str, np.ndarray],
                     module: vit_lib.ViT, *, strict: bool = True,
                     source: str = "The ViT checkpoint",
                     in_channels: int = 3) -> Dict[str, Any]:
  """Converts a timm ``VisionTransformer`` state dict to ``{'params': ...}``.

  Args:
    state_dict: ``{timm name: array}`` (PyTorch layouts).
    module: the :class:`ViT` to load into (its options must match the
      checkpoint's family: see :data:`circle_jax.models.vit.FAMILIES`).
    strict: raise on tensors the model does not use (besides ``head.*`` and
      ``mask_token``).
    source: how errors name the checkpoint.
    in_channels: the channels of the model's images; the patch projection
      adapts to them as timm's ``adapt_input_conv`` does
      (:func:`circle_jax.models.convert.adapt_input_channels`: RGB weights
      summed over their channels for grayscale images).

  Returns:
    Backbone variables ``{'params': ...}`` (float32) for
    :func:`circle_jax.models.replace_backbone`.

  Raises:
    ConversionError: one line naming the first missing, misshapen or (with
      ``strict``) unexpected tensor.
  """
  if module.remat:  # Convert per block, then stack over the depth.
    flat = convert_timm_vit(state_dict, module.clone(remat=False),
                            strict=strict, source=source,
                            in_channels=in_channels)
    return {"params": stack_blocks(flat["params"], module.depth)}
  size = module.patch_size * module.pos_grid
  init = lambda: module.init(  # noqa: E731
      jax.random.PRNGKey(0), jnp.zeros((1, size, size, in_channels)),
      train=False)
  shapes = jax.eval_shape(init)
  expected = flax.traverse_util.flatten_dict(shapes["params"])
  out, used = {}, set()
  if any(p[0] in vit_prompts.ADDED for p in expected):
    # Prompts and head_norm are in no checkpoint: they keep their init.
    added = flax.traverse_util.flatten_dict(jax.jit(init)()["params"])
    out = {p: np.asarray(v) for p, v in added.items()
           if p[0] in vit_prompts.ADDED}
    expected = {p: v for p, v in expected.items() if p not in out}
  for path, spec in sorted(expected.items()):
    key, perm = _timm_name(path)
    want = tuple(spec.shape)
    if key not in state_dict:
      raise convert.ConversionError(
          f"{source} has no tensor {key!r} (model parameter "
          f"{'/'.join(path)}, shape {want}); is the model's family right? "
          f"families: {', '.join(vit_lib.FAMILIES)}.")
    used.add(key)
    value = np.asarray(state_dict[key], np.float32)
    if perm is not None:
      value = value.transpose(perm) if value.ndim == len(perm) else value
    if path == PATCH_KERNEL and value.ndim == 4:
      value = convert.adapt_input_channels(value, in_channels,
                                           what=f"{source}: {key!r}")
    if key == "pos_embed" and value.shape != want:
      fitted = _fit_pos_embed(value, want, module)
      value = value if fitted is None else fitted
    if value.shape != want:
      shown = value.shape if perm is None else tuple(
          np.asarray(state_dict[key]).shape)
      torch_want = want if perm is None else tuple(
          want[perm.index(i)] for i in range(len(perm)))
      raise convert.ConversionError(
          f"{source}: tensor {key!r} has shape {shown}, the model expects "
          f"{torch_want} (width {module.width}, patch {module.patch_size}, "
          f"grid {module.pos_grid}); check the model size and family.")
    out[path] = value
  if strict:
    extra = sorted(k for k in state_dict if k not in used
                   and not k.startswith(IGNORED_PREFIXES))
    if extra:
      raise convert.ConversionError(
          f"{source} has {len(extra)} tensor(s) the model does not use, the "
          f"first {extra[0]!r} {tuple(np.shape(state_dict[extra[0]]))}; check "
          "the model's depth and family, or pass strict=False.")
  return {"params": flax.traverse_util.unflatten_dict(out)}


def load_timm_vit(path: str | os.PathLike, module: vit_lib.ViT, *,
                  strict: bool = True, in_channels: int = 3
                  ) -> Dict[str, Any]:
  """Reads ``path`` (:func:`read_checkpoint`) and converts it for ``module``
  and images of ``in_channels`` channels (:func:`convert_timm_vit`)."""
  sd = read_checkpoint(path)
  return convert_timm_vit(sd, module, strict=strict,
                          source=f"{os.fspath(path)!r}",
                          in_channels=in_channels)
