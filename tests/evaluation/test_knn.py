"""Exact kNN search on the devices against NumPy brute force."""

import jax
import numpy as np
import pytest

from circle_jax.evaluation import knn


def brute_force(q, g, k, exclude_self=False):
  """float64 cosine similarities, ranked by (score desc, index asc)."""
  q = np.asarray(q, np.float64)
  g = np.asarray(g, np.float64)
  s = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ (
      g / np.linalg.norm(g, axis=1, keepdims=True)).T
  if exclude_self:
    np.fill_diagonal(s, -np.inf)
  idx = np.argsort(-s, axis=1, kind="stable")[:, :k]
  return np.take_along_axis(s, idx, axis=1), idx


@pytest.mark.parametrize("num_q,num_g,k,chunk", [
    (37, 1000, 10, 16), (5, 9000, 3, 1024), (64, 300, 1, 8)])
def test_equals_numpy_brute_force(num_q, num_g, k, chunk):
  rng = np.random.default_rng(num_g)
  g = rng.normal(size=(num_g, 12)).astype(np.float32)
  q = rng.normal(size=(num_q, 12)).astype(np.float32)
  scores, idx = knn.nearest_neighbors(q, g, k=k, chunk_size=chunk)
  ref_s, ref_i = brute_force(q, g, k)
  np.testing.assert_array_equal(idx, ref_i)
  np.testing.assert_allclose(scores, ref_s, atol=1e-6)
  assert scores.dtype == np.float32 and idx.dtype == np.int64


def test_ties_go_to_the_lower_gallery_index():
  g = np.array([[1, 0], [0, 1], [1, 0], [2, 0], [1, 1e-9]], np.float32)
  _, idx = knn.nearest_neighbors(np.array([[1, 0]], np.float32), g, k=4)
  assert idx.tolist() == [[0, 2, 3, 4]]
  # Across the tiles of the scan (9,000 rows: 3 tiles): copies of a row in
  # later tiles follow it in gallery order.
  g = np.random.default_rng(2).normal(size=(9000, 4)).astype(np.float32)
  g[[4000, 8999]] = g[10]
  g[6000] = g[20]
  _, idx = knn.nearest_neighbors(g[[10, 20]], g, k=3)
  np.testing.assert_array_equal(idx, brute_force(g[[10, 20]], g, 3)[1])
  assert idx[0].tolist() == [10, 4000, 8999] and idx[1, :2].tolist() == [
      20, 6000]


def test_exclude_self_and_a_short_gallery():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(50, 6)).astype(np.float32)
  _, idx = knn.nearest_neighbors(x, x, k=5, exclude_self=True)
  np.testing.assert_array_equal(idx, brute_force(x, x, 5, True)[1])
  scores, idx = knn.nearest_neighbors(x[:2], x[:3], k=5)
  assert (idx[:, 3:] == -1).all() and np.isneginf(scores[:, 3:]).all()
  assert sorted(idx[0, :3]) == [0, 1, 2]


def test_eight_devices_give_the_same_neighbours_as_one():
  assert jax.device_count() == 8  # tests/conftest.py
  rng = np.random.default_rng(1)
  g = rng.normal(size=(5000, 16)).astype(np.float32)
  q = rng.normal(size=(40, 16)).astype(np.float32)
  one = knn.nearest_neighbors(q, g, k=7, devices=jax.devices()[:1])
  eight = knn.nearest_neighbors(q, g, k=7, devices=jax.devices())
  np.testing.assert_array_equal(one[1], eight[1])
  np.testing.assert_array_equal(one[0], eight[0])
  np.testing.assert_array_equal(one[1], brute_force(q, g, 7)[1])


def test_a_sharded_gallery_is_reused_and_bad_input_is_named():
  g = knn.shard_gallery(np.eye(4, dtype=np.float32), devices=jax.devices())
  _, idx = knn.nearest_neighbors(np.eye(4, dtype=np.float32)[::-1], g, k=1)
  assert idx[:, 0].tolist() == [3, 2, 1, 0]
  with pytest.raises(ValueError, match="dimension 3 but the gallery has 4"):
    knn.nearest_neighbors(np.ones((1, 3), np.float32), g, k=1)
  with pytest.raises(ValueError, match="`k` must be >= 1"):
    knn.nearest_neighbors(np.ones((1, 4), np.float32), g, k=0)
