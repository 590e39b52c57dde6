r"""Recall@k surrogate (RS@k) and Similarity Mixup (SiMix) (Patel, Tolias,
Matas, CVPR 2022), tile by tile.

For anchor ``i`` with positives ``P_i`` and candidates ``Omega_i``
(positives and negatives, never ``i`` itself) the rank of a positive ``p``
is smoothed with a sigmoid of temperature ``tau1`` and the count of
positives within rank ``k`` with one of temperature ``tau2``:

.. math::

  r_{ip} = 1 + \sum_{c \in \Omega_i, c \ne p}
    \sigma\big((s_{ic} - s_{ip})/\tau_1\big), \qquad
  \mathrm{RS@}k_i = \frac{\min\big(\sum_{p \in P_i}
    \sigma((k - r_{ip})/\tau_2),\ k\big)}{\min(k, |P_i|)},

  L = \operatorname*{mean}_{i:\ |P_i| > 0}
    \Big(1 - \frac{1}{|K|} \sum_{k \in K} \mathrm{RS@}k_i\Big),

with ``K = (1, 2, 4, 8, 16)``, ``tau1 = 0.01`` and ``tau2 = 1`` (the paper's
and the official ``main.py``'s defaults). Each ``k`` larger than the batch
(the candidates' count) is clipped to it, as the official code does.

Memory. The ranks are Smooth-AP's denominators
(:mod:`circle_jax.losses.smooth_ap`): ``O(B^3)`` sigmoids, which
:func:`circle_jax.losses.ranking.block_ranks` accumulates in ``[R, N, K]``
tiles of ``block_size`` and whose gradient a ``custom_vjp`` recomputes tile
by tile (:func:`circle_jax.losses.ranking.block_rank_grad`); the recall
terms, ``O(B^2 |K|)``, are plain autodiff. Memory ``O(B^2 + block^2 B)``;
dense and blockwise are one computation (``block_size=None``: 128).

Official code (yash0307/RecallatK_surrogate, ``src/losses.py``
``RecallatK``, ``src/mixup.py`` ``pos_mixup``, ``src/main.py``) and what we
follow:

* its rank of a positive counts every other sample of the batch, the query
  itself included: the query's similarity with itself (1 on the sphere)
  adds about 1 to every positive's rank. The paper's rank is over the
  database without the query; we follow the paper, and
  ``rank_counts_query=True`` gives the code's rank (tested against a
  float64 transcription of ``RecallatK.forward``);
* it takes the positives from a layout of equal, contiguous classes
  (``|P| = samples_per_class - 1``); we take them from the labels (any class
  sizes and order, miner masks). An anchor without positives divides by 0
  there; here it is left out of the mean (zero loss, zero gradient);
* the loss is ``(1 - recall) / batch_size`` summed over the queries, our
  mean of ``1 - RS@k``; it clamps the sigmoids' exponent to [-50, 50],
  which changes nothing measurable (``e^-50``); we use ``jax.nn.sigmoid``;
* ``--k_temperatures`` (``tau2`` per ``k``) is reset in ``main.py`` to
  ``[1] * len(opt.k_vals)``, the *evaluation* k list (4 values on SOP,
  iNaturalist; 5 on Cars, CUB), while the loss indexes it by the 5 training
  ``k``: on SOP it would fail with an IndexError at the fifth ``k``. Every
  published run therefore used ``tau2 = 1`` for every ``k``, the paper's
  ``tau2``: we take one ``tau2`` for all ``k``.

SiMix (:func:`simix`): each pair of same-class samples ``(a, b)`` of the
batch gives one virtual sample ``alpha z_a + (1 - alpha) z_b`` of their
class, ``alpha ~ U(0, 1)`` per pair, of the L2-normalised embeddings ``z``
and not re-normalised. The virtual samples join the batch as queries,
positives and negatives, and the loss is the mean over all queries, real and
virtual (the official training loop loops ``q`` over the mixed batch;
``pos_mixup`` mixes every pair of each class, for 3, 4 or 6 samples per
class). Similarities with virtual samples are dot products (not cosines),
as in the official code. The gradient reaches the real embeddings through
the mixtures.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from circle_jax.losses import checks
from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses import ranges
from circle_jax.losses import ranking

Array = jax.Array
F32 = jnp.float32


def _check_k(k) -> tuple:
  values = tuple(k) if isinstance(k, (tuple, list)) else (k,)
  if not values or not all(
      isinstance(v, int) and not isinstance(v, bool) and v >= 1
      for v in values):
    raise ValueError(f"`k` must be a non-empty tuple of positive integers "
                     f"(the recall levels, e.g. (1, 2, 4, 8, 16)); got {k!r}.")
  return values


@dataclasses.dataclass(frozen=True)
class RecallAtK:
  """RS@k's hyperparameters and their documented ranges.

  Attributes:
    k: the recall levels ``K``, positive integers.
    tau1: the rank sigmoid's temperature in [1e-3, 1e4].
    tau2: the recall sigmoid's temperature in [1e-3, 1e4].
    samples_per_class: SiMix's most samples of one class in a batch (>= 2).
  """

  k: tuple = (1, 2, 4, 8, 16)
  tau1: float = 0.01
  tau2: float = 1.0
  samples_per_class: int = 4

  ranges = types.MappingProxyType(
      {"tau1": ranges.DIVIDING_TEMPERATURE_RANGE,
       "tau2": ranges.DIVIDING_TEMPERATURE_RANGE})

  def __post_init__(self):
    _check_k(self.k)
    ranges.check_ranges({"tau1": self.tau1, "tau2": self.tau2}, self.ranges,
                        "RS@k")
    m = self.samples_per_class
    if not isinstance(m, int) or isinstance(m, bool) or m < 2:
      raise ValueError(f"`samples_per_class` must be an integer >= 2 (the "
                       f"sampler's samples per class); got {m!r}.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def smoothed_ranks(s: Array, cand: Array, tau: Array, block: int) -> Array:
  """``1/2 + sum_{c in Omega_i} sigma((s_ic - s_ij) / tau)`` ``[M, N]``,
  tile by tile: for a candidate ``j`` its smoothed rank ``1 + sum_{c != j}``.

  Args:
    s: ``[M, N]`` float32 similarities.
    cand: ``[M, N]`` bool candidates ``Omega_i``.
    tau: the temperature (a float32 scalar, traced or not).
    block: static int, the rows per block and columns per tile.

  Returns:
    ``[M, N]`` float32 ranks.
  """
  return _ranks_forward(s, cand, tau, block)[0]


def _tile_sizes(s, block):
  return min(block, s.shape[0]), min(block, s.shape[1])


def _ranks_forward(s, cand, tau, block):
  m, n = s.shape
  r_block, k_block = _tile_sizes(s, block)
  ranks = jax.lax.map(
      lambda x: ranking.block_ranks(x[0], (x[1],), tau, k_block)[0],
      (ranking.row_blocks(s, r_block), ranking.row_blocks(cand, r_block)))
  return ranks.reshape(-1, n)[:m], (s, cand, tau)


def _ranks_backward(block, residuals, g):
  s, cand, tau = residuals
  m, n = s.shape
  r_block, k_block = _tile_sizes(s, block)
  ds, dtau = jax.lax.map(
      lambda x: ranking.block_rank_grad(x[0], (x[1],), (x[2],), tau,
                                        k_block),
      tuple(ranking.row_blocks(v, r_block) for v in (s, cand, g.astype(F32))))
  dtau = jnp.reshape(jnp.sum(dtau), jnp.shape(tau)).astype(tau.dtype)
  return ds.reshape(-1, n)[:m], None, dtau


smoothed_ranks.defvjp(_ranks_forward, _ranks_backward)


def rs_at_k_per_anchor(ranks: Array, pos: Array, k: Sequence[int],
                       tau2, num_candidates: int) -> Array:
  """``(1/|K|) sum_k RS@k_i`` ``[M]`` from the positives' ranks.

  Args:
    ranks: ``[M, N]`` float32 smoothed ranks (read at ``pos``).
    pos: ``[M, N]`` bool positives ``P_i``.
    k: the recall levels (static ints).
    tau2: the recall sigmoid's temperature.
    num_candidates: the batch size each ``k`` is clipped to.

  Returns:
    ``[M]`` float32 (0 for an anchor without positives).
  """
  kk = jnp.asarray([min(v, num_candidates) for v in k], F32)
  within = jax.nn.sigmoid((kk - ranks[:, :, None]) / tau2)  # [M, N, |K|]
  count = jnp.sum(jnp.where(pos[:, :, None], within, 0.0), axis=1)
  size = jnp.sum(pos, axis=1).astype(F32)[:, None]
  recall = jnp.minimum(count, kk) / jnp.maximum(jnp.minimum(kk, size), 1.0)
  return jnp.mean(recall, axis=1)


def simix_pairs(labels: Array, *,
                samples_per_class: int = RecallAtK.samples_per_class):
  """The same-class pairs that SiMix mixes, with static shapes.

  After a stable sort by label each sample pairs with the next
  ``m - 1 = samples_per_class - 1``, so every same-class pair is found when
  no class has more than ``m`` samples in the batch (the sampler's ``m``;
  with more, the farther pairs are skipped). The valid pairs come first in
  ``V = B (m - 1) // 2`` slots: exactly the pairs of a batch of ``m``
  samples per class.

  Args:
    labels: ``[B]`` integer labels.
    samples_per_class: ``m`` >= 2.

  Returns:
    ``(a [V], b [V], valid [V])``: the pairs' indices and validity.
  """
  m = samples_per_class
  n = labels.shape[0]
  order = jnp.argsort(labels, stable=True)
  i = jnp.repeat(jnp.arange(n), m - 1)
  j = i + jnp.tile(jnp.arange(1, m), n)
  a, b = order[i], order[jnp.minimum(j, n - 1)]
  ok = (j < n) & (labels[a] == labels[b])
  keep = jnp.argsort(~ok, stable=True)[:n * (m - 1) // 2]
  return a[keep], b[keep], ok[keep]


def simix(key: Array, embeddings: Array, labels: Array, *,
          samples_per_class: int = RecallAtK.samples_per_class):
  """SiMix's batch (Patel et al., CVPR 2022): the batch and its virtual
  samples (module docstring).

  Every pair ``(a, b)`` of :func:`simix_pairs` gives ``alpha z_a + (1 -
  alpha) z_b``, ``alpha ~ U(0, 1)`` (``jax.random.uniform(key, (V, 1))``, one
  per slot), ``z`` the L2-normalised embeddings (not re-normalised after
  mixing), with the pair's label.

  Args:
    key: PRNG key of the ``alpha`` draws.
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels.
    samples_per_class: ``m`` >= 2 (:func:`simix_pairs`).

  Returns:
    ``(z [B + V, D] float32, labels [B + V], valid [B + V] bool)``: the
    normalised batch then the virtual samples, their labels and validity.
  """
  RecallAtK(samples_per_class=samples_per_class)
  x = checks.check_embeddings(embeddings)
  labels = checks.check_labels(labels, x.shape[0])
  z = engine.COSINE.embed(x.astype(F32))
  a, b, ok = simix_pairs(labels, samples_per_class=samples_per_class)
  alpha = jax.random.uniform(key, (a.shape[0], 1), F32)
  virtual = alpha * z[a] + (1.0 - alpha) * z[b]
  return (jnp.concatenate([z, virtual]), jnp.concatenate([labels, labels[a]]),
          jnp.concatenate([jnp.ones(labels.shape, bool), ok]))


def _simix_options(key, embeddings, labels, samples_per_class, options):
  """The mixed batch and the options of its loss: dot products of the
  normalised and virtual samples, invalid slots masked out."""
  refused = sorted(o for o in ("pos_mask", "neg_mask", "ref")
                   if options.get(o) is not None)
  if engine.resolve_geometry(options.get("geometry")) not in (
      None, engine.COSINE):
    refused.append("geometry")
  if refused:
    raise ValueError(f"SiMix (simix=True) mixes the batch's cosine "
                     f"embeddings: drop {refused} or set simix=False.")
  if key is None:
    raise ValueError("SiMix (simix=True) draws its mixing weights: pass a "
                     "PRNG `key`, or set simix=False.")
  axis_name = options.get("axis_name")
  if axis_name is not None:  # each device mixes its own pairs
    key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
  z, mixed_labels, valid = simix(key, embeddings, labels,
                                 samples_per_class=samples_per_class)
  cols = valid if axis_name is None else jax.lax.all_gather(
      valid, axis_name, tiled=True)
  mask = valid[:, None] & cols[None, :]
  return z, mixed_labels, {**options, "geometry": engine.DOT,
                           "pos_mask": mask, "neg_mask": mask}


def recall_at_k_loss(embeddings: Array, labels: Array, *,
                     k: tuple = RecallAtK.k, tau1: float = RecallAtK.tau1,
                     tau2: float = RecallAtK.tau2,
                     rank_counts_query: bool = False, simix: bool = False,
                     samples_per_class: int = RecallAtK.samples_per_class,
                     key: Optional[Array] = None, **options) -> Array:
  r"""The Recall@k surrogate loss (Patel et al., CVPR 2022), with SiMix.

  .. math::

    L = \operatorname*{mean}_{i:\ |P_i| > 0} \Big(1 - \frac{1}{|K|}
      \sum_{k \in K} \frac{\min(\sum_{p \in P_i}
      \sigma((k - r_{ip})/\tau_2),\ k)}{\min(k, |P_i|)}\Big),
    \quad r_{ip} = 1 + \sum_{c \in \Omega_i, c \ne p}
      \sigma\big((s_{ic} - s_{ip})/\tau_1\big),

  ``s`` the cosine similarity (or the ``geometry``'s), ``P_i`` the anchor's
  positives and ``Omega_i`` its positives and negatives (the anchor itself
  excluded; with miner masks, the masked sets). The module docstring gives
  the tiling and how the official code differs (its rank counts the query:
  ``rank_counts_query``).

  Reduction: mean over the anchors with at least one positive (global over
  ``axis_name``; with SiMix, real and virtual); an anchor without positives
  contributes 0 with zero gradient. Time ``O(B^3)`` (sigmoids) +
  ``O(B^2 D)``; memory ``O(B^2 |K| + block^2 B)``. A ``reduction``
  (docs/reductions.md) reduces the anchor terms ``1 - RS@k_i`` of the
  anchors with a positive instead (PML has no RS@k), dense and blockwise;
  ``"none"`` gives them as ``[B]`` (``[B + V]`` with SiMix's ``V`` virtual
  anchors after the real ones), 0 for the others.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (computed in float32).
    labels: ``[B]`` integer labels.
    k: the recall levels ``K`` (default the paper's (1, 2, 4, 8, 16)); each is
      clipped to the candidates' count, as the official code.
    tau1: the rank sigmoid's temperature ``tau_1`` (default 0.01).
    tau2: the recall sigmoid's temperature ``tau_2`` (default 1).
    rank_counts_query: the official code's rank, which counts the anchor's
      own similarity ``s_ii`` as one more candidate above its positives
      (default False: the paper's).
    simix: SiMix (:func:`simix`): the loss of the batch with its virtual
      samples; needs ``key``; cosine only, no masks or references. With
      ``axis_name`` each device mixes its own pairs (pairs split over devices
      are not mixed) with the key folded with its index.
    samples_per_class: SiMix's pairing window, the sampler's ``m`` (default
      4, the official ``--samples_per_class``).
    key: the PRNG key of SiMix's mixing weights (else unused).
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`; here ``block_size`` is
      the tile size (``None``: 128), ``collective="ring"`` is refused, and
      ``geometry`` (``None``: cosine) sets the similarity.

  Returns:
    float32 scalar (with ``reduction="none"``, the anchor terms).

  References:
    Patel, Tolias, Matas, "Recall@k Surrogate Loss with Large Batches and
    Similarity Mixup", CVPR 2022; official code
    https://github.com/yash0307/RecallatK_surrogate.
  """
  k = _check_k(k)
  RecallAtK(k=k, tau1=tau1, tau2=tau2, samples_per_class=samples_per_class)
  num_real = None
  if simix:
    num_real = embeddings.shape[0]
    embeddings, labels, options = _simix_options(
        key, embeddings, labels, samples_per_class, options)
  block = ranking.ranking_block(embeddings, labels, loss="RS@k loss",
                                **options)
  axis_name = options.get("axis_name")
  if num_real is not None and axis_name is not None:
    num_real = num_real * jax.lax.axis_size(axis_name)
  tau1 = ranking.varying_scalar(tau1, block)
  ranks = smoothed_ranks(block.s, block.cand, tau1, block.block)
  if rank_counts_query:
    own = ranking.self_similarity(embeddings, options.get("geometry"))
    ranks = ranks + jax.nn.sigmoid((own[:, None] - block.s) / tau1)
  per_anchor = rs_at_k_per_anchor(ranks, block.pos, k, tau2,
                                  num_real or block.s.shape[1])
  return ranking.ap_loss(per_anchor, block, axis_name)


REGISTRY = (
    entries.entry("recall_at_k", recall_at_k_loss, "pair", rule=RecallAtK,
        needs_key=True,
        paper="Patel, Tolias, Matas, \"Recall@k Surrogate Loss with Large "
              "Batches and Similarity Mixup\", CVPR 2022",
        reduction=ranking.AP_REDUCTION,
        reduction_note="anchors with >= 1 positive (PML has no RS@k); "
                       "dense and blockwise"),
)
