"""The geometry of a pair loss: what the similarity of a tile is.

Every engine asks the rule's geometry (``rule.geometry``) for the tile's
similarities and, in a ``custom_vjp``'s backward sweep, for the tile's
contribution to the embeddings' gradient. Nothing else in an engine knows
how a similarity is made, so a new geometry is a new class here (or in the
loss's own module) and no engine changes. The interface:

* ``embed(x) -> z``: the per-sample map applied to each side (rows and
  columns) before any tile is formed, outside the engines (so autodiff
  differentiates it), e.g. L2 normalisation onto the unit sphere;
* ``tile(z_rows, z_cols) -> s``: the ``[R, C]`` similarities of a tile;
* ``tile_vjp(z_rows, z_cols, g) -> (dz_rows, dz_cols)``: the pull-back of a
  tile's ``dL/ds`` ``g`` (default: ``jax.vjp`` of ``tile``).

A geometry is a frozen (hashable) dataclass: its fields are static.
:class:`Cosine` is most losses' default geometry (one matmul of unit vectors
per tile); :class:`Dot` keeps the raw inner products (the N-pair loss).
:class:`Lp` and :class:`SNR` are pytorch-metric-learning's ``LpDistance``
and ``SNRDistance`` (``p``, ``power``, ``normalize_embeddings``) as
similarities ``s = -d ** power`` whose ``to_distance`` is ``d ** power``.
A config names a geometry and gives its fields by name (:func:`build`,
:func:`fields`).
:class:`circle_jax.losses.hyperbolic.Poincare` (in the losses room, since no
engine needs to know it) maps ``embed`` onto the ball and computes ``tile``
as ``-d_c`` from the tile's matmul and the two sides' squared norms
(``||x - y||^2 = |x|^2 + |y|^2 - 2 x.y``). Losses that softmax over every
candidate (SupCon) are rules with one statistic per set, ``("sum", "lse")``:
the positives' sum and the logsumexp over the positives and negatives
together (:mod:`circle_jax.losses.engine.rule`). Neither needed an engine
change beyond that per-set statistic.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import ranges as ranges_lib

_HIGHEST = jax.lax.Precision.HIGHEST
_TINY = 1e-12


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Defaults of the geometry interface (module docstring).

  ``head_normalizes``: whether the model's embedding head L2-normalises the
  features it hands this geometry's ``embed`` (False: ``embed`` takes the
  raw features, as the Poincaré ball's exponential map does).
  """

  head_normalizes = True  # a class attribute, not a field

  def embed(self, x):
    return x

  def tile(self, z_rows, z_cols):
    raise NotImplementedError

  def tile_vjp(self, z_rows, z_cols, g):
    _, pull = jax.vjp(self.tile, z_rows, z_cols)
    return pull(g)

  def to_distance(self, s):
    """The distance of a pair from its similarity ``s`` (the rules that
    read distances: contrastive, triplet, lifted structure, margin)."""
    raise ValueError(f"The {type(self).__name__} geometry has no distance "
                     "of its similarities; use a distance-free loss or the "
                     "cosine or Poincaré geometry.")


@dataclasses.dataclass(frozen=True)
class Dot(Geometry):
  """Raw inner products ``s_ij = x_i . x_j`` (float32, HIGHEST precision)."""

  def tile(self, z_rows, z_cols):
    return jnp.matmul(z_rows, z_cols.T, precision=_HIGHEST)

  def tile_vjp(self, z_rows, z_cols, g):
    return (jnp.matmul(g, z_cols, precision=_HIGHEST),
            jnp.matmul(g.T, z_rows, precision=_HIGHEST))


@dataclasses.dataclass(frozen=True)
class Cosine(Dot):
  """Cosine similarity: inner products of L2-normalised embeddings."""

  def embed(self, x):
    return ops.l2_normalize(x)

  def to_distance(self, s):
    """The Euclidean distance of unit vectors, ``sqrt(2 - 2 s)``."""
    return ops.euclidean_from_cosine(s)


def _power(d, exponent):
  """``d ** exponent`` of ``d >= 0``, 0 with gradient 0 where ``d == 0``
  (the self pairs: no infinite slope of a root at 0)."""
  positive = d > 0
  return jnp.where(positive, jnp.where(positive, d, 1.0) ** exponent, 0.0)


def _pml_normalize(x, p):
  """torch's ``F.normalize(x, p)``: ``x / max(|x|_p, 1e-12)`` (float32;
  ``p = 2``: :func:`circle_jax.ops.l2_normalize`, safe for huge norms)."""
  if p == 2:
    return ops.l2_normalize(x)
  x = x.astype(jnp.float32)
  norm = jnp.linalg.norm(x, ord=p, axis=-1, keepdims=True)
  return x / jnp.maximum(norm, 1e-12)


# The ranges of the distance geometries' fields (PML's BaseDistance
# arguments); a p-norm needs p >= 1, a power of a distance p > 0.
P_RANGE = ranges_lib.HyperRange(1.0, float("inf"))
POWER_RANGE = ranges_lib.POSITIVE_RANGE
DISTANCE_RANGES = {"p": P_RANGE, "power": POWER_RANGE}


class _Distance(Geometry):
  """A distance geometry as pytorch-metric-learning's ``BaseDistance``:
  ``embed`` normalises (``normalize_embeddings``) and the similarity is
  ``s = -d ** power``, ``to_distance(s) = -s`` (its ``d ** power``)."""

  @property
  def head_normalizes(self):
    """The head L2-normalises only if the geometry normalises too."""
    return self.normalize_embeddings

  def _check(self, **fields):
    for name, valid in fields.items():
      ranges_lib.check_range(getattr(self, name), name, valid,
                             f"the {type(self).__name__} geometry")

  def embed(self, x):
    if not self.normalize_embeddings:
      return x.astype(jnp.float32)
    return _pml_normalize(x, getattr(self, "p", 2))

  def tile(self, z_rows, z_cols):
    return -_power(self.distance(z_rows, z_cols), self.power)

  def to_distance(self, s):
    return -s


@dataclasses.dataclass(frozen=True)
class Lp(_Distance):
  r"""The ``p``-norm distance ``d_ij = |x_i - x_j|_p`` (pytorch-metric-
  learning's ``LpDistance``, its arguments and defaults).

  ``p = 2`` takes the tile's matmul and the sides' squared norms,
  ``|x|^2 + |y|^2 - 2 x.y`` (clamped at 0), like the cosine geometry;
  another ``p`` forms the tile's ``[R, C, D]`` differences (memory
  ``O(R C D)``: pass ``block_size`` for large batches); ``p = inf`` the
  largest absolute difference.

  Attributes:
    p: the norm's order, in ``[1, inf]`` (also of the normalisation).
    power: ``d`` is raised to it (> 0).
    normalize_embeddings: divide each embedding by its ``p``-norm first
      (False: the raw features; the trainer's head then does not
      L2-normalise).
  """

  p: float = 2.0
  power: float = 1.0
  normalize_embeddings: bool = True

  def __post_init__(self):
    self._check(**DISTANCE_RANGES)

  def distance(self, z_rows, z_cols):
    """``[R, C]`` ``p``-norm distances of two embedded sides."""
    if self.p == 2:
      sq_r = jnp.sum(z_rows * z_rows, axis=-1)
      sq_c = jnp.sum(z_cols * z_cols, axis=-1)
      dot = jnp.matmul(z_rows, z_cols.T, precision=_HIGHEST)
      return _power(jnp.maximum(sq_r[:, None] + sq_c[None, :] - 2.0 * dot,
                                0.0), 0.5)
    diff = jnp.abs(z_rows[:, None, :] - z_cols[None, :, :])
    if self.p == float("inf"):
      return jnp.max(diff, axis=-1)
    return _power(jnp.sum(_power(diff, self.p), axis=-1), 1.0 / self.p)


@dataclasses.dataclass(frozen=True)
class SNR(_Distance):
  r"""The signal-to-noise-ratio distance (Yuan et al., CVPR 2019;
  pytorch-metric-learning's ``SNRDistance``, its ``power`` and
  ``normalize_embeddings``; not symmetric: the anchor's variance below),

  .. math::

    d_{ij} = \frac{\operatorname{var}(x_i - x_j)}{\operatorname{var}(x_i)}
           = \frac{|x_i|^2 + |x_j|^2 - 2 x_i^\top x_j - (m_i - m_j)^2 / D}
                  {|x_i|^2 - m_i^2 / D},
    \qquad m_i = \textstyle\sum_k x_{ik},

  the variances over the ``D`` features; the second form needs a tile's
  matmul and each side's norm and feature sum only, so every engine runs
  it.

  Attributes:
    power: ``d`` is raised to it (> 0).
    normalize_embeddings: L2-normalise the embeddings first.
  """

  power: float = 1.0
  normalize_embeddings: bool = True

  def __post_init__(self):
    self._check(power=POWER_RANGE)

  def distance(self, z_rows, z_cols):
    """``[R, C]`` SNR distances of two embedded sides."""
    dim = z_rows.shape[1]
    dot = jnp.matmul(z_rows, z_cols.T, precision=_HIGHEST)
    sum_r = jnp.sum(z_rows, axis=1, keepdims=True)
    sum_c = jnp.sum(z_cols, axis=1, keepdims=True).T
    sq_r = jnp.sum(z_rows * z_rows, axis=1, keepdims=True)
    sq_c = jnp.sum(z_cols * z_cols, axis=1, keepdims=True).T
    noise = sq_r + sq_c - 2.0 * dot - jnp.square(sum_r - sum_c) / dim
    signal = sq_r - jnp.square(sum_r) / dim
    return jnp.maximum(noise, 0.0) / jnp.maximum(signal, _TINY)


COSINE = Cosine()
DOT = Dot()

# The geometries a loss's ``geometry`` option may name (register adds).
_NAMED = {"cosine": COSINE, "dot": DOT, "lp": Lp(), "snr": SNR()}


def register(name: str, geometry: Geometry) -> None:
  """Makes ``geometry`` (with its default fields) selectable as ``name``."""
  _NAMED[name] = geometry


def names():
  """The registered geometry names."""
  return tuple(sorted(_NAMED))


def resolve(geometry):
  """The geometry ``geometry`` names (a registered name), or ``geometry``
  itself (a :class:`Geometry`, or ``None``: the rule's own).

  Raises:
    ValueError: an unknown name.
  """
  if not isinstance(geometry, str):
    return geometry
  if geometry not in _NAMED:
    raise ValueError(f"`geometry` must be one of {names()} or a Geometry; "
                     f"got {geometry!r}.")
  return _NAMED[geometry]


def fields():
  """``{field: default}`` of every registered geometry's fields (the
  config's geometry fields: the Poincaré ball's ``c`` and ``r``, the
  distances' ``p``, ``power`` and ``normalize_embeddings``); a field
  shared by two geometries has one default."""
  out = {}
  for geometry in _NAMED.values():
    for f in dataclasses.fields(geometry):
      out.setdefault(f.name, f.default)
  return out


def build(name: str, **values) -> Geometry:
  """The geometry ``name`` with the fields it has among ``values`` (the
  others, meant for other geometries, are ignored): the one reading of a
  config's ``loss.geometry`` and its fields.

  Raises:
    ValueError: an unknown name, or a field outside its range.
  """
  default = resolve(name)
  own = {f.name for f in dataclasses.fields(default)}
  return dataclasses.replace(
      default, **{k: v for k, v in values.items() if k in own})


def require_cosine(geometry, loss: str, why: str) -> None:
  """ValueError unless ``geometry`` (a loss's ``geometry`` option) is the
  cosine one or ``None``; ``why``: what the loss needs unit vectors for."""
  if resolve(geometry) not in (None, COSINE):
    raise ValueError(
        f"The {loss} {why}: use the cosine geometry (the default).")
