"""Tests of the dense engine (circle_jax/losses/engine/dense.py): the rule-
derived tile cotangent is the dense engine's autodiff gradient."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.losses import engine
from circle_jax.losses.engine import tiles
from tests.losses.engine.cases import B, LABELS, RULES, block, miner_masks


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", sorted(RULES))
def test_derived_tile_cotangent_is_the_dense_gradient(name, masked):
  rule = RULES[name]
  s, pos, neg = block()
  if masked:
    pm, nm = miner_masks()
    pos, neg = pos & pm, neg & nm
  ct = jnp.asarray(np.random.default_rng(1).uniform(0.5, 2.0, B), jnp.float32)

  # One cotangent per anchor for each term of the rule's per-anchor output.
  ct = jax.tree.map(lambda _: ct,
                    engine.dense_per_anchor(rule, s, pos, neg)[0])

  def dense(s):
    per_anchor, _ = engine.dense_per_anchor(rule, s, pos, neg)
    return sum(jax.tree.leaves(jax.tree.map(lambda t, c: jnp.sum(t * c),
                                            per_anchor, ct)))

  want = jax.grad(dense)(s)
  pre = tiles.prepass_update(rule, None, s, pos, neg)
  stats = tiles.stats_update(rule, tiles.stats_init(s[:, 0]), s, pos, neg,
                               tuple(p[:, None] for p in pre))
  got = tiles.tile_cotangent(rule, s, pos, neg,
                               tuple(p[:, None] for p in pre), stats, ct)
  assert float(jnp.max(jnp.abs(want))) > 1e-3  # the test can fail
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  if rule.statistic == "lse":
    # The singleton anchor (no positives) is not valid: a zero gradient row.
    np.testing.assert_array_equal(np.asarray(got)[LABELS == 9], 0.0)
