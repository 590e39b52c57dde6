"""Shared helpers of the model tests: random variables without compiling init."""

import flax
import jax
import jax.numpy as jnp
import numpy as np


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
