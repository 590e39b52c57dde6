"""Tests of the tile pieces (circle_jax/losses/engine/tiles.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.losses import engine
import chex
from circle_jax.losses.engine import tiles
from circle_jax.losses.circle import Circle
from tests.losses.engine.cases import RULES, block


def test_pair_masks_exclude_self_and_respect_ids_and_miner_masks():
  labels = jnp.array([0, 0, 1, 1])
  ids = jnp.arange(4)
  pos, neg = engine.pair_masks(labels[2:], ids[2:], labels, ids)
  np.testing.assert_array_equal(np.asarray(pos), [[0, 0, 0, 1], [0, 0, 1, 0]])
  np.testing.assert_array_equal(np.asarray(neg), [[1, 1, 0, 0], [1, 1, 0, 0]])
  keep = jnp.array([[True, False, True, True], [True, True, True, True]])
  _, neg = engine.pair_masks(labels[2:], ids[2:], labels, ids, neg_mask=keep)
  np.testing.assert_array_equal(np.asarray(neg), [[1, 0, 0, 0], [1, 1, 0, 0]])
  with pytest.raises(ValueError, match="pos_mask"):
    engine.pair_block(jnp.ones((4, 2)), labels,
                      pos_mask=jnp.ones((3, 4), bool))


def test_derived_gradient_honours_stop_gradient_constants():
  """Circle's alpha weights are constants: dL/dlogit * (-gamma alpha_p)."""
  rule = Circle(margin=0.25, gamma=4.0)
  s = jnp.array([[0.3, 0.8, -0.2]])
  pos = jnp.array([[False, True, False]])
  neg = jnp.array([[False, False, True]])
  stats = tiles.stats_update(rule, tiles.stats_init(s[:, 0]), s, pos, neg,
                               ())
  g = tiles.tile_cotangent(rule, s, pos, neg, (), stats, jnp.ones(1))
  # One positive, one negative: l = softplus(lp + ln), dl/ds = sigmoid * dlogit.
  m, gamma = 0.25, 4.0
  sp, sn = 0.8, -0.2
  ap, an = max(1 + m - sp, 0), max(sn + m, 0)
  lp, ln = -gamma * ap * (sp - (1 - m)), gamma * an * (sn - m)
  sig = 1 / (1 + np.exp(-(lp + ln)))
  np.testing.assert_allclose(np.asarray(g)[0],
                             [0.0, sig * -gamma * ap, sig * gamma * an],
                             rtol=1e-6)


def _column_chunk_engine(rule, s, pos, neg, chunk):
  """A minimal engine: the columns arrive in chunks (as from a device ring)."""
  n = s.shape[1]
  pre = None
  for j in range(0, n, chunk):
    sl = slice(j, j + chunk)
    pre = tiles.prepass_update(rule, pre, s[:, sl], pos[:, sl], neg[:, sl])
  pre = tuple(p[:, None] for p in (pre or ()))
  stats = tiles.stats_init(s[:, 0])
  for j in range(0, n, chunk):
    sl = slice(j, j + chunk)
    stats = tiles.stats_update(rule, stats, s[:, sl], pos[:, sl],
                                 neg[:, sl], pre)
  return rule.combine(*tiles.stats_finish(rule, stats))


@pytest.mark.parametrize("name", sorted(RULES))
def test_tile_pieces_make_another_engine_without_touching_a_loss(name):
  rule = RULES[name]
  s, pos, neg = block()
  want = engine.dense_per_anchor(rule, s, pos, neg)
  got = _column_chunk_engine(rule, s, pos, neg, chunk=3)
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[1], want[1])
