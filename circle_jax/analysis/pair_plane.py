"""One similarity pair ``(s_n, s_p)`` fed to the package's losses.

The plane of Sun et al., "Circle Loss: A Unified Perspective of Pair
Similarity Optimization", CVPR 2020 (arXiv 2002.10857), Figs. 1 and 2: a loss
of one positive similarity ``s_p`` and one negative similarity ``s_n``,
evaluated and differentiated with the loss functions of
:mod:`circle_jax.losses` (no formula of the paper is re-implemented here).

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

What "decision boundary" means here. The paper's losses are of two kinds:

* softplus type (unified, AM-Softmax, Circle): ``L = log(1 + e^x)`` with an
  exponent ``x`` (``gamma (s_n - s_p + m)``, or ``gamma (alpha_n (s_n -
  Delta_n) - alpha_p (s_p - Delta_p))`` for Circle). The paper's boundary is
  ``x = 0``, i.e. ``L = log 2``: where the pair is as likely classified right
  as wrong. It does not depend on ``gamma``.
* hinge type (triplet): ``L = [s_n - s_p + m]_+``; the boundary is the edge
  of the zero-loss region, ``L = 0``.

Both are the boundary of ``{L > level}`` with ``level = log 2`` or ``0``.
:func:`trace_boundary` traces it by bisection along rays from the ideal state
``(s_n, s_p) = (0, 1)`` (which every loss satisfies, and from which each of
these boundaries is crossed once) to the edge of the unit square, evaluating
the loss itself; the bisection runs to float32 resolution, so the traced
points lie on the exact boundary of *our* loss to about 1e-6. For the
``(s_n - s_p)`` losses it is the line ``s_p = s_n + m``
(:func:`line_residual`); for Circle loss (eq. 6 with ``O_p = 1 + m``,
``O_n = -m``, ``Delta_p = 1 - m``, ``Delta_n = m``) the circle
``s_n^2 + (s_p - 1)^2 = 2 m^2`` (:func:`circle_residual`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, Mapping, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from circle_jax import losses as losses_lib

GAMMA = 80.0           # Circle / unified / AM-Softmax scale of the figures
NUM_RAYS = 91          # one ray per degree from (0, 1)
BISECTION_STEPS = 40   # float32 resolution along a ray

Array = jax.Array


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
  """The loss ``kind`` of the single pair ``(s_n, s_p)`` (see the module docstring).

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
  """The loss ``kind`` of one pair ``(s_n, s_p)`` (see the module docstring)."""
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
