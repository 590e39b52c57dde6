"""Specification of circle_jax.evaluation.tiled_ranking's pieces: the
one-pass block reduction and the top-k pre-selection, against naive loops.
(The whole device program, chunked, tiled and sharded, is checked through
its callers in tests/evaluation/test_retrieval.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.evaluation import tiled_ranking


# ----------------------------------------------------------------------------
# The one-pass block reduction and the top-k pre-selection.
# ----------------------------------------------------------------------------


def _tied_similarities(rng, shape):
  """Similarities with many exact ties, -0.0 among them."""
  s = rng.integers(-6, 7, shape).astype(np.float32) / 6
  s[rng.random(shape) < 0.1] = -0.0
  return s


def test_block_max_and_count_match_a_naive_loop():
  rng = np.random.default_rng(0)
  c, tile, block, start = 5, 24, 4, 48
  s = _tied_similarities(rng, (c, tile))
  b = s[np.arange(c), rng.integers(0, tile, c)]     # ties with b exist
  bi = rng.integers(start, start + tile, c).astype(np.int32)
  gidx = np.arange(start, start + tile, dtype=np.int32)
  bmax, count = jax.jit(tiled_ranking._block_max_and_count, static_argnums=4)(
      s, gidx, b, bi, block)
  for i in range(c):
    want = sum(1 for j in range(tile)
               if s[i, j] > b[i] or (s[i, j] == b[i] and gidx[j] < bi[i]))
    assert count[i] == want, i
    for blk in range(tile // block):
      assert bmax[i, blk] == s[i, blk * block:(blk + 1) * block].max()


# 12 blocks: k + 2 <= 9 selects blocks, k = 40 takes every item.
@pytest.mark.parametrize("k", [1, 3, 7, 40])
def test_block_preselection_keeps_the_exact_top_k(k):
  # Two tiles of 24 items (blocks of 4) starting at gallery index 48, the
  # last 5 of them padding; heavy ties; each query skips its own entry.
  rng = np.random.default_rng(k)
  c, tile, block, first, num_gallery = 64, 24, 4, 48, 91
  s = _tied_similarities(rng, (c, 2 * tile))
  s[:, num_gallery - first:] = 0.0                  # padding rows: s == 0
  q_self = rng.integers(first, num_gallery, c).astype(np.int32)
  q_self[::7] = -1                                  # some have none here
  s[np.arange(c), np.maximum(q_self - first, 0)] += 2.0 * (q_self >= 0)
  s_tiles = [s[:, :tile], s[:, tile:]]
  bmax = [x.reshape(c, -1, block).max(axis=2) for x in s_tiles]
  extra = 2

  @jax.jit
  def top(s_tiles, bmax, q_self):
    cand, idx = tiled_ranking._block_candidates(
        s_tiles, bmax, first, q_self, num_gallery, k, extra, block)
    v, at = tiled_ranking._topk_padded(cand, k)
    return v, jnp.take_along_axis(jnp.broadcast_to(idx, cand.shape), at, 1)

  got_v, got_i = top(s_tiles, bmax, q_self)
  # Naive reference: sort each row's valid items by (-value, index).
  for i in range(c):
    items = [(-float(s[i, j]) + 0.0, first + j) for j in range(2 * tile)
             if first + j < num_gallery and first + j != q_self[i]]
    items.sort()
    n = min(k, len(items))
    np.testing.assert_array_equal(got_i[i, :n], [j for _, j in items[:n]])
    np.testing.assert_array_equal(got_v[i, :n], [-v for v, _ in items[:n]])
    assert np.all(got_v[i, n:] == -np.inf)
