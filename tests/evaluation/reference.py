"""Naive references for the evaluation (per-query and per-pixel loops)."""

import numpy as np


def rank_queries(query, query_labels, gallery=None, gallery_labels=None):
  """Per-query ranking facts by brute force in float64.

  Returns a list with, for each query, a dict: ``r`` (number of relevant
  gallery items), ``rank_first`` (1-based rank of the first relevant item, or
  None), ``rel`` (relevance of the whole ranking, bool array), ``sims`` (the
  ranked float64 similarities).
  """
  self_mode = gallery is None
  if self_mode:
    gallery, gallery_labels = query, query_labels
  q = np.asarray(query, np.float64)
  g = np.asarray(gallery, np.float64)
  g_norm = np.linalg.norm(g, axis=1, keepdims=True)
  g = np.where(g_norm > 0, g / np.where(g_norm > 0, g_norm, 1.0), 0.0)
  q_norm = np.linalg.norm(q, axis=1, keepdims=True)
  q = np.where(q_norm > 0, q / np.where(q_norm > 0, q_norm, 1.0), 0.0)
  out = []
  for i in range(q.shape[0]):
    idx = np.arange(g.shape[0])
    if self_mode:
      idx = idx[idx != i]
    sims = np.array([float(np.dot(q[i], g[j])) for j in idx])
    # Highest similarity first, then lowest gallery index.
    order = sorted(range(len(idx)), key=lambda t: (-sims[t], idx[t]))
    ranked = idx[order]
    rel = np.asarray(gallery_labels)[ranked] == query_labels[i]
    r = int(rel.sum())
    first = int(np.argmax(rel)) + 1 if r > 0 else None
    out.append({"r": r, "rank_first": first, "rel": rel,
                "sims": sims[order]})
  return out


def retrieval_metrics(query, query_labels, gallery=None, gallery_labels=None,
                      ks=(1, 2, 4, 8)):
  """Recall@K, P@1, R-Precision and MAP@R from their definitions."""
  facts = rank_queries(query, query_labels, gallery, gallery_labels)
  valid = [f for f in facts if f["r"] > 0]
  res = {}
  for k in ks:
    res[f"recall@{k}"] = np.mean([f["rel"][:k].any() for f in valid])
  res["precision@1"] = np.mean([f["rel"][0] for f in valid])
  rp, mapr = [], []
  for f in valid:
    r, rel = f["r"], f["rel"]
    rp.append(rel[:r].sum() / r)
    total = 0.0
    hits = 0
    for i in range(r):
      if rel[i]:
        hits += 1
        total += hits / (i + 1)
    mapr.append(total / r)
  res["r_precision"] = np.mean(rp)
  res["map@r"] = np.mean(mapr)
  res["num_queries"] = len(facts)
  res["num_queries_without_match"] = len(facts) - len(valid)
  return res


def min_gap_in_top(facts, top):
  """Smallest similarity gap between neighbours of different relevance.

  Only such neighbours can change a metric when rounding swaps them; the
  float32 computation matches the float64 ranking when this is well above
  float32 rounding (about 1e-7 here).
  """
  gaps = [np.inf]
  for f in facts:
    sims, rel = f["sims"][: top + 1], f["rel"][: top + 1]
    differ = rel[1:] != rel[:-1]
    if differ.any():
      gaps.append(np.min((sims[:-1] - sims[1:])[differ]))
  return float(np.min(gaps))


def shifted(x, dy, dx):
  """``x`` [n, H, W, C] moved by ``(dy, dx)`` pixels (positive: down,
  right), edge pixels repeated, one image at a time."""
  out = np.empty_like(x)
  h, w = x.shape[1:3]
  for n in range(x.shape[0]):
    for i in range(h):
      for j in range(w):
        out[n, i, j] = x[n, min(max(i - dy, 0), h - 1),
                         min(max(j - dx, 0), w - 1)]
  return out
