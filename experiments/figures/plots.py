"""The charts of the experiment scripts (matplotlib, Agg backend).

* :func:`write_bars`: the loss comparison's bar chart
  (``experiments.compare.losses``);
* :func:`write_heatmap`: a metric over a hyperparameter grid
  (``experiments.sweep``);
* :func:`plot_fig1`, :func:`plot_fig2`, :func:`plot_fig5`: the Circle-loss
  paper's figures from the numbers ``experiments.figures.circle_loss`` computes.

Each takes the numbers a script has computed (and writes to JSON or
Markdown beside the chart) and only draws them.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any, Dict, Sequence, Tuple

import matplotlib
matplotlib.use("Agg")
from matplotlib import pyplot as plt
import numpy as np

from circle_jax.analysis.pair_plane import LOSS_LABELS, hyper_text

_SHOWN = 1e-3          # Fig. 2 draws gradients of at least this * the max


# ----------------------------------------------------------------------------
# Comparison and sweep charts.
# ----------------------------------------------------------------------------


def write_bars(path: pathlib.Path, summary: Dict[str, Dict[str, Any]],
               metrics: Sequence[Tuple[str, str]], title: str) -> None:
  """Horizontal bars of ``metrics`` (``(key, label)``, in %) per loss, one
  panel each, sorted by the first, with the seeds' standard deviation
  (:class:`circle_jax.results.Stat`) as error bars
  (``experiments.compare.losses``)."""
  rows = [(loss, row) for loss, row in summary.items()
          if row.get(metrics[0][0]) is not None]
  rows.sort(key=lambda lr: lr[1][metrics[0][0]].mean)
  names = [loss for loss, _ in rows]
  fig, axes = plt.subplots(
      1, len(metrics), sharey=True,
      figsize=(10, 1.2 + 0.38 * max(len(rows), 1)), squeeze=False)
  for ax, (key, label) in zip(axes[0], metrics):
    stats = [row.get(key) for _, row in rows]
    means = [100 * s.mean if s else 0.0 for s in stats]
    errs = [100 * s.std if s and s.std is not None else 0.0 for s in stats]
    ys = range(len(rows))
    ax.barh(ys, means, xerr=errs, color="#4c72b0", ecolor="#333333",
            capsize=3, height=0.7)
    top = max([m + e for m, e in zip(means, errs)] or [1.0])
    for y, m, e, s in zip(ys, means, errs, stats):
      if s is not None:
        ax.text(m + e + 0.01 * top, y, f"{m:.1f}", va="center", fontsize=8)
    ax.set_xlim(0, top * 1.12)
    ax.set_xlabel(f"{label} (%) on the test split, mean ± std over seeds")
    ax.set_title(label)
    ax.grid(axis="x", alpha=0.3)
  axes[0][0].set_yticks(range(len(rows)))
  axes[0][0].set_yticklabels(names, fontsize=9)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_heatmap(path: str, grid, values: Sequence[float], *,
                  title: str) -> None:
  """A PNG heatmap of per-model values over a 1-D or 2-D
  :class:`circle_jax.train.grid.Grid`, annotated (``experiments.sweep``)."""
  if len(grid.names) > 2:
    raise ValueError("Heatmaps need a 1-D or 2-D grid.")
  mat = grid.matrix(values)
  rows = grid.values[0] if len(grid.names) == 2 else ("",)
  cols = grid.values[-1]
  fig, ax = plt.subplots(figsize=(max(4.5, 1.6 + 1.0 * len(cols)),
                                  1.6 + 0.7 * len(rows)))
  im = ax.imshow(np.ma.masked_invalid(mat), cmap="viridis", aspect="auto")
  finite = mat[np.isfinite(mat)]
  mid = (finite.min() + finite.max()) / 2 if finite.size else 0.0
  for i in range(mat.shape[0]):
    for j in range(mat.shape[1]):
      v = mat[i, j]
      ax.text(j, i, "NaN" if not np.isfinite(v) else f"{v:.3f}", ha="center",
              va="center", fontsize=9,
              color="white" if np.isfinite(v) and v < mid else "black")
  ax.set_xticks(range(len(cols)), [f"{c:g}" for c in cols])
  ax.set_xlabel(grid.names[-1])
  ax.set_yticks(range(len(rows)), [f"{r:g}" if r != "" else "" for r in rows])
  if len(grid.names) == 2:
    ax.set_ylabel(grid.names[0])
  ax.set_title(title)
  fig.colorbar(im, ax=ax)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ----------------------------------------------------------------------------
# The Circle-loss paper's figures.
# ----------------------------------------------------------------------------


_MARGIN_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")
_LINE_STYLES = {"unified": dict(ls="-", lw=5.0, alpha=0.35),
                "cosface": dict(ls="--", lw=2.0, alpha=1.0),
                "triplet": dict(ls="none", marker="o", ms=3.5, markevery=6),
                "circle": dict(ls="-", lw=2.0, alpha=1.0)}


def _unit_square(ax, title):
  ax.set_xlim(0.0, 1.0)
  ax.set_ylim(0.0, 1.0)
  ax.set_aspect("equal")
  ax.set_xlabel("$s_n$ (between-class similarity)")
  ax.set_ylabel("$s_p$ (within-class similarity)")
  ax.set_title(title, fontsize=10)
  ax.grid(True, alpha=0.3)


def _draw_arrows(ax, arrows, length=0.13):
  for name, p in arrows["points"].items():
    v = np.array([-p["dL_ds_n"], -p["dL_ds_p"]])
    v = v / max(np.linalg.norm(v), 1e-30) * length
    ax.plot(p["s_n"], p["s_p"], "ko", ms=5, zorder=5)
    ax.annotate("", xy=(p["s_n"] + v[0], p["s_p"] + v[1]),
                xytext=(p["s_n"], p["s_p"]),
                arrowprops=dict(arrowstyle="->", lw=1.8, color="k"), zorder=5)
    ax.annotate(f"{name}\n|∂L/∂$s_n$|:|∂L/∂$s_p$| = "
                f"{p['ratio_n_over_p']:.2f}",
                (p["s_n"], p["s_p"]), textcoords="offset points",
                xytext=(6, -22), fontsize=7.5)


def plot_fig1(data: dict, path: str) -> None:
  """Writes Figure 1 (two panels) to ``path``."""
  fig, axes = plt.subplots(1, 2, figsize=(12, 6.2))
  margins = data["margins"]
  ax = axes[0]
  for i, margin in enumerate(margins):
    color = _MARGIN_COLORS[i % len(_MARGIN_COLORS)]
    for c in data["curves"]:
      if c["margin"] != margin or c["loss"] == "circle":
        continue
      pts = np.array(c["points"], np.float64)
      ax.plot(pts[:, 0], pts[:, 1], color=color, **_LINE_STYLES[c["loss"]],
              label=f"{LOSS_LABELS[c['loss']]}, {hyper_text(c['hyper'])}")
  arrows = data["arrows"]["unified"]
  _draw_arrows(ax, arrows)
  _unit_square(ax, "(a) reducing $(s_n - s_p)$: boundary $s_p = s_n + m$\n"
               f"arrows: descent direction of the unified loss, "
               f"{hyper_text(arrows['hyper'])}")
  ax.legend(loc="lower right", fontsize=7.5)
  ax = axes[1]
  for i, margin in enumerate(margins):
    color = _MARGIN_COLORS[i % len(_MARGIN_COLORS)]
    for c in data["curves"]:
      if c["margin"] != margin or c["loss"] != "circle":
        continue
      pts = np.array(c["points"], np.float64)
      ax.plot(pts[:, 0], pts[:, 1], color=color, **_LINE_STYLES["circle"],
              label=f"Circle loss, {hyper_text(c['hyper'])}: traced boundary")
  ax.plot([0.0], [1.0], marker="+", color="k", ms=12, mew=2, clip_on=False,
          label="centre (0, 1); radius $\\sqrt{2}\\,m$")
  arrows = data["arrows"]["circle"]
  _draw_arrows(ax, arrows)
  _unit_square(ax, "(b) Circle loss, $O_p=1+m$, $O_n=-m$, $\\Delta_p=1-m$, "
               "$\\Delta_n=m$\narrows: descent direction of Circle loss, "
               f"{hyper_text(arrows['hyper'])}")
  ax.legend(loc="lower right", fontsize=7.5)
  fig.suptitle("Decision boundaries traced from circle_jax.losses (boundary "
               "of {L > log 2}; triplet: of {L > 0}); A, B, C: positions "
               "after the paper's schematic Fig. 1", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_fig2(data: dict, path: str) -> None:
  """Writes Figure 2 (gradient fields and the s_n share) to ``path``."""
  s_n = np.array(data["grid_s_n"])
  s_p = np.array(data["grid_s_p"])
  sn, sp = np.meshgrid(s_n, s_p)
  kinds = list(data["panels"])
  fig, axes = plt.subplots(2, len(kinds), figsize=(5.2 * len(kinds), 10.4))
  for j, kind in enumerate(kinds):
    panel = data["panels"][kind]
    g_n = np.array(panel["dL_ds_n"])
    g_p = np.array(panel["dL_ds_p"])
    mag = np.hypot(g_n, g_p)
    top = mag.max() if mag.max() > 0 else 1.0
    boundary = np.array(panel["boundary"], np.float64)
    title = f"{LOSS_LABELS[kind]} ({hyper_text(panel['hyper'])})"
    # Top: descent directions, length proportional to |grad| / max |grad|.
    ax = axes[0, j]
    shown = mag >= _SHOWN * top
    q = ax.quiver(sn[shown], sp[shown], -g_n[shown] / top, -g_p[shown] / top,
                  mag[shown] / top, cmap="viridis",
                  norm=matplotlib.colors.LogNorm(_SHOWN, 1.0), angles="xy",
                  scale_units="xy", scale=1.0 / 0.045, width=0.006,
                  pivot="mid")
    ax.plot(sn[~shown], sp[~shown], ".", color="0.6", ms=3,
            label=f"|∇L| < {_SHOWN:g} max |∇L|")
    fig.colorbar(q, ax=ax, fraction=0.046, pad=0.04,
                 label="|∇L| / max |∇L|")
    ax.plot(boundary[:, 0], boundary[:, 1], "r-", lw=1.5,
            label="decision boundary (traced)")
    _mark_points(ax, panel["points"])
    ax.text(0.02, 0.98, _points_text(panel["points"]), transform=ax.transAxes,
            va="top", fontsize=7.5, zorder=7,
            bbox=dict(boxstyle="round,pad=0.3", fc="w", alpha=0.9))
    _unit_square(ax, f"{title}\narrows: $(-\\partial L/\\partial s_n, "
                 f"-\\partial L/\\partial s_p)$, max |∇L| = {top:.3g}")
    ax.legend(loc="lower right", fontsize=7.5)
    # Bottom: the share of s_n in the gradient.
    ax = axes[1, j]
    total = np.abs(g_n) + np.abs(g_p)
    with np.errstate(invalid="ignore", divide="ignore"):
      share = np.where(shown, np.abs(g_n) / total, np.nan)
    im = ax.imshow(share, origin="lower", cmap="coolwarm", vmin=0.0, vmax=1.0,
                   extent=(0.0, 1.0, 0.0, 1.0), interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04,
                 label="$|\\partial L/\\partial s_n| / (|\\partial L/"
                       "\\partial s_n| + |\\partial L/\\partial s_p|)$")
    ax.plot(boundary[:, 0], boundary[:, 1], "k-", lw=1.5,
            label="decision boundary (traced)")
    _mark_points(ax, panel["points"])
    _unit_square(ax, f"{title}\nshare of $s_n$ in the gradient (0.5: "
                 f"equal; white: |∇L| < {_SHOWN:g} max)")
    ax.legend(loc="lower right", fontsize=7.5)
  fig.suptitle("Gradients of one similarity pair, jax.grad of circle_jax."
               "losses (Circle: $\\alpha$ constant in backprop); "
               + ", ".join(f"{k} = ({p['s_n']}, {p['s_p']})" for k, p in
                           data["panels"][kinds[0]]["points"].items())
               + " (B: our choice)",
               fontsize=11)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def _mark_points(ax, points):
  for name, p in points.items():
    ax.plot(p["s_n"], p["s_p"], "ks", ms=6, mfc="w", mew=1.5, zorder=6)
    ax.annotate(name, (p["s_n"], p["s_p"]), textcoords="offset points",
                xytext=(0, 7), ha="center", fontsize=8, fontweight="bold",
                zorder=7, bbox=dict(boxstyle="round,pad=0.15", fc="w",
                                    alpha=0.8))


def _points_text(points) -> str:
  lines = []
  for name, p in points.items():
    ratio = p["ratio_n_over_p"]
    lines.append(f"{name} ({p['s_n']:g}, {p['s_p']:g}): ∂L/∂$s_n$ = "
                 f"{p['dL_ds_n'] + 0.0:.3g}, ∂L/∂$s_p$ = "
                 f"{p['dL_ds_p'] + 0.0:.3g}"
                 + (f", ratio {ratio:.2f}" if ratio is not None else ""))
  return "\n".join(lines)


def plot_fig5(data: dict, path: str) -> None:
  """Writes the Fig. 5 analogue (two panels per run) to ``path``.

  Top: histograms (densities) of ``s_p`` and ``s_n`` over all pairs. Bottom:
  each anchor's hardest pair in the ``(s_n, s_p)`` plane, as the paper's
  Fig. 5 shows similarity pairs there: ``(max s_n, min s_p)`` is the pair
  that the hard-mined triplet loss (the paper's eq. 3, the large-``gamma``
  limit of eq. 1) acts on.
  """
  names = list(data["panels"])
  fig, axes = plt.subplots(2, len(names), figsize=(5.4 * len(names), 10.4),
                           squeeze=False)
  # One (s_n, s_p) range for all bottom panels: [lo, 1]^2, lo <= 0.
  lows = [np.nanmin(np.array(data["panels"][k][f"anchor_hardest_{s}"],
                             np.float64), initial=0.0)
          for k in names for s in ("s_n", "s_p")]
  lo = max(-1.0, math.floor(min(lows) * 10) / 10)
  for j, name in enumerate(names):
    p = data["panels"][name]
    loss = dict(p["loss"])
    loss_name = loss.pop("name", name)
    run = name if name == loss_name else f"{name}: {loss_name}"
    title = (f"{run} ({hyper_text(loss)})\n"
             f"{p['dataset']} {p['split']}, {p['num_images']} images, "
             f"{p['checkpoint']} checkpoint (step {p['step']})")
    ax = axes[0, j]
    edges = np.array(p["bins"])
    widths = np.diff(edges)
    for key, label, color in (("pos", "$s_p$ (positive pairs)", "tab:blue"),
                              ("neg", "$s_n$ (negative pairs)", "tab:red")):
      counts = np.array(p[f"{key}_counts"], np.float64)
      n = p[f"num_{key}"]
      density = counts / (n * widths) if n else counts
      ax.stairs(density, edges, fill=True, alpha=0.35, color=color,
                label=f"{label}, {n:,} pairs")
      ax.stairs(density, edges, color=color, lw=1.2)
      if p[f"mean_{key}"] is not None:
        ax.axvline(p[f"mean_{key}"], color=color, ls="--", lw=1.2,
                   label=f"mean {p[f'mean_{key}']:.3f}")
    ax.set_xlim(edges[0], edges[-1])
    ax.set_xlabel("cosine similarity $s$")
    ax.set_ylabel("density")
    ax.set_title(title, fontsize=9.5)
    if p["histogram_overlap"] is not None:
      ax.text(0.02, 0.97, f"histogram overlap {p['histogram_overlap']:.3f}\n"
              f"P($s_n > s_p$) = {p['neg_above_pos']:.4f}",
              transform=ax.transAxes, va="top", fontsize=8.5,
              bbox=dict(boxstyle="round", fc="w", alpha=0.8))
    ax.legend(loc="upper right", fontsize=7.5)
    ax.grid(True, alpha=0.3)
    ax = axes[1, j]
    h_n = np.array(p["anchor_hardest_s_n"], np.float64)
    h_p = np.array(p["anchor_hardest_s_p"], np.float64)
    ok = np.isfinite(h_n) & np.isfinite(h_p)
    ax.scatter(h_n[ok], h_p[ok], s=4, alpha=0.4, color="tab:purple",
               lw=0, label=f"one anchor ({int(ok.sum())})")
    ax.plot([-1, 1], [-1, 1], "k--", lw=1, label="$s_p = s_n$")
    ax.set_xlim(lo, 1.0)
    ax.set_ylim(lo, 1.0)
    ax.set_aspect("equal")
    ax.set_xlabel("hardest $s_n$ of the anchor (max over other classes)")
    ax.set_ylabel("hardest $s_p$ of the anchor (min over its class)")
    sep = p.get("anchors_separated")
    ax.set_title(f"{run}: each anchor's hardest pair (max $s_n$, min $s_p$)\n"
                 + (f"{100 * sep:.2f}% of the anchors have min $s_p$ > max "
                    "$s_n$" if sep is not None else "no anchor with both"),
                 fontsize=9.5)
    ax.legend(loc="lower right", fontsize=7.5)
    ax.grid(True, alpha=0.3)
  fig.suptitle("Similarity distributions of the test split after training "
               "(Fig. 5 analogue)", fontsize=11)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
