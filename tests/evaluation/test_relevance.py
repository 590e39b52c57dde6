"""Tests of the host side of the retrieval metrics: who is relevant, and the
reductions (the end-to-end numbers against PML 2.9 are in
tests/evaluation/test_retrieval.py)."""

import numpy as np
import pytest

from circle_jax.evaluation import relevance


@pytest.mark.parametrize("self_mode", [True, False])
def test_relevant_indices_list_each_querys_class_members(self_mode):
  g_ids = np.array([2, 0, 2, 1, 2, 0], np.int32)
  q_ids = g_ids if self_mode else np.array([0, 2, 3], np.int32)
  got = relevance.relevant_indices(q_ids, g_ids, self_mode)
  assert got.dtype == np.int32 and got.shape == (len(q_ids), 3)
  for i, c in enumerate(q_ids):
    want = [j for j in range(len(g_ids))
            if g_ids[j] == c and not (self_mode and j == i)]
    assert sorted(v for v in got[i] if v >= 0) == want
    assert np.sum(got[i] >= 0) == len(want)  # the rest is -1 padding


@pytest.mark.parametrize("self_mode", [True, False])
def test_relevant_by_lists_the_related_gallery_items(self_mode):
  # Multi-hot label sets: related when they intersect.
  g = np.array([[1, 0, 0], [0, 1, 1], [1, 1, 0], [0, 0, 0], [0, 0, 1]])
  q = g if self_mode else np.array([[0, 0, 1], [0, 0, 0], [1, 0, 1]])
  pos, r = relevance.relevant_by(relevance.multi_hot_intersect, q, g,
                                 self_mode, rows=2)  # chunks of 2 queries
  for i in range(len(q)):
    want = [j for j in range(len(g))
            if (q[i] & g[j]).any() and not (self_mode and j == i)]
    assert r[i] == len(want)
    assert list(pos[i, :r[i]]) == want and np.all(pos[i, r[i]:] == -1)
  assert pos.shape == (len(q), max(1, r.max())) and pos.dtype == np.int32


def test_class_groups_are_pml_unique_rows_in_sorted_order():
  names, group = relevance.class_groups(np.array([3, 1, 3, 2]))
  assert names == [1, 2, 3] and list(group) == [2, 0, 2, 1]
  names, group = relevance.class_groups(np.array([[1, 0], [0, 1], [1, 0]]))
  assert names == [(0, 1), (1, 0)] and list(group) == [1, 0, 1]


def test_per_class_reduction_of_a_tiny_case():
  # Three queries, classes 5, 5, 9; first relevant items at ranks 1, 2, 4.
  rank_first = np.array([1, 2, 4])
  rel = np.array([[1], [0], [0]], bool)
  r = np.array([1, 1, 1])
  labels = np.array([5, 5, 9])
  kw = dict(metrics=("mean_reciprocal_rank",), labels=labels)
  mean = relevance.metrics_from_ranks(rank_first, rel, r, None, (1,), **kw)
  assert mean["mean_reciprocal_rank"] == pytest.approx((1 + 0.5 + 0.25) / 3)
  avg = relevance.metrics_from_ranks(rank_first, rel, r, None, (1,),
                                     mode="avg_of_avgs", **kw)
  assert avg["mean_reciprocal_rank"] == pytest.approx((0.75 + 0.25) / 2)
  assert avg["recall@1"] == pytest.approx((0.5 + 0.0) / 2)
  per = relevance.metrics_from_ranks(rank_first, rel, r, None, (1,),
                                     mode="per_class", **kw)
  assert per["classes"] == [5, 9]
  assert per["mean_reciprocal_rank"] == pytest.approx([0.75, 0.25])
