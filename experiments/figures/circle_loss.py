"""The Circle-loss paper's figures, computed from this package's losses.

Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity
Optimization", CVPR 2020 (arXiv 2002.10857). Every curve and arrow here comes
from evaluating or differentiating the loss functions of
:mod:`circle_jax.losses` on one similarity pair ``(s_n, s_p)``; no formula of
the paper is drawn. Each figure is a PNG with a JSON of the numbers it shows.

* **Figure 1** (``fig1_decision_boundaries``): the decision boundaries in the
  ``(s_n, s_p)`` plane. (a) the ``(s_n - s_p)`` losses -- triplet with margin
  ``m``, AM-Softmax / CosFace and the unified loss (eq. 1) -- whose boundary is
  the line ``s_p = s_n + m``; (b) Circle loss (eq. 6 with ``O_p = 1 + m``,
  ``O_n = -m``, ``Delta_p = 1 - m``, ``Delta_n = m``), whose boundary is the
  circle ``s_n^2 + (s_p - 1)^2 = 2 m^2``. Both for two margins, with the
  paper's schematic points A, B, C and the descent direction of each loss
  there.
* **Figure 2** (``fig2_gradients``): the gradient fields ``(-dL/ds_n,
  -dL/ds_p)`` of triplet, AM-Softmax and Circle loss, with the states
  ``A = (s_n, s_p) = (0.8, 0.8)`` and ``B = (0.3, 0.8)``, and the share of
  ``s_n`` in the gradient, ``|dL/ds_n| / (|dL/ds_n| + |dL/ds_p|)``.
* **Figure 5 analogue** (``fig5_similarity_histograms``, only with
  ``--fig5-runs``), one column per trained run: histograms of the
  positive-pair (``s_p``) and negative-pair (``s_n``) cosine similarities of
  the test split, each unordered pair once, and each
  anchor's hardest pair ``(max s_n, min s_p)`` in the ``(s_n, s_p)`` plane, the
  plane in which the paper's Fig. 5 shows similarity pairs after training.

How one pair is fed to each loss and what "decision boundary" means:
:mod:`circle_jax.analysis.pair_plane`; the pair statistics of Fig. 5:
:mod:`circle_jax.analysis.pairs`.

Usage (figures 1 and 2; about 10 s on CPU)::

  python -m experiments.figures.circle_loss --out experiments/results/figures/circle_loss

Figure 5 from trained runs (``--figures 5`` skips recomputing 1 and 2)::

  python -m experiments.figures.circle_loss --figures 5 \\
      --out experiments/results/figures/circle_loss \\
      --fig5-runs circle=RUN1,cosface=RUN2,triplet=RUN3

where ``RUN*`` are workdirs of ``python -m experiments.main`` on
``experiments/configs/omniglot_small.py`` (``experiments.compare.losses``
puts them at ``WORKDIR/<loss>/seed_<s>``). Each run's best checkpoint (the
latest if it kept none; ``--checkpoint`` to choose) embeds the dataset's test
split.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from circle_jax.analysis.pair_plane import (GAMMA, NUM_RAYS,
                                            hyper_text, pair_gradients,
                                            pair_loss, trace_boundary,
                                            line_residual, circle_residual)
from circle_jax.analysis.pairs import (DEFAULT_BINS, hardest_pairs,
                                       pair_similarity_stats)
from experiments.figures import plots

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

DEFAULT_OUT = os.path.join(_REPO, "experiments", "results", "figures",
                           "circle_loss")

FIG1_MARGINS = (0.25, 0.4)
# Fig. 1 of the paper is a schematic without coordinates; these positions
# follow its drawing: A has s_n near 0 and a small s_p, B has both large,
# C lies between them (all three violate the boundaries).
FIG1_POINTS = {"A": (0.1, 0.25), "B": (0.75, 0.9), "C": (0.45, 0.5)}
# Fig. 2: A = {s_n, s_p} = {0.8, 0.8} as in the paper. B is our choice (the
# paper only places it where the (s_n - s_p) losses have converged and
# Circle's s_n has dropped): past the m = 0.4 line, inside the m = 0.4 circle.
FIG2_MARGIN = 0.4
FIG2_POINTS = {"A": (0.8, 0.8), "B": (0.3, 0.8)}
FIG2_GRID = 20         # arrows per axis (cell centres of the unit square)


def _max_abs(x) -> Optional[float]:
  x = np.asarray(x, np.float64)
  x = x[np.isfinite(x)]
  return float(np.max(np.abs(x))) if x.size else None



# ----------------------------------------------------------------------------
# Figure 1: decision boundaries.
# ----------------------------------------------------------------------------


LINE_LOSSES = ("triplet", "cosface", "unified")


def fig1_data(margins: Sequence[float] = FIG1_MARGINS, *,
              gamma: float = GAMMA, num_rays: int = NUM_RAYS) -> dict:
  """The numbers of Figure 1: traced boundaries and the A, B, C arrows."""
  curves = []
  for margin in margins:
    for kind in LINE_LOSSES + ("circle",):
      loss = pair_loss(kind, margin=margin, gamma=gamma)
      pts = trace_boundary(loss, num_rays)
      curves.append({
          "loss": kind, "hyper": dict(loss.hyper), "margin": margin,
          "level": loss.level,
          "shape": "circle" if kind == "circle" else "line",
          "points": _round(pts),
          "num_crossing_rays": int(np.sum(np.isfinite(pts[:, 0]))),
          "max_abs_line_residual": _max_abs(line_residual(pts, margin)),
          "max_abs_circle_residual": _max_abs(circle_residual(pts, margin)),
      })
  arrows = {}
  margin = margins[0]
  for kind in ("unified", "circle"):
    loss = pair_loss(kind, margin=margin, gamma=gamma)
    names = list(FIG1_POINTS)
    pts = np.array([FIG1_POINTS[k] for k in names])
    g_n, g_p = pair_gradients(loss, pts[:, 0], pts[:, 1])
    arrows[kind] = {
        "hyper": dict(loss.hyper),
        "points": {k: {"s_n": float(pts[i, 0]), "s_p": float(pts[i, 1]),
                       "dL_ds_n": float(g_n[i]), "dL_ds_p": float(g_p[i]),
                       "ratio_n_over_p": _ratio(g_n[i], g_p[i])}
                   for i, k in enumerate(names)}}
  return {
      "figure": "Circle loss (Sun et al., CVPR 2020) Fig. 1: decision "
                "boundaries in the (s_n, s_p) plane, traced from "
                "circle_jax.losses",
      "boundary_definition": "boundary of {L > level}: level = log 2 "
                             "(exponent = 0) for the softplus-type losses, "
                             "0 for the triplet hinge",
      "ray_origin": [0.0, 1.0], "num_rays": num_rays, "margins": list(margins),
      "curves": curves, "arrows": arrows,
  }


# ----------------------------------------------------------------------------
# Figure 2: gradient fields.
# ----------------------------------------------------------------------------


FIG2_LOSSES = ("triplet", "cosface", "circle")


def fig2_grid(n: int = FIG2_GRID) -> Tuple[np.ndarray, np.ndarray]:
  """``(s_n, s_p)`` meshgrid of the ``n x n`` cell centres of [0, 1]^2."""
  c = (np.arange(n) + 0.5) / n
  return np.meshgrid(c, c)  # rows: s_p, columns: s_n


def fig2_data(margin: float = FIG2_MARGIN, *, gamma: float = GAMMA,
              n: int = FIG2_GRID) -> dict:
  """The numbers of Figure 2: gradients on the grid and at A and B."""
  s_n, s_p = fig2_grid(n)
  panels = {}
  for kind in FIG2_LOSSES:
    loss = pair_loss(kind, margin=margin, gamma=gamma)
    names = list(FIG2_POINTS)
    pts = np.array([FIG2_POINTS[k] for k in names])
    # One call (one compilation) for the grid and the marked points.
    g_n, g_p = pair_gradients(loss, np.concatenate([s_n.ravel(), pts[:, 0]]),
                              np.concatenate([s_p.ravel(), pts[:, 1]]))
    a_n, a_p = g_n[n * n:], g_p[n * n:]
    g_n, g_p = g_n[:n * n].reshape(n, n), g_p[:n * n].reshape(n, n)
    panels[kind] = {
        "hyper": dict(loss.hyper),
        "dL_ds_n": _round(g_n), "dL_ds_p": _round(g_p),
        "boundary": _round(trace_boundary(loss)),
        "points": {k: {"s_n": float(pts[i, 0]), "s_p": float(pts[i, 1]),
                       "dL_ds_n": float(a_n[i]), "dL_ds_p": float(a_p[i]),
                       "ratio_n_over_p": _ratio(a_n[i], a_p[i])}
                   for i, k in enumerate(names)},
    }
  return {
      "figure": "Circle loss (Sun et al., CVPR 2020) Fig. 2: gradients "
                "(-dL/ds_n, -dL/ds_p) of one pair, by jax.grad of "
                "circle_jax.losses",
      "margin": margin, "gamma": gamma,
      "grid_s_n": _round(s_n[0]), "grid_s_p": _round(s_p[:, 0]),
      "grid_layout": "arrays [i_s_p, i_s_n]",
      "panels": panels,
  }


# ----------------------------------------------------------------------------
# Figure 5 analogue: similarity histograms after training.
# ----------------------------------------------------------------------------


def _restore_and_embed(workdir: str, which: Optional[str],
                       split: Optional[str]):
  """Restores a run's checkpoint and embeds a split (the package's one path).

  Returns ``(embeddings, labels, config, dataset info, split, which, step)``.
  """
  from circle_jax.train import restore as restore_lib  # pylint: disable=g-import-not-at-top
  run = restore_lib.restore_run(workdir, which=which)
  split = split or run.info.eval_splits[0]
  embeddings, labels = run.embed_split(split)
  return embeddings, labels, run.config, run.info, split, run.which, run.step


def embed_run(workdir: str, *, which: Optional[str] = None,
              split: Optional[str] = None):
  """Embeds a run's test split with its best (or latest) checkpoint.

  Rebuilds the model from the run's config, restores the checkpoint and
  embeds the split with the training loop's own evaluation path (eval
  preprocessing, the evaluator's batch size and devices), so the embeddings
  are those the run's test metrics were computed from.

  Args:
    workdir: a folder written by ``experiments.main``.
    which: ``best`` or ``latest`` (default: best if the run kept one).
    split: the split (default: the dataset's first evaluation split).

  Returns:
    ``(embeddings [N, D] float32, labels [N], info)``; ``info`` holds the
    config's loss and dataset, the checkpoint and its step.
  """
  embeddings, labels, config, info, split, which, step = _restore_and_embed(
      workdir, which, split)
  loss = {k: v for k, v in config.loss.to_dict().items() if v is not None}
  run_info = {"workdir": os.path.abspath(workdir), "loss": loss,
              "dataset": info.name, "split": split, "checkpoint": which,
              "step": step}
  return embeddings, labels, run_info


def fig5_data(runs: Mapping[str, str], *, which: Optional[str] = None,
              bins=DEFAULT_BINS) -> dict:
  """The numbers of the Fig. 5 analogue for ``{name: workdir}``."""
  panels = {}
  for name, workdir in runs.items():
    embeddings, labels, info = embed_run(workdir, which=which)
    stats = pair_similarity_stats(embeddings, labels, bins=bins)
    h_n, h_p = hardest_pairs(embeddings, labels)
    both = np.isfinite(h_n) & np.isfinite(h_p)
    panels[name] = dict(
        info, num_images=int(len(labels)), **stats,
        anchor_hardest_s_n=_round(h_n, 6), anchor_hardest_s_p=_round(h_p, 6),
        anchors_separated=(float(np.mean(h_p[both] > h_n[both]))
                           if both.any() else None))
  return {
      "figure": "Circle loss (Sun et al., CVPR 2020) Fig. 5 analogue: "
                "cosine similarities of the positive (s_p) and negative "
                "(s_n) pairs of the test split after training, each "
                "unordered pair once; and each anchor's hardest pair "
                "(max s_n, min s_p) in the (s_n, s_p) plane",
      "panels": panels,
  }


def fig5_table(data: dict) -> List[str]:
  """Markdown table rows of the Fig. 5 numbers, one run per row.

  Columns: run (loss), checkpoint step, ``s_p`` and ``s_n`` mean +- std,
  histogram overlap, ``P(s_n > s_p)`` and the share of anchors whose hardest
  positive beats their hardest negative (the README of the figures quotes
  these rows; a test checks them against the committed JSON).
  """
  rows = ["| run | step | s_p mean ± std | s_n mean ± std | histogram overlap "
          "| P(s_n > s_p) | anchors with min s_p > max s_n |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for name, p in data["panels"].items():
    loss = dict(p["loss"])
    loss_name = loss.pop("name", name)
    run = name if name == loss_name else f"{name} ({loss_name})"
    sep = p.get("anchors_separated")
    rows.append(
        f"| {run} ({hyper_text(loss)}) | {p['step']} "
        f"| {p['mean_pos']:.3f} ± {p['std_pos']:.3f} "
        f"| {p['mean_neg']:.3f} ± {p['std_neg']:.3f} "
        f"| {p['histogram_overlap']:.3f} | {p['neg_above_pos']:.4f} "
        f"| {'-' if sep is None else f'{100 * sep:.2f} %'} |")
  return rows


# ----------------------------------------------------------------------------
# Output.
# ----------------------------------------------------------------------------


def _round(x, digits: int = 7):
  """Nested lists of floats with ``digits`` significant digits (NaN -> None)."""
  x = np.asarray(x, np.float64)
  out = np.vectorize(lambda v: float(f"{v:.{digits}g}"), otypes=[object])(x)
  out = np.where(np.isfinite(x), out, None)
  return out.tolist()


def _ratio(g_n, g_p) -> Optional[float]:
  return float(abs(g_n) / abs(g_p)) if g_p != 0 else None


def write_json(data: dict, path: str) -> None:
  with open(path, "w") as f:
    json.dump(data, f, indent=1, allow_nan=False)
    f.write("\n")


FIGURES = {
    "1": ("fig1_decision_boundaries", fig1_data, plots.plot_fig1),
    "2": ("fig2_gradients", fig2_data, plots.plot_fig2),
}


def write_figures(out: str, figures: Sequence[str] = ("1", "2"),
                  fig5_runs: Optional[Mapping[str, str]] = None,
                  which: Optional[str] = None) -> Dict[str, str]:
  """Computes and writes the figures; returns ``{figure: png path}``."""
  os.makedirs(out, exist_ok=True)
  written = {}
  for fig in figures:
    if fig == "5":
      if not fig5_runs:
        raise ValueError("Figure 5 needs --fig5-runs name=WORKDIR,...")
      stem, data = "fig5_similarity_histograms", fig5_data(fig5_runs,
                                                           which=which)
      plot = plots.plot_fig5
    else:
      stem, compute, plot = FIGURES[fig]
      data = compute()
    png = os.path.join(out, stem + ".png")
    write_json(data, os.path.join(out, stem + ".json"))
    plot(data, png)
    written[fig] = png
    if fig == "5":
      print("\n".join(fig5_table(data)))
  return written


def parse_runs(text: str) -> Dict[str, str]:
  """``circle=DIR,cosface=DIR`` -> ``{'circle': 'DIR', 'cosface': 'DIR'}``."""
  runs = {}
  for item in filter(None, (t.strip() for t in text.split(","))):
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
      raise ValueError(f"--fig5-runs: expected NAME=WORKDIR, got {item!r}.")
    runs[name] = path
  return runs


def main(argv: Optional[Sequence[str]] = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=DEFAULT_OUT, help="output folder")
  p.add_argument("--figures", default=None,
                 help="comma-separated subset of 1,2,5 (default: 1,2, and 5 "
                      "when --fig5-runs is given)")
  p.add_argument("--fig5-runs", default="",
                 help="NAME=WORKDIR,... runs of experiments.main for Fig. 5, "
                      "e.g. circle=DIR,cosface=DIR,triplet=DIR")
  p.add_argument("--checkpoint", choices=("best", "latest"), default=None,
                 help="Fig. 5 checkpoint (default: best if the run kept one)")
  args = p.parse_args(argv)
  runs = parse_runs(args.fig5_runs)
  if args.figures:
    figures = [f.strip() for f in args.figures.split(",") if f.strip()]
  else:
    figures = ["1", "2"] + (["5"] if runs else [])
  unknown = sorted(set(figures) - {"1", "2", "5"})
  if unknown:
    p.error(f"--figures: unknown figure(s) {unknown}; use 1, 2, 5.")
  if "5" in figures and not runs:
    p.error("figure 5 needs --fig5-runs NAME=WORKDIR,...")
  for fig, png in write_figures(args.out, figures, runs,
                                args.checkpoint).items():
    print(f"figure {fig}: {png} (+ .json)")


if __name__ == "__main__":
  main()
