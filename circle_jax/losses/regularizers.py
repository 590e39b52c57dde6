"""Regularizers added to a loss: pytorch-metric-learning's (PML 2.9).

A regularizer maps the embeddings ``[B, D]`` or a loss's class matrix
``[C, D]`` (proxies, class weights, centres: one row per class, or per
sub-centre) to a scalar, each with PML's default reducer: the mean over the
rows (``SparseCenters``: PML's ``DivisorReducer``, the sum over pairs
divided by twice their count). A loss's config adds
``embedding_reg_weight * R_e(embeddings) + weight_reg_weight *
R_w(class matrix)`` to the objective (PML's ``embedding_regularizer`` /
``weight_regularizer`` and their weights; :data:`FIELDS`), in the train
step (:mod:`circle_jax.train.step`).

On the embeddings the mean runs over the global batch with ``axis_name``
(exact value and gradient, :mod:`circle_jax.losses.engine.reductions`); the
class matrix is whole on every device (a sharded one,
``loss.shard_classes``, is refused by the config check).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import checks
from circle_jax.losses.engine import reductions

Array = jax.Array

# PML's c_f.small_val(float32): the smallest normal float32.
_TINY = float(jnp.finfo(jnp.float32).tiny)


def _rows(x: Array, name: str) -> Array:
  if x.ndim != 2:
    raise ValueError(f"`{name}` must be [rows, D]; got shape {x.shape}.")
  return x.astype(jnp.float32)


def _row_mean(values: Array, axis_name=None) -> Array:
  return reductions.ratio_of_sums(values, jnp.ones(values.shape), axis_name)


def lp_regularizer(x: Array, *, p: float = 2.0, power: float = 1.0,
                   axis_name=None) -> Array:
  r"""``mean_i ||x_i||_p^power`` (PML's ``LpRegularizer``).

  Args:
    x: ``[N, D]`` embeddings or class vectors.
    p: the norm's order.
    power: the norm's power.
    axis_name: optional mapped axis: the mean over the global batch.

  Returns:
    float32 scalar.
  """
  x = _rows(x, "x")
  norm = jnp.sum(jnp.abs(x) ** p, axis=1) ** (1.0 / p)
  return _row_mean(norm ** power, axis_name)


def zero_mean_regularizer(x: Array, *, axis_name=None) -> Array:
  r"""``mean_i |sum_d x_{id}|`` (PML's ``ZeroMeanRegularizer``).

  Args:
    x: ``[N, D]`` embeddings or class vectors.
    axis_name: optional mapped axis: the mean over the global batch.

  Returns:
    float32 scalar.
  """
  return _row_mean(jnp.abs(jnp.sum(_rows(x, "x"), axis=1)), axis_name)


def center_invariant_regularizer(weights: Array) -> Array:
  r"""``mean_c (||w_c||^2 - mean_k ||w_k||^2)^2 / 4`` (Wu et al. 2017;
  PML's ``CenterInvariantRegularizer``): the class vectors' squared norms
  pulled to their mean.

  Args:
    weights: ``[C, D]`` class vectors.

  Returns:
    float32 scalar.

  References:
    Wu, Lian, Yang, Wang, Yang, "Deep Face Recognition with Center
    Invariant Loss", ACM MM Thematic Workshops 2017.
  """
  sq = jnp.sum(_rows(weights, "weights") ** 2, axis=1)
  return jnp.mean((sq - jnp.mean(sq)) ** 2 / 4.0)


def regular_face_regularizer(weights: Array) -> Array:
  r"""``mean_c max_{k != c} cos(w_c, w_k)`` (Zhao et al. 2019; PML's
  ``RegularFaceRegularizer``): each class vector's cosine to its nearest
  other class, whose choice carries no gradient.

  Args:
    weights: ``[C, D]`` class vectors (``C >= 2``).

  Returns:
    float32 scalar.

  References:
    Zhao, Wang, Wu, Wang, Lai, "RegularFace: Deep Face Recognition via
    Exclusive Regularization", CVPR 2019.
  """
  w = ops.l2_normalize(_rows(weights, "weights"))
  cos = w @ w.T
  c = cos.shape[0]
  off = jnp.where(jnp.eye(c, dtype=bool), -jnp.inf,
                  jax.lax.stop_gradient(cos))
  nearest = jnp.argmax(off, axis=1)
  return jnp.mean(jnp.take_along_axis(cos, nearest[:, None], axis=1))


def sparse_centers_regularizer(weights: Array, *,
                               centers_per_class: int) -> Array:
  r"""``sum_{c, k < l} sqrt(2 - 2 cos(w_{ck}, w_{cl})) / (2 #pairs)`` (PML's
  ``SparseCentersRegularizer``, for SoftTriple's sub-centres): the
  sub-centres of a class pulled together, the Euclidean distances of their
  unit vectors summed and divided by twice the number of pairs (PML's
  ``DivisorReducer``).

  Args:
    weights: ``[C K, D]`` class vectors, class-major (row ``c K + k``).
    centers_per_class: ``K > 1``.

  Returns:
    float32 scalar.
  """
  w = ops.l2_normalize(_rows(weights, "weights"))
  k = int(centers_per_class)
  if k < 2 or w.shape[0] % k:
    raise ValueError(
        f"`centers_per_class` must be > 1 and divide the class matrix's "
        f"{w.shape[0]} rows; got {centers_per_class!r}.")
  block = w.reshape(-1, k, w.shape[1])
  cos = jnp.einsum("cid,cjd->cij", block, block)
  upper = jnp.triu(jnp.ones((k, k), bool), 1)
  # (the other pairs' cosines replaced before the square root: no NaN
  # gradient through sqrt(0) of a centre with itself)
  cos = jnp.where(upper, jnp.minimum(2.0 * cos, 2.0), 0.0)
  reg = jnp.sqrt(2.0 + _TINY - cos)
  return jnp.sum(jnp.where(upper, reg, 0.0)) / (2.0 * block.shape[0]
                                                * jnp.sum(upper))


# name -> (function, what it takes: "embeddings", "weights" or both).
REGULARIZERS = types.MappingProxyType({
    "lp": (lp_regularizer, ("embeddings", "weights")),
    "zero_mean": (zero_mean_regularizer, ("weights",)),
    "center_invariant": (center_invariant_regularizer, ("weights",)),
    "regular_face": (regular_face_regularizer, ("weights",)),
    "sparse_centers": (sparse_centers_regularizer, ("weights",)),
})

# A loss's config fields of its regularizers, with their defaults (PML's
# names; "" is none). `reg_p` and `reg_power` are `lp`'s.
FIELDS = types.MappingProxyType({
    "embedding_regularizer": "", "embedding_reg_weight": 1.0,
    "weight_regularizer": "", "weight_reg_weight": 1.0,
    "reg_p": 2.0, "reg_power": 1.0,
})


def check_regularizer(name: str, target: str) -> None:
  """A regularizer's name for ``target`` (``"embeddings"``, ``"weights"``),
  with an error naming those that take it."""
  if name and target not in REGULARIZERS.get(name, (None, ()))[1]:
    known = [n for n, (_, t) in REGULARIZERS.items() if target in t]
    raise ValueError(f"the {target} regularizer must be one of {known} (or "
                     f"'' for none); got {name!r}.")


def regularization(fields, embeddings: Array, weights=None, *,
                   centers_per_class: int = 1, axis_name=None) -> Array:
  """The regularizers of a loss's config, weighted and added.

  Args:
    fields: a mapping with :data:`FIELDS` (missing ones at their defaults).
    embeddings: ``[B, D]`` this device's embeddings.
    weights: the loss's ``[C, D]`` class matrix, or ``None``.
    centers_per_class: the rows per class of ``weights``
      (``sparse_centers``).
    axis_name: optional mapped axis of the embeddings.

  Returns:
    float32 scalar (0 without regularizers).
  """
  f = {**FIELDS, **{k: v for k, v in dict(fields).items() if v is not None}}
  total = jnp.zeros((), jnp.float32)
  lp = {"p": f["reg_p"], "power": f["reg_power"]}
  name = f["embedding_regularizer"]
  if name:
    check_regularizer(name, "embeddings")
    checks.check_embeddings(embeddings)
    total += f["embedding_reg_weight"] * lp_regularizer(
        embeddings, axis_name=axis_name, **lp)
  name = f["weight_regularizer"]
  if name:
    check_regularizer(name, "weights")
    if weights is None:
      raise ValueError("`weight_regularizer` needs a loss with a class "
                       "matrix (proxies, class weights or centres).")
    kwargs = {"lp": lp, "sparse_centers": {
        "centers_per_class": centers_per_class}}.get(name, {})
    total += f["weight_reg_weight"] * REGULARIZERS[name][0](weights,
                                                            **kwargs)
  return total
