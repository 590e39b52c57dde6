"""Statistics of the positive and negative pair similarities of a split.

What Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity
Optimization", CVPR 2020, Fig. 5 shows after training: how the similarities
``s_p`` of the positive pairs (same class) and ``s_n`` of the negative pairs
(different classes) are distributed, here over every unordered pair of a
split's embeddings (:func:`pair_similarity_stats`), and each anchor's hardest
pair ``(max s_n, min s_p)`` (:func:`hardest_pairs`). Cosine similarities in
float64, in row blocks (memory ``O(block * N)``, not ``O(N^2)``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

DEFAULT_BINS = np.linspace(-1.0, 1.0, 81)


def _unit_rows(x: np.ndarray) -> np.ndarray:
  norms = np.linalg.norm(x, axis=1, keepdims=True)
  return x / np.where(norms > 0, norms, 1.0)


def _pair_blocks(x, labels, block_size):
  """Yields ``(positive, negative)`` similarities of the pairs ``i < j``."""
  n = x.shape[0]
  cols = np.arange(n)
  for start in range(0, n, block_size):
    stop = min(start + block_size, n)
    s = np.clip(x[start:stop] @ x.T, -1.0, 1.0)
    upper = cols[None, :] > np.arange(start, stop)[:, None]
    same = labels[start:stop, None] == labels[None, :]
    yield s[upper & same], s[upper & ~same]


def pair_similarity_stats(embeddings, labels, *, bins=DEFAULT_BINS,
                          block_size: Optional[int] = None) -> dict:
  """Histograms and summaries of the positive / negative pair similarities.

  Every unordered pair ``i < j`` counts once (no self pairs): positive when
  the labels agree (``s_p``), negative otherwise (``s_n``). Similarities are
  cosines in float64 (a zero vector has similarity 0 with everything),
  clipped to [-1, 1]. Row blocks keep memory at ``O(block_size * N)``.

  Args:
    embeddings: ``[N, D]`` float array.
    labels: ``[N]`` integer labels.
    bins: histogram bin edges (``numpy.histogram`` convention: the last bin
      includes its right edge).
    block_size: rows per similarity block (default: about 2^24 / N, at
      most 1024).

  Returns:
    A dict of plain Python numbers and lists: ``bins``, ``pos_counts``,
    ``neg_counts``, ``num_pos``, ``num_neg``, ``mean_pos``, ``mean_neg``,
    ``std_pos``, ``std_neg`` (population), ``histogram_overlap`` (the sum
    over bins of the smaller of the two normalised histograms, 0 for
    separated distributions, 1 for identical ones) and ``neg_above_pos``
    (the probability that a random negative pair is more similar than a
    random positive pair, ties counted 1/2, i.e. 1 - ROC AUC; exact, not
    binned). Statistics of an empty set are None.
  """
  x = np.asarray(embeddings, np.float64)
  labels = np.asarray(labels).reshape(-1)
  if x.ndim != 2 or labels.shape[0] != x.shape[0]:
    raise ValueError(f"embeddings [N, D] and labels [N] expected; got "
                     f"{x.shape} and {labels.shape}.")
  edges = np.asarray(bins, np.float64)
  x = _unit_rows(x)
  if block_size is None:
    block_size = max(1, min(1024, 2**24 // max(x.shape[0], 1)))
  pos_counts = np.zeros(edges.size - 1, np.int64)
  neg_counts = np.zeros(edges.size - 1, np.int64)
  positives = []
  neg_sum = neg_sq = 0.0
  for pos, _ in _pair_blocks(x, labels, block_size):
    positives.append(pos)
    pos_counts += np.histogram(pos, edges)[0]
  positives = np.sort(np.concatenate(positives)) if positives else np.zeros(0)
  num_neg, below = 0, 0.0
  for _, neg in _pair_blocks(x, labels, block_size):
    neg_counts += np.histogram(neg, edges)[0]
    num_neg += neg.size
    neg_sum += float(np.sum(neg))
    neg_sq += float(np.sum(neg * neg))
    lo = np.searchsorted(positives, neg, "left")
    hi = np.searchsorted(positives, neg, "right")
    below += float(np.sum(lo) + 0.5 * np.sum(hi - lo))
  num_pos = int(positives.size)

  def moments(total, sq, count):
    if not count:
      return None, None
    mean = total / count
    return mean, math.sqrt(max(sq / count - mean * mean, 0.0))

  mean_pos, std_pos = moments(float(np.sum(positives)),
                              float(np.sum(positives * positives)), num_pos)
  mean_neg, std_neg = moments(neg_sum, neg_sq, num_neg)
  overlap = above = None
  if num_pos and num_neg:
    overlap = float(np.sum(np.minimum(pos_counts / num_pos,
                                      neg_counts / num_neg)))
    above = below / (num_pos * num_neg)
  return {
      "bins": edges.tolist(), "pos_counts": pos_counts.tolist(),
      "neg_counts": neg_counts.tolist(), "num_pos": num_pos,
      "num_neg": int(num_neg), "mean_pos": mean_pos, "mean_neg": mean_neg,
      "std_pos": std_pos, "std_neg": std_neg, "histogram_overlap": overlap,
      "neg_above_pos": above,
  }


def hardest_pairs(embeddings, labels, *,
                  block_size: Optional[int] = None) -> Tuple[np.ndarray,
                                                             np.ndarray]:
  """Each anchor's hardest pair: ``(max_j s_n, min_k s_p)``, each ``[N]``.

  The largest similarity to another class and the smallest to another sample
  of the anchor's class (float64 cosines, as :func:`pair_similarity_stats`);
  NaN where the anchor has no negative / no positive. An anchor whose
  ``min s_p > max s_n`` ranks all its positives above all its negatives.
  """
  x = _unit_rows(np.asarray(embeddings, np.float64))
  labels = np.asarray(labels).reshape(-1)
  n = x.shape[0]
  if block_size is None:
    block_size = max(1, min(1024, 2**24 // max(n, 1)))
  s_n = np.full(n, np.nan)
  s_p = np.full(n, np.nan)
  for start in range(0, n, block_size):
    stop = min(start + block_size, n)
    s = np.clip(x[start:stop] @ x.T, -1.0, 1.0)
    same = labels[start:stop, None] == labels[None, :]
    self_pair = np.arange(n)[None, :] == np.arange(start, stop)[:, None]
    pos, neg = same & ~self_pair, ~same
    s_n[start:stop] = np.where(neg.any(1),
                               np.max(np.where(neg, s, -np.inf), 1), np.nan)
    s_p[start:stop] = np.where(pos.any(1),
                               np.min(np.where(pos, s, np.inf), 1), np.nan)
  return s_n, s_p
