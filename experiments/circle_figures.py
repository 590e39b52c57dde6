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
  the test split, each unordered pair once (what issue #12 asks for), and each
  anchor's hardest pair ``(max s_n, min s_p)`` in the ``(s_n, s_p)`` plane, the
  plane in which the paper's Fig. 5 shows similarity pairs after training.

What "decision boundary" means here. The paper's losses are of two kinds:

* softplus type (unified, AM-Softmax, Circle): ``L = log(1 + e^x)`` with an
  exponent ``x`` (``gamma (s_n - s_p + m)``, or ``gamma (alpha_n (s_n -
  Delta_n) - alpha_p (s_p - Delta_p))`` for Circle). The paper's boundary is
  ``x = 0``, i.e. ``L = log 2``: where the pair is as likely classified right
  as wrong. It does not depend on ``gamma``.
* hinge type (triplet): ``L = [s_n - s_p + m]_+``; the boundary is the edge
  of the zero-loss region, ``L = 0``.

Both are the boundary of ``{L > level}`` with ``level = log 2`` or ``0``. It is
traced by bisection along 91 rays from the ideal state ``(s_n, s_p) = (0, 1)``
(which every loss satisfies, and from which each of these boundaries is
crossed once) to the edge of the unit square, evaluating the loss itself; the
bisection runs to float32 resolution, so the traced points lie on the exact
boundary of *our* loss to about 1e-6.

One pair per loss. A pair loss gets a 3 x 3 similarity matrix, labels
``[0, 0, 1]`` and miner masks that keep only the pairs (0, 1) (positive,
``s_p``) and (0, 2) (negative, ``s_n``): anchor 0 is the only valid anchor, so
the loss is that anchor's. The triplet loss is the paper's, on similarities
(``[s_n - s_p + m]_+``, eq. 3), obtained from
``triplet_margin_loss_from_distance`` with the distance ``1 - s``; on Euclidean
distances between unit vectors its boundary would not be a line in this plane.
AM-Softmax is ``cosface_loss`` with two classes: the embedding ``e_1`` and the
class weights ``(s_p, sqrt(1 - s_p^2), 0)`` and ``(s_n, 0, sqrt(1 - s_n^2))``,
whose cosines with it are exactly ``s_p`` and ``s_n``.

Usage (figures 1 and 2; about 10 s on CPU)::

  python -m experiments.circle_figures --out experiments/results/circle_figures

Figure 5 from trained runs (``--figures 5`` skips recomputing 1 and 2)::

  python -m experiments.circle_figures --figures 5 \\
      --out experiments/results/circle_figures \\
      --fig5-runs circle=RUN1,cosface=RUN2,triplet=RUN3

where ``RUN*`` are workdirs of ``python -m experiments.main`` on
``experiments/configs/omniglot_small.py`` (``experiments/compare.py`` puts
them at ``WORKDIR/<loss>/seed_<s>``). Each run's best checkpoint (the latest
if it kept none; ``--checkpoint`` to choose) embeds the dataset's test split.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

# pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp
import matplotlib
matplotlib.use("Agg")
from matplotlib import pyplot as plt

from circle_jax import losses as losses_lib
# pylint: enable=g-import-not-at-top

DEFAULT_OUT = os.path.join(_REPO, "experiments", "results", "circle_figures")

FIG1_MARGINS = (0.25, 0.4)
GAMMA = 80.0           # Circle / unified / AM-Softmax scale in the figures
NUM_RAYS = 91          # one ray per degree from (0, 1)
BISECTION_STEPS = 40
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
_SHOWN = 1e-3          # Fig. 2 draws gradients of at least this * the max

Array = jax.Array


# ----------------------------------------------------------------------------
# One similarity pair fed to each loss.
# ----------------------------------------------------------------------------


_PAIR_LABELS = np.array([0, 0, 1], np.int32)
_PAIR_POS = np.zeros((3, 3), bool)
_PAIR_POS[0, 1] = True
_PAIR_NEG = np.zeros((3, 3), bool)
_PAIR_NEG[0, 2] = True


def pair_similarity_matrix(s_n, s_p) -> Array:
  """3 x 3 similarities: anchor 0, positive 1 (``s_p``), negative 2 (s_n)."""
  s = jnp.eye(3, dtype=jnp.float32)
  return s.at[0, 1].set(s_p).at[0, 2].set(s_n)


def one_pair_loss(kind: str, s_n, s_p, margin, gamma) -> Array:
  """The loss ``kind`` of the single pair ``(s_n, s_p)`` (module docstring).

  Args:
    kind: ``triplet``, ``cosface``, ``unified`` or ``circle``.
    s_n: the negative similarity (scalar).
    s_p: the positive similarity (scalar).
    margin: ``m`` of every loss.
    gamma: the scale (``gamma``; CosFace's ``scale``); unused by the triplet.

  Returns:
    float32 scalar, computed by the package's loss function.
  """
  s_n = jnp.asarray(s_n, jnp.float32)
  s_p = jnp.asarray(s_p, jnp.float32)
  labels = jnp.asarray(_PAIR_LABELS)
  pos, neg = jnp.asarray(_PAIR_POS), jnp.asarray(_PAIR_NEG)
  if kind == "triplet":
    distance = 1.0 - pair_similarity_matrix(s_n, s_p)
    return losses_lib.triplet_margin_loss_from_distance(
        distance, labels, margin=margin, mining="all", pos_mask=pos,
        neg_mask=neg)
  if kind == "cosface":
    x = jnp.array([[1.0, 0.0, 0.0]], jnp.float32)
    zero = jnp.zeros((), jnp.float32)

    def rest(s):  # the other coordinate of a unit vector with cosine s
      return jnp.sqrt(jnp.maximum(1.0 - s * s, 0.0))

    w = jnp.stack([jnp.stack([s_p, rest(s_p), zero]),
                   jnp.stack([s_n, zero, rest(s_n)])])
    return losses_lib.cosface_loss(x, jnp.array([0]), w, margin=margin,
                                   scale=gamma)
  if kind in ("unified", "circle"):
    loss = (losses_lib.unified_loss_from_similarity if kind == "unified" else
            losses_lib.circle_loss_from_similarity)
    return loss(pair_similarity_matrix(s_n, s_p), labels, margin=margin,
                gamma=gamma, pos_mask=pos, neg_mask=neg)
  raise ValueError(f"Unknown pair loss {kind!r}; use one of "
                   f"{', '.join(LOSS_LABELS)}.")


LOSS_LABELS = {
    "triplet": "triplet",
    "cosface": "AM-Softmax (CosFace)",
    "unified": "unified loss (eq. 1)",
    "circle": "Circle loss",
}
_SYMBOLS = {"margin": "m", "gamma": "\u03b3", "scale": "\u03b3"}


def hyper_text(hyper: Mapping[str, object]) -> str:
  """``m=0.4, γ=80`` from ``{'margin': 0.4, 'gamma': 80.0}`` (None skipped)."""
  parts = []
  first = ("margin", "gamma", "scale")
  keys = sorted(hyper, key=lambda k: (first.index(k) if k in first else 3, k))
  for k in keys:
    v = hyper[k]
    if v is None or k == "name":
      continue
    if isinstance(v, float) and v == int(v):
      v = int(v)
    parts.append(f"{_SYMBOLS.get(k, k)}={v}")
  return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class PairLoss:
  """A loss of one pair with its hyperparameters.

  Attributes:
    kind: ``triplet``, ``cosface`` (AM-Softmax), ``unified`` or ``circle``.
    margin: ``m``.
    gamma: the scale (not used by the triplet loss).
  """

  kind: str
  margin: float
  gamma: float = GAMMA

  def __post_init__(self):
    if self.kind not in LOSS_LABELS:
      raise ValueError(f"Unknown pair loss {self.kind!r}; use one of "
                       f"{', '.join(LOSS_LABELS)}.")

  def fn(self, s_n, s_p) -> Array:
    """``L(s_n, s_p)``, differentiable in both."""
    return one_pair_loss(self.kind, s_n, s_p, self.margin, self.gamma)

  @property
  def level(self) -> float:
    """The loss on the decision boundary: 0 (hinge) or log 2 (softplus)."""
    return 0.0 if self.kind == "triplet" else math.log(2.0)

  @property
  def hyper(self) -> Dict[str, float]:
    if self.kind == "triplet":
      return {"margin": self.margin}
    if self.kind == "cosface":
      return {"margin": self.margin, "scale": self.gamma}
    return {"margin": self.margin, "gamma": self.gamma}

  @property
  def label(self) -> str:
    return LOSS_LABELS[self.kind]

  def title(self) -> str:
    return f"{self.label} ({hyper_text(self.hyper)})"


def pair_loss(kind: str, *, margin: float, gamma: float = GAMMA) -> PairLoss:
  """The loss ``kind`` of one pair ``(s_n, s_p)``; see the module docstring."""
  return PairLoss(kind, float(margin), float(gamma))


@functools.partial(jax.jit, static_argnames=("kind",))
def _values(kind, s_n, s_p, margin, gamma):
  return jax.vmap(lambda a, b: one_pair_loss(kind, a, b, margin, gamma))(
      s_n, s_p)


@functools.partial(jax.jit, static_argnames=("kind",))
def _gradients(kind, s_n, s_p, margin, gamma):
  grad = jax.grad(lambda a, b: one_pair_loss(kind, a, b, margin, gamma),
                  argnums=(0, 1))
  return jax.vmap(grad)(s_n, s_p)


def _flat(x) -> Array:
  return jnp.asarray(np.asarray(x, np.float32).reshape(-1))


def pair_gradients(loss: PairLoss, s_n, s_p) -> Tuple[np.ndarray, np.ndarray]:
  """``(dL/ds_n, dL/ds_p)`` at every point of the arrays ``s_n``, ``s_p``."""
  shape = np.shape(s_n)
  g_n, g_p = _gradients(loss.kind, _flat(s_n), _flat(s_p),
                        jnp.float32(loss.margin), jnp.float32(loss.gamma))
  return (np.asarray(g_n, np.float64).reshape(shape),
          np.asarray(g_p, np.float64).reshape(shape))


def pair_values(loss: PairLoss, s_n, s_p) -> np.ndarray:
  """The loss at every point of the arrays ``s_n``, ``s_p``."""
  out = _values(loss.kind, _flat(s_n), _flat(s_p), jnp.float32(loss.margin),
                jnp.float32(loss.gamma))
  return np.asarray(out, np.float64).reshape(np.shape(s_n))


# ----------------------------------------------------------------------------
# Decision boundaries traced from the losses.
# ----------------------------------------------------------------------------


def ray_directions(num_rays: int = NUM_RAYS) -> np.ndarray:
  """Unit directions from (0, 1) into the unit square, ``[num_rays, 2]``.

  Angles from -90 degrees (down the ``s_p`` axis) to 0 (along ``s_p = 1``).
  """
  theta = np.linspace(-0.5 * np.pi, 0.0, num_rays)
  d = np.stack([np.cos(theta), np.sin(theta)], axis=1)
  d[np.abs(d) < 1e-15] = 0.0
  return d


@functools.partial(jax.jit, static_argnames=("kind", "steps"))
def _bisect_rays(kind, directions, t_max, margin, gamma, level, steps):
  """Per ray: the bisected crossing ``t`` and whether the ray crosses."""
  origin = jnp.array([0.0, 1.0], jnp.float32)

  def violated(t, direction):
    p = jnp.clip(origin + t * direction, 0.0, 1.0)  # rounding at the edge
    return one_pair_loss(kind, p[0], p[1], margin, gamma) > level

  def one_ray(direction, hi):
    def body(_, bounds):
      lo, hi = bounds
      mid = 0.5 * (lo + hi)
      bad = violated(mid, direction)
      return jnp.where(bad, lo, mid), jnp.where(bad, mid, hi)
    lo, hi_ = jax.lax.fori_loop(0, steps, body, (jnp.float32(0.0), hi))
    return 0.5 * (lo + hi_), violated(hi, direction)

  ideal_ok = ~violated(jnp.float32(0.0), directions[0])
  t, crosses = jax.vmap(one_ray)(directions, t_max)
  return t, crosses, ideal_ok


def trace_boundary(loss: PairLoss, num_rays: int = NUM_RAYS,
                   steps: int = BISECTION_STEPS) -> np.ndarray:
  """Points ``[num_rays, 2]`` (``s_n, s_p``) of the loss's decision boundary.

  Along each ray from the ideal state ``(0, 1)`` to the edge of the unit
  square, bisects for the point where ``loss > loss.level`` starts (the pair
  crosses from "satisfied" to "violated"). Rays that stay satisfied up to the
  edge give NaN.

  Args:
    loss: the pair loss.
    num_rays: number of rays (equal angles).
    steps: bisection steps (40 reaches float32 resolution).

  Returns:
    float64 ``[num_rays, 2]`` boundary points, NaN where a ray does not cross.

  Raises:
    ValueError: the loss is violated at (0, 1) itself.
  """
  d = ray_directions(num_rays)
  with np.errstate(divide="ignore"):
    t_max = np.minimum(np.where(d[:, 0] > 0, 1.0 / d[:, 0], np.inf),
                       np.where(d[:, 1] < 0, -1.0 / d[:, 1], np.inf))
  t, crosses, ideal_ok = _bisect_rays(
      loss.kind, jnp.asarray(d, jnp.float32), jnp.asarray(t_max, jnp.float32),
      jnp.float32(loss.margin), jnp.float32(loss.gamma),
      jnp.float32(loss.level), steps)
  if not bool(ideal_ok):
    raise ValueError(f"{loss.title()}: the ideal state (0, 1) violates it.")
  t = np.where(np.asarray(crosses), np.asarray(t, np.float64), np.nan)
  return np.array([0.0, 1.0]) + t[:, None] * d


def line_residual(points, margin: float) -> np.ndarray:
  """Signed distance of ``(s_n, s_p)`` points to the line ``s_p = s_n + m``."""
  points = np.asarray(points, np.float64)
  return (points[:, 1] - points[:, 0] - margin) / math.sqrt(2.0)


def circle_residual(points, margin: float) -> np.ndarray:
  """Distance to (0, 1) minus the radius ``sqrt(2) m`` of Circle's boundary."""
  points = np.asarray(points, np.float64)
  return (np.hypot(points[:, 0], points[:, 1] - 1.0)
          - math.sqrt(2.0) * margin)


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
               f"losses (Circle: $\\alpha$ constant in backprop); A = "
               f"{FIG2_POINTS['A']}, B = {FIG2_POINTS['B']} (B: our choice)",
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


# ----------------------------------------------------------------------------
# Figure 5 analogue: similarity histograms after training.
# ----------------------------------------------------------------------------


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


def embed_run(workdir: str, *, which: Optional[str] = None,
              split: Optional[str] = None):
  """Embeds a run's test split with its best (or latest) checkpoint.

  Rebuilds the model from ``workdir/config.json`` and restores the checkpoint
  as :mod:`circle_jax.embed` does, then embeds the split with the training
  loop's own evaluation path (``loop.embed_source`` with the eval
  preprocessing, the evaluator's batch size and device mesh), so the
  embeddings are those the run's test metrics were computed from. The saved
  tree is restored as is (no template from ``loop.init_state``: initialising
  the model and optimiser only to check shapes costs seconds per run).

  Args:
    workdir: a folder written by ``experiments.main``.
    which: ``best`` or ``latest`` (default: best if the run kept one).
    split: the split (default: the dataset's first evaluation split).

  Returns:
    ``(embeddings [N, D] float32, labels [N], info)``; ``info`` holds the
    config's loss and dataset, the checkpoint and its step.
  """
  # pylint: disable=g-import-not-at-top
  from circle_jax import data as data_lib
  from circle_jax import embed as embed_lib
  from circle_jax.train import checkpoint as ckpt_lib
  from circle_jax.train import loop
  from circle_jax.train import step as step_lib
  # pylint: enable=g-import-not-at-top
  config = embed_lib.load_run_config(workdir)
  info = data_lib.get_dataset_info(config.dataset.name)
  preprocess = loop.eval_preprocess(config, info)
  model = loop.build_model(config, "none")
  ckpts = ckpt_lib.Checkpoints(
      os.path.join(workdir, "checkpoints"),
      best_metric=config.get("best_metric") or None,
      best_mode=config.get("best_mode", "max"))
  try:
    if which is None:
      which = "best" if ckpts.best_step() is not None else "latest"
    tree, _, meta = ckpts.restore(which=which)
  finally:
    ckpts.close()
  variables = {"params": tree["params"]["model"]}
  if tree["batch_stats"]:
    variables["batch_stats"] = tree["batch_stats"]
  # The evaluator's mesh: one device for parallelism 'none', else all.
  devices = jax.local_devices()
  if config.get("parallelism", "shard_map") == "none":
    devices = devices[:1]
  mesh = step_lib.make_mesh(devices)
  variables = step_lib.replicate(variables, mode="shard_map", mesh=mesh)
  split = split or info.eval_splits[0]
  source = data_lib.load_split(
      info.name, split,
      data_dir=config.dataset.get("data_dir") or loop.default_data_dir(),
      manual_dir=config.dataset.get("manual_dir"))
  embeddings, labels = loop.embed_source(
      variables, step_lib.embed_fn(model.apply, mesh=mesh), source,
      preprocess, batch_size=config.batch.get("eval_batch_size", 256),
      mesh=mesh)
  loss = {k: v for k, v in config.loss.to_dict().items() if v is not None}
  run_info = {"workdir": os.path.abspath(workdir), "loss": loss,
              "dataset": info.name, "split": split, "checkpoint": which,
              "step": meta.get("step")}
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
    "1": ("fig1_decision_boundaries", fig1_data, plot_fig1),
    "2": ("fig2_gradients", fig2_data, plot_fig2),
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
      plot = plot_fig5
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
