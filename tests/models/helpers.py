"""Shared helpers of the model tests: random variables without compiling init."""

import flax
import jax
import jax.numpy as jnp
import numpy as np

from circle_jax.models import vit as vit_lib
from circle_jax.models import vit_weights


def variable_shapes(model, input_shape):
  """``jax.eval_shape`` of ``model.init`` (traces, compiles nothing)."""
  return jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(input_shape),
                         train=False))


def random_variables(shapes, seed=0):
  """Well-scaled random variables for a shape tree from :func:`variable_shapes`.

  Conv/dense kernels ~ N(0, 2 / fan_in), biases ~ N(0, 0.1), BatchNorm scale
  and variance ~ U(0.5, 1.5), means ~ N(0, 0.1): non-trivial values for every
  leaf so that a transposed or swapped tensor changes the output.
  """
  rng = np.random.default_rng(seed)
  out = {}
  for col, tree in shapes.items():
    flat = flax.traverse_util.flatten_dict(tree)
    new = {}
    for path, s in flat.items():
      leaf = path[-1]
      if leaf == "kernel":
        fan_in = int(np.prod(s.shape[:-1]))
        v = rng.normal(size=s.shape) * np.sqrt(2.0 / fan_in)
      elif leaf in ("scale", "var"):
        v = rng.uniform(0.5, 1.5, s.shape)
      else:
        v = rng.normal(size=s.shape) * 0.1
      new[path] = np.asarray(v, np.float32)
    out[col] = flax.traverse_util.unflatten_dict(new)
  return out


def tiny_vit(family="augreg", patch=4, image_size=16, **kw):
  """A 2-block ViT of width 16 (``vit_options`` of ``ti``)."""
  opts = dict(depth=2, width=16, num_heads=2)
  opts.update(kw)
  return vit_lib.ViT(**vit_lib.vit_options("ti", patch, family,
                                           image_size=image_size, **opts))


def init_vit(module, size=16):
  """``module.init`` on one zero image of ``size`` pixels square."""
  return module.init(jax.random.PRNGKey(0), jnp.zeros((1, size, size, 3)),
                     train=False)


def timm_state_dict(module, seed=0):
  """A timm-named state dict built from our own parameters (the inverse
  mapping), so that the converter round-trips."""
  size = module.pos_grid * module.patch_size
  params = flax.traverse_util.flatten_dict(
      variable_shapes(module, (1, size, size, 3))["params"])
  rng = np.random.RandomState(seed)
  sd = {}
  for path, value in params.items():
    key, perm = vit_weights._timm_name(path)  # pylint: disable=protected-access
    value = rng.randn(*value.shape).astype(np.float32)
    params[path] = value
    if perm is not None:
      value = value.transpose(np.argsort(perm))
    sd[key] = np.ascontiguousarray(value)  # safetensors writes raw buffers
  return sd, flax.traverse_util.unflatten_dict(params)
