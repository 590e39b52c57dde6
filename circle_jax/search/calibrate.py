"""Match thresholds: calibration curves, named cut-points, ``match``, OPIS.

Verification and open-set recognition by nearest neighbour. Each labelled
calibration query ``q`` is answered by its nearest gallery item, with
cosine similarity ``s_q``; the answer is *correct* when that item's label is
``q``'s. At a threshold ``t`` the answer is *accepted* when ``s_q >= t``, and
otherwise the query is declared unknown. Over the queries:

* ``TP(t)``: accepted and correct, ``FP(t)``: accepted and wrong,
  ``FN(t)``: rejected though correct, ``TN(t)``: rejected and wrong (e.g. a
  query of a class the gallery lacks);
* ``precision = TP / (TP + FP)``, ``recall = TP / (TP + FN)`` (over the
  correct answers), ``F1 = 2 TP / (2 TP + FP + FN)``, ``accuracy = (TP + TN)
  / Q``.

:func:`calibration_curve` gives these at every distinct ``s_q`` used as
``t``; they equal scikit-learn's ``precision_recall_curve(correct, s)``
(Pedregosa et al., "Scikit-learn: Machine Learning in Python", JMLR 2011).
:func:`cutpoints` picks named thresholds from it (``best_f1``; a target
precision, ``precision_0.99``: the lowest threshold that reaches it, i.e.
the highest recall at that precision; a target recall), as
tensorflow-similarity's ``calibrate`` does; :func:`match` answers with the
nearest label or ``unknown``.

:func:`opis` is the Operating-Point-Inconsistency Score of Zhang et al.,
"Threshold-Consistent Margin Loss for Open-World Deep Metric Learning"
(ICLR 2024, arXiv:2307.04047): how much the per-class utility at a shared
threshold strays from the overall one::

  OPIS = sum_i w_i / (d_max - d_min) * integral_{d_min}^{d_max}
         (U(i, d) - U(d))^2 dd

The choices made here, where the paper leaves them open or to the reader:
the utility ``U`` is the F1 score of verification *pairs* (as in the paper):
every (query, gallery item) pair, positive when the labels agree, accepted
when the cosine similarity is at least the threshold; ``U(i, d)`` counts the
pairs whose query is of class ``i``, ``U(d)`` all pairs (the paper's
calibration utility, here the same data); ``w_i = 1 / T`` over the ``T``
query classes; the threshold runs over the cosine similarity (distance
``1 - s``, a linear change of variable, so the normalised integral is the
same) from the lowest to the highest pair similarity observed, on a grid
of 2,000 bins of [-1, 1] (the integral is the mean over the grid points in
that range).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np

from circle_jax.errors import UserError

UNKNOWN = "unknown"
BEST_F1 = "best_f1"
# Grid of the OPIS integral: bins of the cosine similarity over [-1, 1].
OPIS_BINS = 2000


class CalibrationError(UserError, ValueError):
  """Calibration inputs or a cut-point that cannot be used."""


def calibration_curve(scores, correct) -> Dict[str, np.ndarray]:
  """Precision, recall, F1 and accuracy at every distinct score.

  Args:
    scores: ``[Q]`` similarity of each query's answer (higher: surer).
    correct: ``[Q]`` bool, whether the answer is right.

  Returns:
    Arrays over the distinct scores in increasing order: ``threshold``,
    ``precision``, ``recall``, ``f1``, ``accuracy`` (float64), ``tp``,
    ``fp`` (int64; accepted = ``score >= threshold``).
  """
  s = np.asarray(scores).reshape(-1)
  y = np.asarray(correct, bool).reshape(-1)
  if s.shape != y.shape or s.size == 0:
    raise CalibrationError(
        f"{s.size} scores for {y.size} answers; calibration needs one score "
        "per labelled query, and at least one query.")
  order = np.argsort(-s, kind="stable")
  s, y = s[order], y[order]
  # The last position of each distinct score (descending).
  last = np.r_[np.nonzero(np.diff(s))[0], s.size - 1]
  tp = np.cumsum(y)[last]
  fp = (last + 1) - tp
  pos = int(y.sum())
  n = s.size
  with np.errstate(divide="ignore", invalid="ignore"):
    precision = tp / (tp + fp)
    recall = tp / pos if pos else np.zeros_like(tp, np.float64)
    f1 = np.where(tp > 0, 2 * tp / (tp + fp + pos), 0.0)
  tn = (n - pos) - fp
  accuracy = (tp + tn) / n
  rev = slice(None, None, -1)
  return {"threshold": s[last][rev], "precision": precision[rev],
          "recall": np.asarray(recall, np.float64)[rev], "f1": f1[rev],
          "accuracy": accuracy[rev], "tp": tp[rev].astype(np.int64),
          "fp": fp[rev].astype(np.int64)}


def _point(curve, i) -> Dict[str, float]:
  return {k: float(curve[k][i]) for k in ("threshold", "precision",
                                          "recall", "f1", "accuracy")}


def cutpoints(curve: Dict[str, np.ndarray], *,
              target_precisions: Sequence[float] = (0.99,),
              target_recalls: Sequence[float] = ()
              ) -> Dict[str, Dict[str, float]]:
  """Named thresholds of a :func:`calibration_curve`.

  ``best_f1``: the highest F1 (the higher threshold among equal ones);
  ``precision_P``: the lowest threshold whose precision is at least ``P``
  (the most recall at that precision), left out where none reaches it;
  ``recall_R``: the highest threshold whose recall is at least ``R``.
  Each maps to its ``threshold``, ``precision``, ``recall``, ``f1`` and
  ``accuracy``.
  """
  out = {}
  f1 = curve["f1"]
  best = np.flatnonzero(f1 == f1.max())[-1]
  out[BEST_F1] = _point(curve, best)
  for p in target_precisions:
    ok = np.flatnonzero(curve["precision"] >= p)
    if ok.size:
      out[f"precision_{p:g}"] = _point(curve, ok[0])
  for r in target_recalls:
    ok = np.flatnonzero(curve["recall"] >= r)
    if ok.size:
      out[f"recall_{r:g}"] = _point(curve, ok[-1])
  return out


def match(scores, labels, threshold: float) -> list:
  """The nearest label where its score reaches ``threshold``, else
  :data:`UNKNOWN`.

  Args:
    scores: ``[Q]`` similarity of each query's nearest gallery item.
    labels: ``Q`` labels of those items.
    threshold: the cut-point's threshold.
  """
  return [lab if s >= threshold else UNKNOWN
          for s, lab in zip(np.asarray(scores).reshape(-1), labels)]


def opis(query, query_labels, gallery, gallery_labels, *,
         chunk_size: int = 512) -> Dict[str, float]:
  """OPIS of per-class F1 over verification pairs (see the module docstring).

  Args:
    query: ``[Q, D]`` embeddings (normalised here) of labelled queries.
    query_labels: ``Q`` labels.
    gallery: ``[G, D]`` embeddings.
    gallery_labels: ``G`` labels.
    chunk_size: query rows per host matmul.

  Returns:
    ``{"opis": float, "num_classes": T, "threshold_low": d_min,
    "threshold_high": d_max}`` (thresholds as cosine similarities).
  """
  from circle_jax.evaluation import tiled_ranking  # pylint: disable=g-import-not-at-top
  q = tiled_ranking.l2_normalize_rows(np.asarray(query, np.float32))
  g = tiled_ranking.l2_normalize_rows(np.asarray(gallery, np.float32))
  ql, gl = np.asarray(query_labels), np.asarray(gallery_labels)
  classes, q_cls = np.unique(ql, return_inverse=True)
  t = classes.size
  pos = np.zeros((t, OPIS_BINS), np.int64)
  neg = np.zeros((t, OPIS_BINS), np.int64)
  for lo in range(0, q.shape[0], chunk_size):
    s = q[lo:lo + chunk_size] @ g.T
    b = np.clip(((s + 1.0) * (OPIS_BINS / 2.0)).astype(np.int64), 0,
                OPIS_BINS - 1)
    same = ql[lo:lo + chunk_size, None] == gl[None, :]
    key = q_cls[lo:lo + chunk_size, None] * OPIS_BINS + b
    pos += np.bincount(key[same], minlength=t * OPIS_BINS).reshape(t, -1)
    neg += np.bincount(key[~same], minlength=t * OPIS_BINS).reshape(t, -1)
  seen = np.flatnonzero((pos + neg).sum(axis=0))
  lo_bin, hi_bin = int(seen[0]), int(seen[-1])

  def f1(p, n):  # accepted: similarity bin >= the threshold's bin
    tp = np.cumsum(p[..., ::-1], axis=-1)[..., ::-1]
    fp = np.cumsum(n[..., ::-1], axis=-1)[..., ::-1]
    fn = p.sum(axis=-1, keepdims=True) - tp
    den = 2 * tp + fp + fn
    return np.where(den > 0, 2 * tp / np.maximum(den, 1), 0.0)

  grid = slice(lo_bin, hi_bin + 1)
  per_class = f1(pos, neg)[:, grid]
  overall = f1(pos.sum(axis=0), neg.sum(axis=0))[grid]
  value = float(np.mean(np.mean((per_class - overall) ** 2, axis=1)))
  return {"opis": value, "num_classes": int(t),
          "threshold_low": lo_bin * 2.0 / OPIS_BINS - 1.0,
          "threshold_high": (hi_bin + 1) * 2.0 / OPIS_BINS - 1.0}


def cutpoint(cuts: Dict[str, Dict[str, float]], name: Optional[str]
             ) -> Dict[str, float]:
  """The cut-point ``name`` (default ``best_f1``), or a one-line error."""
  name = name or BEST_F1
  if not cuts:
    raise CalibrationError(
        "the index has no cut-points yet; run `python -m circle_jax.search "
        "calibrate` with labelled queries first, or pass --threshold.")
  if name not in cuts:
    raise CalibrationError(f"no cut-point {name!r}; the index has "
                           f"{', '.join(sorted(cuts))}.")
  return cuts[name]
