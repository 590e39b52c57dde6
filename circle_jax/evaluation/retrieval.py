"""Exact retrieval metrics on device: Recall@K, P@1, R-Precision, MAP@R, MRR
and mAP.

For every query ``q`` the gallery is ranked by cosine similarity, highest
first; equal similarities are ranked by gallery index (lower index first), so
every ranking, and therefore every metric, is deterministic. With
``gallery=None`` the queries are their own gallery and each query's own entry
(same index) is left out of its ranking.

Let ``R_q`` be the number of gallery items with the label of ``q`` (the query
itself excluded) and ``rel_q(i) = 1`` when the ``i``-th ranked item (1-based)
has the label of ``q``. Over the queries with ``R_q > 0``:

* ``recall@K`` (the definition of the deep-metric-learning papers, e.g. Song
  et al. 2016): the fraction of queries with at least one ``rel_q(i) = 1`` for
  ``i <= K``. It is 1 for every such query once ``K`` reaches the gallery size.
* ``precision@1``: the fraction with ``rel_q(1) = 1`` (equal to ``recall@1``).
* ``r_precision`` (Musgrave et al. 2020): ``mean_q (1/R_q) sum_{i<=R_q}
  rel_q(i)``.
* ``map@r`` (Musgrave et al. 2020): ``mean_q (1/R_q) sum_{i<=R_q} rel_q(i)
  P_q(i)`` with ``P_q(i) = (1/i) sum_{j<=i} rel_q(j)``.
* ``mean_reciprocal_rank`` (PML's name): ``mean_q 1 / rank_q``, ``rank_q``
  the rank of the first relevant item.
* ``mean_average_precision`` (PML's name; its ``k=None``, the whole
  ranking): ``mean_q (1/R_q) sum_i rel_q(i) P_q(i)`` over every rank ``i``,
  i.e. ``(1/R_q) sum_j j / rank_q(j)`` with ``rank_q(j)`` the rank of the
  ``j``-th relevant item.

Queries with ``R_q = 0`` (their class has no gallery item) are left out of all
means and counted in ``num_queries_without_match``. "Has the label of ``q``"
can also mean intersecting multi-hot label sets, or a custom relation, and
the means can be per class first (PML 2.9's ``AccuracyCalculator`` options,
which the tests check): see :mod:`circle_jax.evaluation.relevance`.

How it is computed (exactly, on device, no approximate search): see
:mod:`circle_jax.evaluation.tiled_ranking`.

References:
  Musgrave, Belongie, Lim. "A Metric Learning Reality Check". ECCV 2020.
  https://arxiv.org/abs/2003.08505
  Oh Song, Xiang, Jegelka, Savarese. "Deep Metric Learning via Lifted
  Structured Feature Embedding". CVPR 2016. https://arxiv.org/abs/1511.06452
  Musgrave, Belongie, Lim. pytorch-metric-learning 2.9,
  ``utils.accuracy_calculator.AccuracyCalculator``.
  https://github.com/KevinMusgrave/pytorch-metric-learning
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from circle_jax.evaluation import checks
from circle_jax.evaluation import relevance
from circle_jax.evaluation import tiled_ranking
from circle_jax.evaluation.ks import DEFAULT_KS, default_ks

Array = jax.Array

__all__ = [
    "DEFAULT_KS",
    "DEFAULT_METRICS",
    "METRICS",
    "default_ks",
    "retrieval_metrics",
    "same_parent_metrics",
]

METRICS = relevance.METRICS
DEFAULT_METRICS = relevance.DEFAULT_METRICS


# ----------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------


def retrieval_metrics(
    query,
    query_labels,
    gallery=None,
    gallery_labels=None,
    *,
    ks: Sequence[int] = (1, 2, 4, 8),
    metrics: Sequence[str] = DEFAULT_METRICS,
    avg_of_avgs: bool = False,
    return_per_class: bool = False,
    label_comparison_fn: Optional[Callable[[np.ndarray, np.ndarray],
                                           np.ndarray]] = None,
    chunk_size: int = 1024,
    mesh: Optional[Mesh] = None,
    devices: Optional[Sequence[jax.Device]] = None,
) -> Dict[str, Any]:
  """Exact Recall@K, P@1, R-Precision, MAP@R, MRR and mAP by cosine
  similarity.

  See the module docstring for the definitions and the tie-breaking rule, and
  :mod:`circle_jax.evaluation.tiled_ranking` for how the computation is laid
  out over devices.

  Args:
    query: ``[Q, D]`` float query embeddings (numpy or JAX; any float dtype,
      computed in float32). They need not be normalised.
    query_labels: ``[Q]`` integer class ids, ``[Q, L]`` multi-hot labels
      (0/1 or bool; relevant: the label sets intersect) or, with
      ``label_comparison_fn``, any ``[Q, ...]`` array.
    gallery: ``[G, D]`` float gallery embeddings, or ``None`` to use the
      queries as their own gallery, leaving out each query's own entry.
    gallery_labels: labels of the gallery, as ``query_labels``; given
      exactly when ``gallery`` is.
    ks: the cut-offs ``K`` of Recall@K (any positive ints; ``K`` may exceed
      the gallery size). See :func:`default_ks`.
    metrics: which of :data:`METRICS` to compute besides Recall@K (default
      :data:`DEFAULT_METRICS`). ``mean_average_precision`` costs one more
      pass over the similarities per item of the largest class.
    avg_of_avgs: average per query class (a distinct query label), then
      over the classes (PML's ``avg_of_avgs``).
    return_per_class: each metric as a list over the query classes in
      sorted order, which ``"classes"`` lists (PML's ``return_per_class``).
    label_comparison_fn: PML's, on host numpy arrays: query labels
      ``[c, 1, ...]`` and gallery labels ``[1, G, ...]`` -> ``[c, G]`` bool.
    chunk_size: number of query rows per device step. Each device holds about
      ``4 * chunk_size * G / num_devices`` bytes of similarities.
    mesh: a ``jax.sharding.Mesh`` whose devices (all of its axes, flattened)
      share the gallery. Mutually exclusive with ``devices``.
    devices: the devices that share the gallery. Default (neither given):
      ``jax.local_devices()``, all local devices. The results do not depend on
      the number of devices.

  Returns:
    A dict with Python floats ``recall@K`` (one per ``K``) and one per name
    of ``metrics``, each a mean over the queries with at least one relevant
    gallery item (lists per class with ``return_per_class``), and Python
    ints ``num_queries`` (``Q``) and ``num_queries_without_match`` (queries
    left out of the means). When no query has a match, every metric is 0.0
    (an empty list per class).

  Raises:
    ValueError / TypeError: on inputs of the wrong rank, dtype or length, on
      NaN/inf embeddings, bad ``ks``, ``metrics`` or ``chunk_size``.
  """
  ks = checks.check_ks(ks)
  metrics = relevance.check_metrics(metrics)
  if avg_of_avgs and return_per_class:
    raise ValueError("`avg_of_avgs` and `return_per_class` are mutually "
                     "exclusive (as in PML); pass one of them.")
  chunk_size = checks.check_positive_int(chunk_size, "chunk_size")
  q, q_lab, g, g_lab, compare = relevance.check_inputs(
      query, query_labels, gallery, gallery_labels, label_comparison_fn)
  self_retrieval = gallery is None
  devs = checks.resolve_devices(mesh, devices)

  facts = tiled_ranking.rank_queries(q, q_lab, g, g_lab, self_retrieval, chunk_size, devs,
                        compare=compare,
                        all_ranks="mean_average_precision" in metrics)
  mode = ("per_class" if return_per_class else
          "avg_of_avgs" if avg_of_avgs else "mean")
  return relevance.metrics_from_ranks(*facts, ks, metrics=metrics, labels=q_lab,
                             mode=mode)


def same_parent_metrics(
    query,
    query_labels,
    gallery=None,
    gallery_labels=None,
    *,
    levels: Optional[Sequence[int]] = None,
    ks: Sequence[int] = (1, 2, 4, 8),
    metrics: Sequence[str] = DEFAULT_METRICS,
    chunk_size: int = 1024,
    mesh: Optional[Mesh] = None,
    devices: Optional[Sequence[jax.Device]] = None,
) -> Dict[str, float]:
  """Retrieval within each parent class (PML's ``WithSameParentLabelTester``).

  With hierarchical labels ``[N, H]`` (column 0 the class, column 1 its
  parent, e.g. SOP's super-class), level ``L`` is evaluated as PML 2.9
  does: for each parent ``p`` of level ``L + 1`` among the queries, the
  queries and gallery items of parent ``p`` alone, ranked by
  :func:`retrieval_metrics` with the level-``L`` labels; each metric is the
  mean over the parents (each parent counts once, whatever its size).

  Args:
    query, gallery: as :func:`retrieval_metrics`.
    query_labels, gallery_labels: integer ``[N, H]``, ``H >= 2`` levels.
    levels: the levels ``L`` to evaluate (each ``< H - 1``); default all.
    ks, metrics, chunk_size, mesh, devices: as :func:`retrieval_metrics`.

  Returns:
    ``{"<metric>_level<L>": float}`` for ``recall@K`` and each of
    ``metrics``, and with two levels or more ``"<metric>_average"``, their
    mean over the levels (PML's ``AVERAGE_<metric>``).

  Raises:
    ValueError: labels that are not ``[N, H >= 2]`` integers, a level out
      of range, or a parent without gallery items.
  """
  q_lab = np.asarray(query_labels)
  g_lab = q_lab if gallery is None else np.asarray(gallery_labels)
  for name, lab in (("query_labels", q_lab), ("gallery_labels", g_lab)):
    if lab.ndim != 2 or lab.shape[1] < 2 or not np.issubdtype(
        lab.dtype, np.integer):
      raise ValueError(f"`{name}` must be integer [N, H] labels with H >= 2 "
                       f"levels (class, parent, ...); got shape {lab.shape} "
                       f"and dtype {lab.dtype}.")
  top = q_lab.shape[1] - 1
  levels = tuple(range(top)) if levels is None else tuple(levels)
  if not levels or any(not 0 <= level < top for level in levels):
    raise ValueError(f"`levels` must be in [0, {top}) (a level needs a "
                     f"parent level above it); got {levels}.")
  q = np.asarray(query)
  g = None if gallery is None else np.asarray(gallery)
  out = {}
  for level in levels:
    per_parent = []
    for parent in np.unique(q_lab[:, level + 1]):
      qm = q_lab[:, level + 1] == parent
      gm = g_lab[:, level + 1] == parent
      if not gm.any():
        raise ValueError(f"Parent {parent} (level {level + 1}) has queries "
                         "but no gallery items.")
      per_parent.append(retrieval_metrics(
          q[qm], q_lab[qm, level], None if g is None else g[gm],
          None if g is None else g_lab[gm, level], ks=ks, metrics=metrics,
          chunk_size=chunk_size, mesh=mesh, devices=devices))
    names = [k for k in per_parent[0] if not k.startswith("num_queries")]
    for k in names:
      out[f"{k}_level{level}"] = float(np.mean([r[k] for r in per_parent]))
  if len(levels) > 1:
    for k in names:
      out[f"{k}_average"] = float(np.mean(
          [out[f"{k}_level{level}"] for level in levels]))
  return out
