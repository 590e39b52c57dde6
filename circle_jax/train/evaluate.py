"""Evaluation of a run: the metrics of a state on the test or validation split,
and the run's final table."""

from __future__ import annotations

import re
from typing import Any, Dict, Tuple

import jax
import numpy as np

from circle_jax import config_facts
from circle_jax import evaluation as eval_lib
from circle_jax.evaluation import embedding as embedding_lib
from circle_jax.evaluation import knn
from circle_jax.evaluation import retrieval_figure as figure_lib
from circle_jax.train import console as console_lib
from circle_jax.train import run as run_lib
from circle_jax.train import state as state_lib


class Evaluator:
  """Embeds an evaluation split and computes the metrics of the config.

  ``evaluator.test(tree)`` evaluates the dataset's test split(s) (In-Shop:
  queries against the gallery; otherwise each image against the others),
  ``evaluator.validation(tree)`` the held-out train classes. ``tree`` is a
  host state tree (``state_to_tree`` then ``to_host``, or a checkpoint).
  With ``config.fewshot.ways`` set, both add the episodic few-shot accuracies
  ``fewshot_{N}way_{K}shot`` and their ``_ci95``
  (:func:`circle_jax.evaluation.fewshot_metrics`).

  Args:
    config: the run's config.
    info: the dataset's spec.
    model: the model (:func:`circle_jax.train.run.build_model`).
    placement: the run's :class:`circle_jax.parallel.Placement`.
    validation_source: the held-out train classes, or None.
  """

  def __init__(self, config, info, model, placement, validation_source=None):
    self.config, self.info = config, info
    self.placement = placement
    self.apply_fn = embedding_lib.eval_apply(config, model)
    self.preprocess = config_facts.eval_preprocess(config, info)
    self.sources = {split: run_lib.load_split(config, info, split)
                    for split in info.eval_splits}
    self.validation_source = validation_source
    self.last_test = {}
    self.ks = tuple(config.eval_ks or info.ks)

  def _embed(self, host_tree, source):
    return embedding_lib.embed_split(
        state_lib.model_variables(host_tree), self.apply_fn, source,
        self.preprocess, placement=self.placement,
        batch_size=self.config.batch.eval_batch_size,
        num_threads=self.config.dataset.num_threads)

  def _metrics(self, emb, lab, gallery=()):
    out = dict(eval_lib.retrieval_metrics(
        emb, lab, *gallery, ks=self.ks,
        metrics=config_facts.retrieval_metrics(self.config),
        avg_of_avgs=bool(self.config.get("eval_avg_of_avgs", False))))
    if self.config.eval_clustering:
      out.update(eval_lib.clustering_metrics(
          emb, lab, key=jax.random.PRNGKey(self.config.seed)))
    fs = self.config.fewshot
    if fs.ways:
      # Episodes among all the split's images (In-Shop: queries and gallery).
      if gallery:
        emb = np.concatenate([emb, gallery[0]])
        lab = np.concatenate([lab, gallery[1]])
      out.update(eval_lib.fewshot_metrics(
          emb, lab, ways=tuple(fs.ways), shots=tuple(fs.shots),
          queries=fs.queries, episodes=fs.episodes, seed=fs.seed,
          classifier=fs.classifier))
    return {k: float(v) for k, v in out.items()}

  def test(self, host_tree) -> Dict[str, float]:
    embedded = {s: self._embed(host_tree, src)
                for s, src in self.sources.items()}
    # Kept for draw_retrievals (the state last evaluated on the test split).
    self.last_test = embedded
    if "query" in embedded:
      (q, ql), gallery = embedded["query"], embedded["gallery"]
      return self._metrics(q, ql, gallery)
    return self._metrics(*embedded[self.info.eval_splits[0]])

  def validation(self, host_tree) -> Dict[str, float]:
    if self.validation_source is None:
      raise ValueError("This config has no validation split "
                       "(dataset.validation_fraction = 0).")
    return self._metrics(*self._embed(host_tree, self.validation_source))

  __call__ = test

  def draw_retrievals(self, path: str, *, embedded=None,
                      num_queries: int = 8, k: int = 8, seed: int = 0) -> str:
    """Draws the last :meth:`test`'s retrievals to the PNG ``path``.

    ``embedded``: the embedded test splits to draw instead
    (``evaluator.last_test`` saved earlier).

    A fixed sample of ``num_queries`` test queries (seeded by ``seed``),
    each with its ``k`` nearest items of the split (the query left out;
    In-Shop: of the gallery split), framed green where the label agrees.
    """
    embedded = embedded or self.last_test
    if "query" in embedded:
      (q, ql), (g, gl) = embedded["query"], embedded["gallery"]
      q_src, g_src = self.sources["query"], self.sources["gallery"]
    else:
      split = self.info.eval_splits[0]
      (q, ql), (g, gl) = embedded[split], embedded[split]
      q_src = g_src = self.sources[split]
    picked = figure_lib.sample_queries(len(q), num_queries, seed)
    # Self-retrieval: one more item, then the query's own entry dropped.
    own = q_src is g_src
    scores, idx = knn.nearest_neighbors(q[picked], g, k=k + int(own))
    if own:
      keep = idx != picked[:, None]
      keep[keep.all(axis=1), -1] = False
      scores = scores[keep].reshape(len(picked), k)
      idx = idx[keep].reshape(len(picked), k)
    images = [[g_src[int(i)]["image"] if i >= 0 else None for i in row]
              for row in idx]
    correct = [[bool(gl[i] == ql[p]) for i in row]
               for p, row in zip(picked, idx)]
    return figure_lib.draw_retrievals(
        path, [q_src[int(p)]["image"] for p in picked], images,
        scores=scores, correct=correct,
        titles=[f"label {int(ql[p])}" for p in picked])


_SHOWN = ("recall@1", "map@r", "nmi")
_ORDER = ("precision@1", "r_precision", "map@r", "mean_reciprocal_rank",
          "mean_average_precision", "nmi", "ami")


def _fewshot_order(names) -> Tuple[str, ...]:
  """The ``fewshot_{N}way_{K}shot`` metrics among ``names`` by ``(N, K)``,
  each followed by its ``_ci95``."""
  found = {}
  for n in names:
    m = re.fullmatch(r"fewshot_(\d+)way_(\d+)shot(_ci95)?", n)
    if m:
      found[n] = (int(m.group(1)), int(m.group(2)), bool(m.group(3)))
  return tuple(sorted(found, key=found.get))


def summary(metrics: Dict[str, float]) -> str:
  """``recall@1 0.6100, map@r 0.2700, nmi 0.5000`` (the metrics shown, and
  the few-shot accuracies when computed)."""
  shown = _SHOWN + tuple(n for n in _fewshot_order(metrics)
                         if not n.endswith("_ci95"))
  return ", ".join(f"{k} {metrics[k]:.4f}" for k in shown if k in metrics)


def result_table(result: Dict[str, Any]) -> str:
  """The final table of a run (test-split metrics), with how the step was chosen."""
  cols = {}
  if result.get("init"):
    cols["init"] = result["init"]
  cols[f"final@{result['step']}"] = result["final"]
  best, res = result.get("best"), result["result"]
  if res["selection"] == "validation":
    cols[f"selected@{res['step']}"] = res["test"]
  elif res["selection"] == "test":
    cols[f"best@{res['step']} (test-selected)"] = res["test"]
  cfg = result.get("config", {})
  lines = [f"{cfg.get('dataset', {}).get('name')} / "
           f"{cfg.get('model', {}).get('name')} / "
           f"{cfg.get('loss', {}).get('name')}: test-split metrics",
           console_lib.metrics_table(
               cols, order=_ORDER + _fewshot_order(
                   {n for c in cols.values() for n in c or {}}))]
  if res["selection"] == "validation":
    val = best["validation"]
    lines.append(
        f"selected@{res['step']}: the step with the best validation "
        f"{res['metric']} ({val[res['metric']]:.4f}) on "
        f"{result['validation']['num_classes']} held-out train classes; its "
        "test numbers are the result.")
  elif res["selection"] == "test":
    lines.append(
        f"note: best@{res['step']} was selected on the TEST split (no "
        "validation split), so it is optimistic; report final, or set "
        "--config.dataset.validation_fraction to select on held-out train "
        "classes.")
  if res.get("note"):
    lines.append(f"note: {res['note']}")
  return "\n".join(lines)
