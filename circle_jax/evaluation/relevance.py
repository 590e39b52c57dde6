"""Who is relevant to whom, and the retrieval metrics from the ranks (host
side of :mod:`circle_jax.evaluation.retrieval`, whose docstring defines the
metrics).

The labels are class ids (relevant: equal), multi-hot ``[N, L]`` label sets
(relevant: they intersect, as asked of PML for multi-label data) or any
labels with PML's ``label_comparison_fn``. The device program takes the
class ids, or each query's list of relevant gallery indices
(:func:`relevant_by`); the metrics are reduced here from its per-query
facts, as a mean, PML's ``avg_of_avgs`` or ``return_per_class``.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Tuple

import numpy as np

from circle_jax.evaluation import checks

# The metrics besides Recall@K, by PML's AccuracyCalculator names where they
# are new, and those computed by default.
METRICS = ("precision@1", "r_precision", "map@r", "mean_reciprocal_rank",
           "mean_average_precision")
DEFAULT_METRICS = ("precision@1", "r_precision", "map@r")


def check_metrics(metrics) -> Tuple[str, ...]:
  """``metrics`` as a tuple of :data:`METRICS` names, in that order."""
  if isinstance(metrics, str):
    metrics = (metrics,)
  metrics = tuple(metrics)
  unknown = [m for m in metrics if m not in METRICS]
  if unknown:
    raise ValueError(f"Unknown retrieval metric(s) {unknown}; choose among "
                     f"{list(METRICS)} (Recall@K comes from `ks`).")
  return tuple(m for m in METRICS if m in metrics)


def multi_hot_intersect(a, b):
  """Multi-hot labels ``[..., L]`` share a label."""
  return np.any(np.logical_and(a, b), axis=-1)


def check_label_array(labels, size, name, of, label_comparison_fn):
  """``(labels, compare)``: 1-D class ids (``compare`` None: equality, the
  fast path), ``[N, L]`` multi-hot labels (intersection) or, with
  ``label_comparison_fn``, any ``[N, ...]`` array compared by it."""
  if label_comparison_fn is None:
    arr = checks.to_host(labels)
    if arr.ndim > 2:
      raise ValueError(
          f"`{name}` must have rank 1 (class ids [num_items]) or 2 "
          f"(multi-hot [num_items, num_labels]); got shape {arr.shape}. "
          "Pass a `label_comparison_fn` to compare other labels.")
    if arr.ndim != 2:
      return checks.check_labels(labels, size, name, of), None
    if not (arr.dtype == bool or (np.issubdtype(arr.dtype, np.integer)
                                  and np.isin(arr, (0, 1)).all())):
      raise ValueError(
          f"`{name}` of rank 2 are multi-hot labels [num_items, num_labels]"
          f" and must hold only 0 and 1 (or bool); pass a "
          f"`label_comparison_fn` to compare other labels.")
    compare = multi_hot_intersect
  elif not callable(label_comparison_fn):
    raise TypeError(f"`label_comparison_fn` must be callable; got "
                    f"{label_comparison_fn!r}.")
  else:
    arr = checks.to_host(labels)
    compare = label_comparison_fn
  if arr.ndim < 1 or arr.shape[0] != size:
    raise ValueError(
        f"`{name}` has shape {arr.shape} but `{of}` has {size} rows; their "
        "first axes must match.")
  return arr, compare


def check_inputs(query, query_labels, gallery, gallery_labels,
                 label_comparison_fn):
  """The checked ``(q, q_lab, g, g_lab, compare)`` of
  :func:`circle_jax.evaluation.retrieval_metrics` (its arguments): the
  embeddings float32, the gallery the queries when ``gallery`` is None, and
  the label relation of :func:`check_label_array`."""
  q = checks.check_embeddings(query, "query")
  q_lab, compare = check_label_array(query_labels, q.shape[0], "query_labels",
                                     "query", label_comparison_fn)
  if (gallery is None) != (gallery_labels is None):
    raise ValueError(
        "Pass both `gallery` and `gallery_labels`, or neither (then the "
        "queries are their own gallery)."
    )
  if gallery is None:
    return q, q_lab, q, q_lab, compare
  g = checks.check_embeddings(gallery, "gallery")
  g_lab, _ = check_label_array(gallery_labels, g.shape[0], "gallery_labels",
                               "gallery", label_comparison_fn)
  if g.shape[1] != q.shape[1]:
    raise ValueError(
        f"`gallery` has dimension {g.shape[1]} but `query` has "
        f"{q.shape[1]}; they must match."
    )
  if g_lab.shape[1:] != q_lab.shape[1:]:
    raise ValueError(
        f"`gallery_labels` have shape {g_lab.shape} and `query_labels` "
        f"{q_lab.shape}; they must agree past the first axis.")
  return q, q_lab, g, g_lab, compare


def relevant_by(compare, q_lab, g_lab, self_retrieval, rows=256):
  """``(q_pos [Q, P] int32, r [Q])`` of a label relation ``compare``: the
  gallery indices relevant to each query (ascending, -1 padded, ``P`` the
  largest count, at least 1) and their number, the query's own entry left
  out in self-retrieval. Evaluated on the host, ``rows`` queries at a
  time."""
  num_q, num_g = q_lab.shape[0], g_lab.shape[0]
  lists = []
  for lo in range(0, num_q, rows):
    hi = min(lo + rows, num_q)
    m = np.asarray(compare(q_lab[lo:hi, None], g_lab[None]), bool)
    if m.shape != (hi - lo, num_g):
      raise ValueError(
          f"`label_comparison_fn` returned shape {m.shape} for query labels "
          f"{q_lab[lo:hi, None].shape} and gallery labels "
          f"{g_lab[None].shape}; it must return [{hi - lo}, {num_g}].")
    if self_retrieval:
      m[np.arange(hi - lo), np.arange(lo, hi)] = False
    lists += [np.flatnonzero(row) for row in m]
  r = np.array([len(x) for x in lists], np.int64)
  q_pos = np.full((num_q, max(1, int(r.max()))), -1, np.int32)
  for i, x in enumerate(lists):
    q_pos[i, :x.size] = x
  return q_pos, r


def class_ids(q_lab, g_lab, self_retrieval):
  """Dense int32 class ids of queries and gallery, and ``R`` of each query."""
  num_q = q_lab.shape[0]
  classes, inverse = np.unique(np.concatenate([q_lab, g_lab]),
                               return_inverse=True)
  inverse = inverse.astype(np.int32).reshape(-1)
  q_ids, g_ids = inverse[:num_q], inverse[num_q:]
  counts = np.bincount(g_ids, minlength=classes.size)
  r = counts[q_ids] - (1 if self_retrieval else 0)
  return q_ids, g_ids, r


def relevant_indices(q_ids, g_ids, self_retrieval):
  """``[Q, P]`` int32: each query's relevant gallery indices, -1 padded.

  ``P`` is the largest gallery class size (at least 1). In self-retrieval the
  query's own index is left out (set to -1).
  """
  order = np.argsort(g_ids, kind="stable")
  counts = np.bincount(g_ids, minlength=int(max(q_ids.max(), g_ids.max())) + 1)
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
  cnt, st = counts[q_ids], starts[q_ids]
  width = max(1, int(cnt.max()))
  j = np.arange(width)[None, :]
  idx = order[np.minimum(st[:, None] + j, order.size - 1)]
  pos = np.where(j < cnt[:, None], idx, -1).astype(np.int32)
  if self_retrieval:
    pos[pos == np.arange(q_ids.shape[0])[:, None]] = -1
  return pos


def per_query(rank_first, rel, r, ranks, ks, metrics):
  """Each metric's float64 value per query (queries with ``r > 0``)."""
  rel = rel.astype(np.float64)
  rv = r.astype(np.float64)
  k = rel.shape[1]
  positions = np.arange(1, k + 1, dtype=np.float64)[None, :]
  rel_r = rel * (positions <= rv[:, None])
  out = {f"recall@{k_}": (rank_first <= k_).astype(np.float64) for k_ in ks}
  out["precision@1"] = rel[:, 0]
  out["r_precision"] = rel_r.sum(axis=1) / rv
  out["map@r"] = (rel_r * np.cumsum(rel_r, axis=1) / positions).sum(axis=1) / rv
  out["mean_reciprocal_rank"] = 1.0 / rank_first
  if ranks is not None:
    # AP over the whole ranking: the j-th relevant item (by rank) at rank
    # ranks_j adds precision j / ranks_j.
    srt = np.sort(np.where(ranks > 0, ranks, np.iinfo(np.int64).max), axis=1)
    j = np.arange(1, srt.shape[1] + 1, dtype=np.float64)[None, :]
    out["mean_average_precision"] = np.where(
        srt < np.iinfo(np.int64).max, j / srt, 0.0).sum(axis=1) / rv
  return {name: out[name] for name in
          [f"recall@{k_}" for k_ in ks] + list(metrics)}


def class_groups(labels):
  """``(classes, group [n])``: the distinct labels (rows) in sorted order,
  as PML's ``torch.unique(labels, dim=0)``, and each item's class."""
  flat = labels.reshape(labels.shape[0], -1)
  classes, group = np.unique(flat, axis=0, return_inverse=True)
  if labels.ndim == 1:
    names = [c.item() for c in classes[:, 0]]
  else:
    names = [tuple(c.tolist()) for c in classes]
  return names, group.reshape(-1)


def metrics_from_ranks(rank_first, rel, r, ranks, ks, *,
                        metrics=DEFAULT_METRICS, labels=None,
                        mode="mean") -> Dict[str, Any]:
  """The metrics over the queries with ``r > 0``: their mean (``mode``
  ``"mean"``), the mean of the per-class means (``"avg_of_avgs"``) or the
  per-class means (``"per_class"``, lists, and ``"classes"``); a class is
  a distinct row of ``labels``."""
  num_q = r.shape[0]
  has_match = r > 0
  num_valid = int(has_match.sum())
  result: Dict[str, Any] = {}
  if num_valid == 0:
    logging.warning(
        "retrieval_metrics: none of the %d queries has a relevant gallery "
        "item; all metrics are 0.", num_q)
    for name in [f"recall@{k_}" for k_ in ks] + list(metrics):
      result[name] = [] if mode == "per_class" else 0.0
    if mode == "per_class":
      result["classes"] = []
  else:
    values = per_query(
        rank_first[has_match], rel[has_match], r[has_match],
        None if ranks is None else ranks[has_match], ks, metrics)
    if mode != "mean":
      classes, group = class_groups(np.asarray(labels)[has_match])
      size = np.bincount(group).astype(np.float64)
    for name, v in values.items():
      if mode == "mean":
        result[name] = float(np.mean(v))
        continue
      per_class = np.bincount(group, weights=v, minlength=size.size) / size
      result[name] = (per_class.tolist() if mode == "per_class"
                      else float(np.mean(per_class)))
    if mode == "per_class":
      result["classes"] = classes
  result["num_queries"] = int(num_q)
  result["num_queries_without_match"] = int(num_q - num_valid)
  return result
