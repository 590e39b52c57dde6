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

_HIGHEST = jax.lax.Precision.HIGHEST


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


COSINE = Cosine()
DOT = Dot()

# The geometries a loss's ``geometry`` option may name (register adds).
_NAMED = {"cosine": COSINE, "dot": DOT}


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


def require_cosine(geometry, loss: str, why: str) -> None:
  """ValueError unless ``geometry`` (a loss's ``geometry`` option) is the
  cosine one or ``None``; ``why``: what the loss needs unit vectors for."""
  if resolve(geometry) not in (None, COSINE):
    raise ValueError(
        f"The {loss} {why}: use the cosine geometry (the default).")
