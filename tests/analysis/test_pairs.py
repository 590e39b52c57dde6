"""Specification of circle_jax/analysis/pairs.py: pair similarity statistics.

The reference is a float64 loop over every pair ``i < j`` (and every
(anchor, other) pair for the hardest pairs), on a tiny case with the edge
cases built in: a zero vector, two samples of one class in the same
direction, the same vector in two classes, an anchor without positives.
"""

import numpy as np
import pytest

from circle_jax.analysis import pairs


def naive_pair_stats(x, labels, edges):
  """Float64 loop over the pairs i < j (the reference)."""
  x = np.asarray(x, np.float64)
  pos, neg = [], []
  for i in range(len(x)):
    for j in range(i + 1, len(x)):
      ni, nj = np.linalg.norm(x[i]), np.linalg.norm(x[j])
      s = 0.0 if ni == 0 or nj == 0 else float(x[i] @ x[j]) / (ni * nj)
      s = min(max(s, -1.0), 1.0)
      (pos if labels[i] == labels[j] else neg).append(s)

  def hist(values):
    counts = [0] * (len(edges) - 1)
    for v in values:
      for k in range(len(edges) - 1):
        last = k == len(edges) - 2
        if edges[k] <= v < edges[k + 1] or (last and v == edges[k + 1]):
          counts[k] += 1
          break
    return counts

  above = sum(1.0 if n > p else 0.5 if n == p else 0.0
              for p in pos for n in neg)
  return {"pos": pos, "neg": neg, "pos_counts": hist(pos),
          "neg_counts": hist(neg),
          "neg_above_pos": above / (len(pos) * len(neg))}


def _check_against_naive(got, want, edges):
  assert got["pos_counts"] == want["pos_counts"]
  assert got["neg_counts"] == want["neg_counts"]
  assert got["num_pos"] == len(want["pos"]) and got["num_neg"] == len(
      want["neg"])
  for key, values in (("pos", want["pos"]), ("neg", want["neg"])):
    assert got[f"mean_{key}"] == pytest.approx(np.mean(values), abs=1e-12)
    assert got[f"std_{key}"] == pytest.approx(np.std(values), abs=1e-7)
  p = np.array(want["pos_counts"]) / len(want["pos"])
  n = np.array(want["neg_counts"]) / len(want["neg"])
  assert got["histogram_overlap"] == pytest.approx(np.minimum(p, n).sum(),
                                                   abs=1e-12)
  assert got["neg_above_pos"] == pytest.approx(want["neg_above_pos"],
                                               abs=1e-12)
  assert got["bins"] == list(edges)


def test_pair_similarity_stats_match_a_naive_float64_loop():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((41, 6)).astype(np.float32)
  labels = rng.integers(0, 5, size=41)
  x[7] = 0.0                           # zero vector: ties at s = 0
  x[12] = 3.0 * x[3]                   # same direction, same class
  labels[12] = labels[3]
  x[20] = x[21]                        # same vector, another class
  labels[20] = (labels[21] + 1) % 5
  edges = np.linspace(-1.0, 1.0, 41)
  want = naive_pair_stats(x, labels, edges)
  for block in (None, 5):
    got = pairs.pair_similarity_stats(x, labels, bins=edges, block_size=block)
    _check_against_naive(got, want, edges)
  # Each anchor's hardest pair, by a loop over all (anchor, other) pairs.
  labels[40] = 99  # an anchor without positives
  for block in (None, 4):
    h_n, h_p = pairs.hardest_pairs(x, labels, block_size=block)
    xd = x.astype(np.float64)
    norm = np.linalg.norm(xd, axis=1)
    for i in range(len(x)):
      sims = [(float(xd[i] @ xd[j]) / (norm[i] * norm[j])
               if norm[i] and norm[j] else 0.0, labels[j] == labels[i])
              for j in range(len(x)) if j != i]
      neg = [min(max(s, -1.0), 1.0) for s, same in sims if not same]
      pos = [min(max(s, -1.0), 1.0) for s, same in sims if same]
      assert h_n[i] == pytest.approx(max(neg), abs=1e-12)
      if pos:
        assert h_p[i] == pytest.approx(min(pos), abs=1e-12)
      else:
        assert np.isnan(h_p[i]) and i == 40


def test_pair_similarity_stats_of_one_class_has_no_negatives():
  got = pairs.pair_similarity_stats(np.eye(3), np.zeros(3, int))
  assert got["num_pos"] == 3 and got["num_neg"] == 0
  assert got["mean_neg"] is None and got["neg_above_pos"] is None
  assert got["mean_pos"] == pytest.approx(0.0)
  with pytest.raises(ValueError):
    pairs.pair_similarity_stats(np.eye(3), np.zeros(4, int))
