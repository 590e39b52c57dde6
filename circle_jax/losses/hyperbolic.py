r"""The Poincaré ball as a pair-loss geometry (Hyp-ViT; Khrulkov et al.).

:class:`Poincare` is a :class:`circle_jax.losses.engine.Geometry`: its
``embed`` clips each feature vector to norm ``r`` and maps it onto the ball
of curvature ``-c`` by the exponential map at 0, and its ``tile`` returns the
similarity ``s = -d_c`` of every pair of the tile, from the tile's matmul and
the two sides' squared norms,

.. math::

  d_c(x, y) = \frac{1}{\sqrt c}\,\operatorname{arcosh}\Big(1 +
    \frac{2 c\,\|x - y\|^2}{(1 - c\|x\|^2)(1 - c\|y\|^2)}\Big),\quad
  \|x - y\|^2 = \|x\|^2 + \|y\|^2 - 2\,x \cdot y,

so every engine (dense, blockwise, ring) runs it unchanged. It equals
hyptorch's ``dist_matrix`` (``2/sqrt(c) artanh(sqrt(c) |(-x) (+)_c y|)``)
without hyptorch's ``1e-5`` denominators.

Numerical safeguards (hyptorch's, and one of ours):

* ``embed``: the clipping ``x min(1, r / |x|)`` (Guo et al.'s feature
  clipping, as Hyp-ViT's ``clip_r``), ``|x|`` floored at ``1e-5`` in the
  exponential map ``tanh(sqrt(c)|u|) u / (sqrt(c)|u|)``, and the projection
  of any point beyond radius ``(1 - 1e-3)/sqrt(c)`` back onto it
  (hyptorch's ``project``), so ``1 - c|x|^2 >= 2e-3`` and the conformal
  factors stay finite as the norm tends to ``1/sqrt(c)``;
* ``tile``: ``||x - y||^2`` clamped at 0 (rounding) and the arcosh argument
  ``1 + u`` taken as ``log1p(u + sqrt(u (u + 2)))`` with ``u >= 1e-12``, so
  identical points (self pairs) give a finite, zero gradient instead of the
  infinite slope of ``arcosh`` at 1.

Accuracy: the matmul form loses the relative precision of ``||x - y||^2``
for nearby points (float32 cancellation, about ``1e-7 |x|^2``), magnified by
the conformal factors: a distance reads with an absolute error of about
``sqrt(2e-7 |x|^2) / (1 - c |x|^2)``, ~1e-3 at mid-ball and up to ~0.04 for
two points at ``1 - c |x|^2 = 0.03``. Larger distances are exact to float32.

References:
  Ermolov, Mirvakhabova, Khrulkov, Sebe, Oseledets, "Hyperbolic Vision
  Transformers: Combining Improvements in Metric Learning", CVPR 2022 (code:
  github.com/htdt/hyp_metric, hyptorch/pmath.py). Khrulkov, Mirvakhabova,
  Ustinova, Oseledets, Lempitsky, "Hyperbolic Image Embeddings", CVPR 2020.
  Guo, Wang, Chen, Li, Hussein, "Clipped Hyperbolic Classifiers Are
  Super-Hyperbolic Classifiers", CVPR 2022.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from circle_jax.losses import engine
from circle_jax.losses import ranges

_HIGHEST = jax.lax.Precision.HIGHEST
# hyptorch's safeguards: the norm floor and the projection's margin.
_MIN_NORM = 1e-5
_BALL_MARGIN = 1e-3
_MIN_ARG = 1e-12

# Hyp-ViT's defaults (hyp_metric's train.py: hyp_c = 0.1, clip_r = 2.3).
DEFAULT_C = 0.1
DEFAULT_R = 2.3
CURVATURE_RANGE = ranges.HyperRange(1e-4, 1e2)
CLIP_RANGE = ranges.HyperRange(0.0, 1e3, False, True)
# The ranges of the geometry keywords of a pair loss that takes them.
GEOMETRY_RANGES = {"c": CURVATURE_RANGE, "r": CLIP_RANGE}


def _norm(x):
  """Row norms ``[K, 1]``; huge entries are scaled first (no overflow)."""
  scale = jax.lax.stop_gradient(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
  scale = jnp.where(scale > 0, scale, 1.0)
  return scale * jnp.sqrt(jnp.sum(jnp.square(x / scale), axis=-1,
                                  keepdims=True))


@dataclasses.dataclass(frozen=True)
class Poincare(engine.Geometry):
  """The Poincaré ball of curvature ``-c``; similarity ``-d_c`` (module
  docstring).

  Attributes:
    c: the curvature magnitude ``c > 0`` (ball radius ``1/sqrt(c)``).
    r: the feature clipping radius (``inf``: no clipping).
  """

  head_normalizes = False  # the exponential map takes the raw features
  c: float = DEFAULT_C
  r: float = DEFAULT_R

  def __post_init__(self):
    ranges.check_range(self.c, "c", CURVATURE_RANGE, "the Poincaré geometry")
    ranges.check_range(self.r, "r", CLIP_RANGE, "the Poincaré geometry")

  def embed(self, x):
    x = x.astype(jnp.float32)
    norm = jnp.maximum(_norm(x), _MIN_NORM)
    x = x * jnp.minimum(1.0, self.r / norm)          # feature clipping
    x = x / jnp.maximum(1.0, norm / 1e6)             # tanh(>= 1e6) = 1
    sqrt_c = self.c ** 0.5
    norm = jnp.maximum(_norm(x), _MIN_NORM)
    # tanh saturates to 1 in float32 beyond ~9; the projection below keeps
    # the point inside the ball.
    z = jnp.tanh(sqrt_c * norm) * x / (sqrt_c * norm)  # exp. map at 0
    norm = jnp.maximum(_norm(z), _MIN_NORM)
    max_norm = (1.0 - _BALL_MARGIN) / sqrt_c
    return jnp.where(norm > max_norm, z / norm * max_norm, z)

  def distance(self, z_rows, z_cols):
    """``[R, C]`` Poincaré distances of two sides already on the ball."""
    c = self.c
    sq_r = jnp.sum(z_rows * z_rows, axis=-1)
    sq_c = jnp.sum(z_cols * z_cols, axis=-1)
    dot = jnp.matmul(z_rows, z_cols.T, precision=_HIGHEST)
    diff = jnp.maximum(sq_r[:, None] + sq_c[None, :] - 2.0 * dot, 0.0)
    floor = 1.0 - (1.0 - _BALL_MARGIN) ** 2 * (1.0 - 1e-6)
    conf_r = jnp.maximum(1.0 - c * sq_r, floor)
    conf_c = jnp.maximum(1.0 - c * sq_c, floor)
    u = jnp.maximum(2.0 * c * diff / (conf_r[:, None] * conf_c[None, :]),
                    _MIN_ARG)
    return jnp.log1p(u + jnp.sqrt(u * (u + 2.0))) / c ** 0.5

  def tile(self, z_rows, z_cols):
    return -self.distance(z_rows, z_cols)

  def to_distance(self, s):
    return -s


engine.register_geometry("poincare", Poincare())


def geometry_of(geometry: str = "cosine", c: float = DEFAULT_C,
                r: float = DEFAULT_R, **fields) -> engine.Geometry:
  """The geometry named ``geometry`` (a registered name, the
  trainer's ``config.loss.geometry``), the ball's ``c`` and ``r`` and the
  other geometries' ``fields`` given
  (:func:`circle_jax.losses.engine.build_geometry`, which ignores the fields
  of the other geometries).

  Raises:
    ValueError: an unknown name, or a field outside its range.
  """
  names = engine.geometry_names()
  if geometry not in names:
    raise ValueError(f"`geometry` must be one of {names}; got {geometry!r}.")
  return engine.build_geometry(geometry, c=float(c), r=float(r), **fields)
