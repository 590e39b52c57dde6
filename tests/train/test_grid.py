"""Specification of circle_jax/train/grid.py: the vmapped hyperparameter grid.

The end-to-end equivalence on digits (vmapped vs one model at a time) and
the results files: tests/experiments/test_sweep.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from circle_jax import losses as losses_lib
from circle_jax import models as models_lib
from circle_jax.train import grid as grid_lib
from circle_jax.train import state as state_lib
from tests.train import helpers

# The losses of the committed sweeps, with a 2-point grid of two of their
# hyperparameters and the learnable array they need (proxies) if any.
LOSS_GRIDS = {
    "circle": {"gamma": (16.0, 80.0), "margin": (0.1, 0.4)},
    "multi_similarity": {"alpha": (1.0, 2.0), "beta": (20.0, 50.0)},
    "ranked_proxy_anchor": {"alpha": (1.2, 1.4), "margin": (0.2, 0.4)},
}



# ----------------------------------------------------------------------------
# Grid.
# ----------------------------------------------------------------------------


def test_grid_points_are_row_major_and_arrays_float32():
  grid = grid_lib.parse_grid(["gamma=16,32,64", "margin=0.1,0.4"])
  assert grid.names == ("gamma", "margin") and grid.shape == (3, 2)
  assert grid.size == 6
  points = grid.points()
  assert points[0] == {"gamma": 16.0, "margin": 0.1}
  assert points[1] == {"gamma": 16.0, "margin": 0.4}
  assert points[5] == {"gamma": 64.0, "margin": 0.4}
  arrays = grid.arrays()
  assert arrays["gamma"].dtype == np.float32
  np.testing.assert_array_equal(arrays["gamma"], [16, 16, 32, 32, 64, 64])


@pytest.mark.parametrize("specs, match", [
    ([], "one or two"),
    (["a=1", "b=2", "c=3"], "one or two"),
    (["gamma"], "NAME=V1"),
    (["gamma=1,x"], "numbers"),
    (["gamma=1", "gamma=2"], "twice"),
    (["gamma=1,1"], "repeated"),
])
def test_parse_grid_rejects(specs, match):
  with pytest.raises(ValueError, match=match):
    grid_lib.parse_grid(specs)


@pytest.mark.parametrize("name, spec, match", [
    ("circle", "gama=1,2", "no hyperparameter 'gama'"),
    ("multi_similarity", "mining=0,1", "only float"),
    ("circle", "gamma=-1,2", "gamma"),
    ("ranked_proxy_anchor", "margin=-0.1,0.2", "margin"),
])
def test_check_grid_rejects_what_the_loss_rejects(name, spec, match):
  """Points the loss rejects are rejected before tracing.

  The losses check ranges of Python numbers only; under vmap the values are
  traced, so the sweep checks every point with Python floats first.
  """
  entry = losses_lib.get_loss(name)
  with pytest.raises(ValueError, match=match):
    grid_lib.check_grid(entry, grid_lib.parse_grid([spec]), dict(entry.defaults),
                     embedding_dim=8, num_classes=3)



def test_check_grid_refuses_a_sharded_class_matrix():
  entry = losses_lib.get_loss("proxy_anchor")
  with pytest.raises(ValueError, match="loss.shard_classes: the sweep trains "
                     "every grid point on one device"):
    grid_lib.check_grid(entry, grid_lib.parse_grid(["alpha=16,32"]),
                        {**entry.defaults, "shard_classes": True},
                        embedding_dim=8, num_classes=3)

# ----------------------------------------------------------------------------
# The losses with traced hyperparameters.
# ----------------------------------------------------------------------------


# Slow tier (CI): the vmapped sweep's equivalences; not daily-work checks.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOSS_GRIDS))
def test_traced_hyperparameters_give_the_constant_loss(name):
  """jit(vmap) over hyperparameter arrays = the Python-constant calls.

  Values and gradients: no Python branch or float() on a hyperparameter.
  """
  entry = losses_lib.get_loss(name)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((24, 8)), jnp.float32)
  y = jnp.asarray(np.repeat(np.arange(6), 4), jnp.int32)
  p = None
  if entry.param_name is not None:
    p = entry.init_params(jax.random.PRNGKey(1), 6, 8)
  grid = grid_lib.Grid(tuple(LOSS_GRIDS[name]),
                    tuple(LOSS_GRIDS[name].values()))

  def loss(hyper, x):
    return entry.apply(x, y, p, **dict(hyper))

  values, grads = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=1),
                                   in_axes=(0, None)))(grid.arrays(), x)
  constant_loss = jax.jit(jax.value_and_grad(loss, argnums=1),
                          static_argnums=0)
  for i, point in enumerate(grid.points()):
    ref, ref_grad = constant_loss(tuple(point.items()), x)
    np.testing.assert_allclose(values[i], ref, rtol=1e-5)
    np.testing.assert_allclose(grads[i], ref_grad, rtol=1e-4, atol=1e-7)
  assert len(set(np.asarray(values).tolist())) == grid.size


# ----------------------------------------------------------------------------
# Unrolled convolutions.
# ----------------------------------------------------------------------------


# Slow tier (CI): the vmapped sweep's equivalences; not daily-work checks.
@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [
    dict(window_strides=(1, 1), padding=((1, 1), (1, 1))),
    dict(window_strides=(2, 2), padding="SAME"),
])
@pytest.mark.parametrize("x_batched", [True, False])
def test_unrolled_conv_equals_the_convolution_under_vmap(kwargs, x_batched):
  kwargs = dict(kwargs, dimension_numbers=("NHWC", "HWIO", "NHWC"))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 2, 7, 7, 4)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 3, 3, 4, 5)), jnp.float32)
  if not x_batched:
    x = x[0]

  def loss(conv):
    return lambda x, w: jnp.sum(jnp.tanh(conv(x, w, **kwargs)))

  in_axes = (0 if x_batched else None, 0)
  want = jax.vmap(jax.value_and_grad(loss(jax.lax.conv_general_dilated),
                                     argnums=(0, 1)), in_axes=in_axes)(x, w)
  got = jax.jit(jax.vmap(jax.value_and_grad(loss(grid_lib.unrolled_conv),
                                            argnums=(0, 1)),
                         in_axes=in_axes))(x, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_unrolled_interceptor_leaves_the_model_unchanged():
  model = models_lib.get_model("conv4", embedding_dim=4, width=8, num_blocks=2)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 12, 12, 1)),
                  jnp.float32)
  v = model.init(jax.random.PRNGKey(0), x, train=False)
  stacked = jax.tree.map(lambda a: jnp.stack([a, 1.5 * a]), v)
  want = jax.jit(jax.vmap(lambda v: model.apply(v, x, train=False)))(stacked)
  got = grid_lib.make_sweep_embed(model.apply, conv="unrolled")(stacked, x)
  assert got.shape == (6, 2, 4)
  np.testing.assert_allclose(np.moveaxis(got, 1, 0), want, rtol=1e-5,
                             atol=1e-5)


# ----------------------------------------------------------------------------
# Stacked training = one model at a time.
# ----------------------------------------------------------------------------


# Slow tier (CI): the vmapped sweep's equivalences; not daily-work checks.
@pytest.mark.slow
def test_stacked_state_copies_every_array():
  model = models_lib.get_model("conv4", embedding_dim=4, width=8, num_blocks=2)
  state = helpers.initial_state(
      model, optax.adam(1e-3), jnp.zeros((1, 8, 8, 1)),
      key=jax.random.PRNGKey(0))
  stacked = grid_lib.stacked_state(state, 3)
  assert stacked.step.shape == (3,)
  for a, b in zip(jax.tree.leaves(state_lib.state_to_tree(state)),
                  jax.tree.leaves(state_lib.state_to_tree(stacked))):
    assert b.shape == (3,) + np.shape(a)
    np.testing.assert_array_equal(b[2], a)
  assert stacked.apply_fn is state.apply_fn and stacked.tx is state.tx
