"""Tests of the ranking losses' shared pieces (circle_jax/losses/ranking.py):
the tiled block equals one tile, and the refused device ring."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from circle_jax.losses import ranking
from tests.losses.test_ranking_losses import (
    B, CASES, LABELS, LOSS, close, mesh, ranking_batch, ranking_case,
    ranking_vg)



@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_tiles_of_any_size_equal_one_tile(case):
  fn, _, hyper = ranking_case(case)
  x, labels = ranking_batch(seed=1), jnp.asarray(LABELS)
  whole = ranking_vg(fn, x, labels, block_size=B, **hyper)
  for bs in (None, 1, 3, 5, 7, 64):
    close(ranking_vg(fn, x, labels, block_size=bs, **hyper), whole)


@pytest.mark.parametrize("name", ["smooth_ap", "fastap"])
def test_the_ring_is_refused_in_one_line(name):
  fn = LOSS[name][0]

  def local(x, y):
    return fn(x, y, axis_name="d", collective="ring")

  with pytest.raises(ValueError, match="no device-ring form") as err:
    jax.shard_map(local, mesh=mesh(), in_specs=(P("d"), P("d")),
                  out_specs=P())(jnp.asarray(ranking_batch(n=16)),
                                 jnp.zeros(16, jnp.int32))
  assert "\n" not in str(err.value)


def test_self_similarity_is_the_geometry_of_each_row_with_itself():
  """Hand values: cosine 1 for every non-zero row, the dot geometry the
  squared norm; float32 from bfloat16."""
  x = jnp.array([[3.0, 4.0], [1.0, 0.0]])
  np.testing.assert_allclose(ranking.self_similarity(x), [1.0, 1.0],
                             rtol=1e-6)
  np.testing.assert_allclose(ranking.self_similarity(x, "dot"), [25.0, 1.0],
                             rtol=1e-6)
  assert ranking.self_similarity(x.astype(jnp.bfloat16)).dtype == jnp.float32


def test_varying_scalar_is_x_as_a_float32_scalar():
  block = ranking.RankingBlock(jnp.zeros((2, 2)), jnp.eye(2, dtype=bool),
                               jnp.ones((2, 2), bool), 2)
  v = ranking.varying_scalar(0.25, block)
  assert v.shape == () and v.dtype == jnp.float32 and float(v) == 0.25
