"""Tests of the ranking losses' shared pieces (circle_jax/losses/ranking.py):
the tiled block equals one tile, and the refused device ring."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
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
