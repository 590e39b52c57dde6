r"""PNP: penalise only the negatives ranked before each positive (Li et al.).

For anchor ``i`` with positives ``P_i`` and negatives ``N_i``, the smoothed
number of negatives ranked above positive ``j`` is

.. math::

  R_{ij} = \sum_{k \in N_i} \sigma\big((s_{ik} - s_{ij}) / \tau\big),

and the loss averages a function ``f`` of it over the positives and the
anchors (the paper's eq. 7-12, its variants by name):

===========  ==========================================  ==================
variant      ``f(R)``                                     the paper's name
===========  ==========================================  ==================
``"O"``      ``R``                                        PNP-O
``"Ds"``     ``\log(1 + R)``                              PNP-D_s
``"Dq"``     ``1 - (1 + R)^{-\alpha}`` (see below)        PNP-D_q
``"Iu"``     ``(1 + R) \log(1 + R)``                      PNP-I_u
``"Ib"``     ``(bR - \log(1 + bR)) / b^2``                PNP-I_b
===========  ==========================================  ==================

As pytorch-metric-learning 2.9 (adapted from the official code), the anchor
counts among its own positives (``j = i``, with its self-similarity ``s_ii``,
1 for the cosine), the sigmoid's exponent is clipped to ``[-50, 50]`` and
``"Dq"`` is ``1 - \mathrm{mean}((1 + R)^{-\alpha})``. ``\tau`` is PML's
``anneal``.

Tiling. ``R`` is ``[M, N]``, but each entry sums over ``N`` negatives: formed
at once, a ``[M, N, N]`` tensor (PML builds it). Here the anchors are taken
in blocks of ``block_size`` rows (``jax.lax.map``) and the negatives in tiles
of ``block_size`` columns (``jax.lax.scan``), both rematerialised in the
backward pass (``jax.checkpoint``): live memory ``O(block^2 N)`` and time
``O(M N^2)`` sigmoids. As for the ranking surrogates
(:mod:`circle_jax.losses.ranking`), the device ring is refused: each
anchor's ranks need all of its similarities at once.
"""

from __future__ import annotations

import dataclasses
import types
import jax
import jax.numpy as jnp

from circle_jax.losses import entries
from circle_jax.losses import ranges
from circle_jax.losses import ranking
from circle_jax.losses.engine import reductions

Array = jax.Array

VARIANTS = ("Ds", "Dq", "Iu", "Ib", "O")


@dataclasses.dataclass(frozen=True)
class PNP:
  """PNP's hyperparameters, named and defaulted as PML 2.9's ``PNPLoss``.

  Attributes:
    b: the ``I_b`` variant's ``b`` (> 0).
    alpha: the ``D_q`` variant's exponent ``alpha`` (> 0).
    anneal: the sigmoid's temperature ``tau`` in [1e-3, 1e4].
    variant: one of :data:`VARIANTS` (static).
  """

  b: float = 2.0
  alpha: float = 1.0
  anneal: float = 0.01
  variant: str = "O"

  ranges = types.MappingProxyType({
      "b": ranges.POSITIVE_RANGE, "alpha": ranges.POSITIVE_RANGE,
      "anneal": ranges.DIVIDING_TEMPERATURE_RANGE})

  def __post_init__(self):
    if self.variant not in VARIANTS:
      raise ValueError(f"`variant` must be one of {VARIANTS} (PML's names); "
                       f"got {self.variant!r}.")
    ranges.check_ranges({"b": self.b, "alpha": self.alpha,
                         "anneal": self.anneal}, self.ranges, "PNP")

  def f(self, r: Array) -> Array:
    """The variant's function of the ranks (``Dq`` before ``1 - mean``)."""
    if self.variant == "Ds":
      return jnp.log1p(r)
    if self.variant == "Dq":
      return (1.0 + r) ** (-self.alpha)
    if self.variant == "Iu":
      return (1.0 + r) * jnp.log1p(r)
    if self.variant == "Ib":
      return (self.b * r - jnp.log1p(self.b * r)) / self.b ** 2
    return r


def negative_ranks(t: Array, s: Array, neg: Array, anneal, block: int
                   ) -> Array:
  """``R[i, j] = sum_k neg[i, k] sigmoid(clip((s[i, k] - t[i, j]) / anneal,
  -50, 50))``, tile by tile (module docstring).

  Args:
    t: ``[M, J]`` the similarities of the ranked items.
    s: ``[M, N]`` the candidates' similarities.
    neg: ``[M, N]`` bool, the negatives among the candidates.
    anneal: the temperature.
    block: rows per block and columns per tile (static).

  Returns:
    ``[M, J]`` float32.
  """
  m, n = s.shape
  rows, cols = min(block, m), min(block, n)

  def one_block(x):
    t_b, s_b, neg_b = x

    @jax.checkpoint
    def step(acc, tile):
      s_k, neg_k = tile
      z = jnp.clip((s_k[:, None, :] - t_b[:, :, None]) / anneal, -50.0, 50.0)
      sig = jnp.where(neg_k[:, None, :], jax.nn.sigmoid(z), 0.0)
      return acc + jnp.sum(sig, axis=-1), None

    tiles = (ranking.column_tiles(s_b, cols), ranking.column_tiles(neg_b, cols))
    acc, _ = jax.lax.scan(step, jnp.zeros_like(t_b), tiles)
    return acc

  blocks = tuple(ranking.row_blocks(v, rows) for v in (t, s, neg))
  r = jax.lax.map(jax.checkpoint(one_block), blocks)
  return r.reshape(-1, t.shape[1])[:m]


def pnp_loss(embeddings: Array, labels: Array, *, b: float = PNP.b,
             alpha: float = PNP.alpha, anneal: float = PNP.anneal,
             variant: str = PNP.variant, **options) -> Array:
  r"""PNP loss (Li et al., AAAI 2022), without a ``B^3`` tensor.

  With ``R_{ij}`` and ``f`` of the module docstring and ``P'_i = P_i \cup
  \{i\}`` (the anchor is its own positive, as in PML 2.9):

  .. math::

    L = \frac{1}{B} \sum_i \frac{1}{|P'_i|} \sum_{j \in P'_i} f(R_{ij})

  (``"Dq"``: ``1 - `` that, with ``f(R) = (1 + R)^{-\alpha}``).

  Reduction: the mean over every (global) anchor, as PML (each has at least
  itself as a positive). An anchor without negatives has ``R = 0``: zero
  loss and zero gradient in every variant.

  A ``reduction`` (docs/reductions.md) reduces every anchor's term (its mean
  over ``P'_i``; ``"Dq"``: 1 minus it) instead, dense and blockwise;
  ``"none"`` gives them as ``[B]``. PML's loss is already reduced: its
  reducers do nothing to it.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    b: ``b`` of ``"Ib"``.
    alpha: ``alpha`` of ``"Dq"``.
    anneal: the sigmoid's temperature ``tau`` (PML's name).
    variant: ``"O"``, ``"Ds"``, ``"Dq"``, ``"Iu"`` or ``"Ib"`` (PML's
      names).
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`; ``block_size`` is the
      tile size (``None``: 128) and ``collective="ring"`` is refused.

  Returns:
    float32 scalar.

  References:
    Li, Xu, Zhu, Hu, Wang, Wang, Lin, "Rethinking the Optimization of
    Average Precision: Only Penalizing Negative Instances before Positive
    Ones is Enough", AAAI 2022.
  """
  hp = PNP(b=b, alpha=alpha, anneal=anneal, variant=variant)
  block = ranking.ranking_block(embeddings, labels, loss="PNP loss",
                                **options)
  own = ranking.self_similarity(embeddings, options.get("geometry"))
  s, pos = block.s, block.pos
  neg = block.cand & ~pos
  t = jnp.concatenate([s, own[:, None]], axis=1)
  ranked = jnp.concatenate([pos, jnp.ones_like(pos[:, :1])], axis=1)
  r = negative_ranks(t, s, neg, hp.anneal, block.block)
  per_anchor = (jnp.sum(jnp.where(ranked, hp.f(r), 0.0), axis=1)
                / jnp.sum(ranked, axis=1))
  if hp.variant == "Dq":
    per_anchor = 1.0 - per_anchor
  if block.reduction is not None:  # every anchor is an element
    return ranking.anchor_loss(per_anchor, jnp.ones(per_anchor.shape, bool),
                               block, options.get("axis_name"))
  return reductions.sum_over_batch(per_anchor, options.get("axis_name"))


REGISTRY = (
    entries.entry("pnp", pnp_loss, "pair", rule=PNP,
        paper="Li et al., \"Rethinking the Optimization of Average "
              "Precision: Only Penalizing Negative Instances before "
              "Positive Ones is Enough\", AAAI 2022",
        reduction="mean over anchors of the mean over their positives "
                  "(the anchor among them)",
        reduction_note="every anchor; PML's loss is already reduced, its "
                       "reducers do nothing; dense and blockwise"),
)
