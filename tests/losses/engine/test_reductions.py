"""Tests of the (global) batch reductions
(circle_jax/losses/engine/reductions.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from circle_jax import ops
from circle_jax.losses.engine import reductions
from circle_jax.losses import engine


def _toy_global_loss(x, labels):
  _, _, s, pos, neg = engine.pair_block(x, labels)
  per = ops.log1p_sum_exp(10 * s, neg) + ops.log1p_sum_exp(-10 * s, pos)
  return reductions.mean_over_valid(per, pos.any(1))


def _toy_local_loss(x, labels, axis_name):
  _, _, s, pos, neg = engine.pair_block(x, labels, axis_name=axis_name)
  per = ops.log1p_sum_exp(10 * s, neg) + ops.log1p_sum_exp(-10 * s, pos)
  return reductions.mean_over_valid(per, pos.any(1), axis_name)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_global_batch_value_and_gradient_equal_single_device(mode):
  n = jax.device_count()
  assert n == 8
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 5))
  labels = jnp.array([0, 1, 2, 3] * 3 + [5, 6, 7, 0])
  ref_v, ref_g = jax.value_and_grad(_toy_global_loss)(x, labels)
  f = jax.value_and_grad(functools.partial(_toy_local_loss, axis_name="d"))
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, g = jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P("d")),
                         out_specs=(P(), P("d")))(x, labels)
  else:
    v, g = jax.pmap(f, axis_name="d")(x.reshape(n, -1, 5), labels.reshape(n, -1))
    v, g = v[0], g.reshape(16, 5)
  np.testing.assert_allclose(float(v), float(ref_v), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(g), np.asarray(ref_g), atol=1e-5)
