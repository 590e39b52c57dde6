"""Margin loss with distance-weighted sampling (Wu et al. 2017), dense.

Not a rule: its boundary ``beta_a`` is a learnable per-anchor (per-class)
parameter that receives a gradient, and its pairs carry real weights (the
sampler's draw counts) rather than the rule interface's boolean masks; a
rule's hyperparameters are scalars and its tiles elementwise
(:mod:`circle_jax.losses.engine.rule`). A two-stage rule's per-anchor value
(:mod:`circle_jax.losses.engine.rule`, the N-pair and lifted structure
losses) could carry ``beta_a`` with its gradient, but not the weights: the
sampler draws each positive pair's negatives from a distribution
normalised over the anchor's whole row of distances, so a pair's weight is
a real draw count, not a boolean mask the tiles could apply. It takes the
rules' ``**options`` through :func:`circle_jax.losses.engine.dense_block`
(dense engine only).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax.losses import entries
from circle_jax.losses import checks
from circle_jax.losses.engine import reductions
from circle_jax.losses import engine
from circle_jax.losses import miners
from circle_jax.losses import ranges

Array = jax.Array

_NOT_A_RULE = ("a learnable per-anchor boundary and weighted pairs")


def _beta_rows(beta, labels):
  beta = jnp.asarray(beta)
  checks.check_floating(beta, f"`beta` must be a floating array; got "
                               f"{beta.dtype}.")
  if beta.ndim == 0:
    return jnp.broadcast_to(beta.astype(jnp.float32), labels.shape[:1])
  checks.check_rank(beta, 1, f"`beta` must be a scalar or a [num_classes] "
                              f"vector; got shape {beta.shape}.")
  checks.require_class_ids(labels, "a per-class `beta` (pass a scalar beta)")
  return beta.astype(jnp.float32)[labels]


def _margin_core(dist, pos_w, neg_w, beta_rows, *, margin, nu, axis_name):
  b = beta_rows[:, None]
  pos_loss = jax.nn.relu(dist - b + margin)
  neg_loss = jax.nn.relu(b - dist + margin)
  total = (jnp.sum(pos_w * pos_loss) + jnp.sum(neg_w * neg_loss)
           + nu * jnp.sum(pos_w * b))
  count = (jnp.sum(jnp.where(pos_loss > 0, pos_w, 0.0))
           + jnp.sum(jnp.where(neg_loss > 0, neg_w, 0.0)))
  return reductions.ratio_of_sums(total, count, axis_name)


def _margin_reduced(dist, pos_w, neg_w, beta_rows, *, margin, nu, reduction,
                    labels, axis_name):
  """``reduction`` of the pair terms: ``w_ap ([d_ap - beta_a + m]_+ + nu
  beta_a)`` of the positive pairs and ``w_an [beta_a - d_an + m]_+`` of the
  negative pairs (the pairs with a weight), each set on its own."""
  b = beta_rows[:, None]
  terms_p = pos_w * (jax.nn.relu(dist - b + margin) + nu * b)
  terms_n = neg_w * jax.nn.relu(b - dist + margin)
  return engine.reduce_pair_sets(((terms_p, pos_w > 0), (terms_n, neg_w > 0)),
                                 reduction, labels=labels,
                                 axis_name=axis_name)


def _margin_weights(pos, neg, pair_weights):
  if pair_weights is None:
    return pos.astype(jnp.float32), neg.astype(jnp.float32)
  pair_weights = checks.check_shape(
      pair_weights, pos.shape,
      f"`pair_weights` must have the shape of the distance block "
      f"{pos.shape}; got {jnp.shape(pair_weights)}.")
  w = pair_weights.astype(jnp.float32)
  return jnp.where(pos, w, 0.0), jnp.where(neg, w, 0.0)


@dataclasses.dataclass(frozen=True)
class Margin:
  """The margin loss's hyperparameters, the defaults of both its forms: the
  margin ``m`` (the paper's ``alpha``) and the weight ``nu`` of the ``beta``
  regulariser."""

  margin: float = 0.2
  nu: float = 0.0


def margin_loss_from_distance(distance: Array, labels: Array, beta: Array, *,
                              margin: float = Margin.margin,
                              nu: float = Margin.nu,
                              pos_mask: Optional[Array] = None,
                              neg_mask: Optional[Array] = None,
                              pair_weights: Optional[Array] = None) -> Array:
  """Margin loss of a square ``[B, B]`` distance matrix (no sampling).

  See :func:`margin_loss`; pass a sampler's ``pair_weights`` to reproduce
  distance-weighted sampling.
  """
  dist, labels, pos, neg = engine.square_block(distance, labels, pos_mask,
                                                neg_mask, "distance")
  pos_w, neg_w = _margin_weights(pos, neg, pair_weights)
  return _margin_core(dist, pos_w, neg_w, _beta_rows(beta, labels),
                      margin=margin, nu=nu, axis_name=None)


def margin_loss(
    embeddings: Array,
    labels: Array,
    beta: Array,
    *,
    margin: float = Margin.margin,
    nu: float = Margin.nu,
    key: Optional[Array] = None,
    cutoff: float = miners.DistanceWeighted.cutoff,
    nonzero_loss_cutoff: float = (
        miners.DistanceWeighted.nonzero_loss_cutoff),
    pair_weights: Optional[Array] = None,
    **options,
) -> Array:
  r"""Margin loss with learnable boundary and distance-weighted sampling.

  Wu et al. (2017), eq. 5, on Euclidean distances ``d`` between L2-normalised
  embeddings, with ``beta_a`` the boundary of the anchor's class (or one
  shared scalar):

  .. math::

    L = \frac{\sum_{(a,p)} w_{ap} [d_{ap} - \beta_a + m]_+
              + \sum_{(a,n)} w_{an} [\beta_a - d_{an} + m]_+
              + \nu \sum_{(a,p)} w_{ap} \beta_a}
             {\sum_{(a,j)} w_{aj}\, [\ell_{aj} > 0]} .

  This is the official reduction: the sum of the hinge terms and of the
  ``nu``-regulariser (one ``beta`` per triplet, i.e. per positive pair),
  divided by the number of pairs with non-zero loss (counted with
  multiplicity; 1 when there is none, so an empty batch gives 0).

  A ``reduction`` (docs/reductions.md) reduces pair terms instead, each set
  on its own and the two added: a positive pair's ``w_{ap}([d_{ap} -
  \beta_a + m]_+ + \nu \beta_a)`` and a negative pair's ``w_{an}[\beta_a
  - d_{an} + m]_+``, over the pairs with a weight (a sampled pair once,
  its term times its draw count); ``"none"`` gives them as ``[B, N]`` at
  (anchor, candidate). PML's elements differ: its ``MarginLoss`` has one
  term per triplet (``d_ap`` and ``d_an`` hinges together) and its ``nu``
  term is a separate sub-loss.

  Sampling: with ``key``, each positive pair ``(a, p)`` draws one negative of
  ``a`` by distance-weighted sampling (:func:`distance_weighted_miner`;
  ``w_{an}`` is the draw count, ``w_{ap} = 1``), as in the official code.
  Without ``key`` every pair has weight 1 (or ``pair_weights``).

  With references (``ref``) the pairs are (anchor, reference):
  ``a`` is a row of ``embeddings`` with its class's ``beta_a``, ``p`` and
  ``n`` are its positives and negatives among the references, and the
  sampler draws each positive pair's negative among the references.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels in ``[0, num_classes)`` when ``beta`` is
      per class.
    beta: learnable boundary, a scalar or ``[num_classes]`` (the official
      code is class-specific, initialised to 1.2).
    margin: the margin ``m`` (the paper's ``alpha``).
    nu: weight of the ``beta`` regulariser.
    key: PRNG key of the distance-weighted sampler; ``None`` uses all pairs.
    cutoff, nonzero_loss_cutoff: sampler parameters (see
      :func:`distance_weighted_miner`).
    pair_weights: optional float ``[M, N]`` pair multiplicities (e.g. from
      :func:`distance_weighted_miner`); exclusive with ``key``.
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`;
      sampling is per global row, so it matches the single-device draws.

  Returns:
    float32 scalar.

  References:
    Wu, Manmatha, Smola, Kraehenbuehl, "Sampling Matters in Deep Embedding
    Learning", ICCV 2017.
  """
  if key is not None and pair_weights is not None:
    raise ValueError(
        "Pass either `key` (sample negatives) or `pair_weights` (already "
        "sampled), not both.")
  ranges.check_range(margin, "margin", ranges.NONNEGATIVE_RANGE)
  axis_name = options.get("axis_name")
  reduction = engine.as_reduction(options.pop("reduction", None))
  rows, _, dist, pos, neg = engine.dense_block(
      embeddings, labels, loss="margin loss", reason=_NOT_A_RULE,
      distance=True, **options)
  if key is not None:
    if engine.resolve_geometry(options.get("geometry")) not in (
        None, engine.COSINE):
      raise ValueError(
          "The margin loss's distance-weighted sampling (`key`) assumes "
          "unit vectors: use the cosine geometry, or pass `key=None`.")
    m, dim = rows.z.shape
    num_rows = m if axis_name is None else m * jax.lax.axis_size(axis_name)
    pair_weights = miners.distance_weighted_weights(
        dist, pos, neg, reductions.local_row_offset(m, axis_name), key, dim,
        cutoff=cutoff, nonzero_loss_cutoff=nonzero_loss_cutoff,
        num_rows=num_rows)
  pos_w, neg_w = _margin_weights(pos, neg, pair_weights)
  beta_rows = _beta_rows(beta, rows.labels)
  if reduction is not None:
    return _margin_reduced(dist, pos_w, neg_w, beta_rows, margin=margin,
                           nu=nu, reduction=reduction, labels=rows.labels,
                           axis_name=axis_name)
  return _margin_core(dist, pos_w, neg_w, beta_rows, margin=margin, nu=nu,
                      axis_name=axis_name)


REGISTRY = (
    entries.entry("margin", margin_loss, "pair", param_name="beta",
        tiled=False,
        init=entries.margin_beta, param_init="constant 1.2 per class",
        needs_key=True,
        paper="Wu et al., \"Sampling Matters in Deep Embedding "
              "Learning\", ICCV 2017",
        reduction="sum over (sampled) pairs / #pairs with non-zero "
                  "loss",
        reduction_note="pairs weighted by their draws, each set on its "
                       "own; PML's element differs: the triplet, its nu "
                       "term a separate sub-loss; the dense engine"),
)
