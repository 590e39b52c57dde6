"""The one place that picks an engine, and the loss front ends built on it.

:func:`embedding_loss` is the embedding form of every rule-based pair loss:
its keyword options (:data:`OPTIONS`) are the pair losses' shared keywords,
documented here once; each loss forwards them as ``**options``.

A two-stage rule (``rule.first_stage()`` not ``None``,
:mod:`circle_jax.losses.engine.rule`) runs its first stage on the same
engine, sides and masks, and then itself with the first stage's per-anchor
output ``t`` as the sides' ``aux``: the rows' own, and the columns' where the
columns are the anchors (no ``ref``) and the rule reads them
(``column_stage``): gathered over ``axis_name`` like the columns, or, on the
ring, travelling with the column shard. The engines differentiate through
``t``, so the gradient is the whole loss's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import checks
from circle_jax.losses.engine import reductions
from circle_jax.losses.engine import blockwise
from circle_jax.losses.engine import dense
from circle_jax.losses.engine import geometry as geometry_lib
from circle_jax.losses.engine import ring
from circle_jax.losses.engine import rule as rule_lib
from circle_jax.losses.engine import sides
from circle_jax.losses.engine import tiles

Array = jax.Array

COLLECTIVES = ("all_gather", "ring")
# The execution options of the rule-based pair losses: how the loss is
# computed (the blockwise engine, the device ring), never its value.
EXECUTION_OPTIONS = ("block_size", "collective")
# The keyword options every embedding-form pair loss takes (**options).
OPTIONS = ("axis_name", "pos_mask", "neg_mask", *EXECUTION_OPTIONS, "ref",
           "geometry", "reduction")


def check_collective(collective) -> str:
  """One of :data:`COLLECTIVES`, with an error naming them."""
  if collective not in COLLECTIVES:
    raise ValueError(f"`collective` must be one of {COLLECTIVES}; got "
                     f"{collective!r}.")
  return collective


def term_kind(rule) -> Optional[str]:
  """What a term of ``rule`` is, for the ``reduction`` option: ``"anchor"``
  (a rule with a per-anchor reduction: every engine), ``"pair"`` (a rule
  whose own reduction averages pair terms, ``rule.pair_terms``: the dense
  engine's :func:`pair_terms`), or ``None`` (only the rule's own
  reduction)."""
  if not hasattr(rule, "reduce"):
    return "anchor"
  return "pair" if rule.pair_terms else None


def reduce_per_anchor(rule, per_anchor: Array, valid: Array, axis_name=None,
                      *, reduction=None, labels=None):
  """The rule's reduction of the per-anchor losses, as a float32 scalar;
  with ``reduction`` (a :class:`reductions.Reduction`) that one, of the
  terms of the valid anchors (0 for the others), every anchor an element."""
  if reduction is not None:
    terms = jnp.where(valid, per_anchor, 0.0)
    loss = reductions.reduce_terms(terms, jnp.ones(valid.shape, bool),
                                   reduction, labels=labels,
                                   axis_name=axis_name)
    return loss if reduction.kind == "none" else (
        reductions.to_float32_scalar(loss))
  if hasattr(rule, "reduce"):
    loss = rule.reduce(per_anchor, valid, axis_name)
  elif rule.reduction == "valid_mean":
    loss = reductions.mean_over_valid(per_anchor, valid, axis_name)
  else:
    loss = reductions.sum_over_batch(per_anchor, axis_name)
  return reductions.to_float32_scalar(loss)


def embedding_loss(rule, embeddings, labels, *, axis_name=None, pos_mask=None,
                   neg_mask=None, block_size: Optional[int] = None,
                   collective: str = "all_gather",
                   ref: Optional[sides.Candidates] = None,
                   geometry=None, reduction=None) -> Array:
  """A pair loss of a batch of embeddings (every ``*_loss(**options)``).

  The embeddings are checked and mapped by the rule's geometry (cosine:
  L2-normalised, computed in float32); the local anchors (rows) meet the
  candidates (columns): the batch, or the references ``ref``.

  Args:
    rule: the pair rule (its hyperparameters already set).
    embeddings: ``[B, D]`` float32 or bfloat16 (the local anchors).
    labels: ``[B]`` integer labels, or ``[B, L]`` multi-hot label sets
      (bool or 0/1; Musgrave et al., pytorch-metric-learning, GitHub issue
      658, "multi-label support"): a pair is then
      positive when the two sets intersect and negative otherwise, a sample
      without labels a negative of every other
      (:func:`circle_jax.losses.engine.tiles.same_labels`). Every engine,
      ``ref`` (its ``labels`` of the same kind), the miner masks and the
      matrix forms take them; the class-matrix losses refuse them.
    axis_name: optional mapped axis (``jax.shard_map`` / ``jax.pmap``). The
      local anchors meet the candidates of every device; the result is the
      loss of the global batch on every device and the gradient that of the
      single-device loss on the concatenated batch.
    pos_mask, neg_mask: optional ``[B, N]`` bool masks of usable positive /
      negative pairs (a miner's, :mod:`circle_jax.losses.miners`; ``N`` the
      global number of candidates), intersected with the label masks.
    block_size: ``None`` (default) forms the ``[B, N]`` block at once (the
      dense engine, autodiff). An int runs the blockwise engine: rows and
      columns in tiles of that size with online statistics and a
      ``custom_vjp`` that recomputes tiles in the backward pass, memory
      ``O(block_size^2 + (B + N) D)``; values and gradients equal the dense
      ones to float32 rounding.
    collective: with ``axis_name``, how the anchors meet the other devices'
      candidates: ``"all_gather"`` (default) gathers them on every device
      (memory grows with the device count); ``"ring"`` passes column shards
      around the devices with ``ppermute`` (:mod:`circle_jax.losses.engine.ring`;
      per-device memory independent of the device count). Ignored without
      ``axis_name``.
    ref: optional :class:`circle_jax.losses.Candidates`, reference
      embeddings (e.g. a cross-batch memory) the anchors meet instead of the
      batch, as pytorch-metric-learning's ``ref_emb``; see docs/losses.md.
    geometry: optional similarity of a pair, replacing the rule's own
      (cosine for most losses): a :class:`circle_jax.losses.engine.Geometry`
      such as ``losses.Poincare(c=0.1, r=2.3)`` (Hyp-ViT's ball,
      :mod:`circle_jax.losses.hyperbolic`), or a registered name
      (``"cosine"``, ``"poincare"`` with its defaults, ``"dot"``, and
      pytorch-metric-learning's distances ``"lp"`` and ``"snr"``,
      :class:`circle_jax.losses.engine.Lp`). Every engine runs every
      geometry; losses that read distances take the geometry's
      (``sqrt(2 - 2 cos)``, the Poincaré distance, ``d ** power``).
    reduction: ``None`` (default): the loss's own reduction. Otherwise a
      name in :data:`circle_jax.losses.engine.REDUCTIONS` or a
      :class:`circle_jax.losses.engine.Reduction` (pytorch-metric-learning's
      reducers, :func:`circle_jax.losses.engine.reductions.reduce_terms`)
      of the loss's terms (:func:`term_kind`): its anchors' on every engine,
      or its pairs' (each set reduced on its own and the two added, as
      PML's ``MultipleReducers``) on the dense engine; docs/reductions.md
      lists each loss's.

  Returns:
    float32 scalar: the rule's reduction of the per-anchor losses (with
    ``reduction="none"`` the terms).
  """
  rule = rule_lib.with_geometry(rule, geometry_lib.resolve(geometry))
  reduction = reductions.as_reduction(reduction)
  kind = None if reduction is None else term_kind(rule)
  if reduction is not None and kind is None:
    reductions.refuse_reduction(
        reduction, f"{type(rule).__name__} rule",
        "its terms are neither per anchor nor single pairs")
  on_ring = check_collective(collective) == "ring" and axis_name is not None
  if block_size is not None:
    block_size = blockwise.check_block_size(block_size)
  rows, cols = sides.pair_sides(embeddings, labels, axis_name=axis_name,
                                ref=ref, geometry=rule.geometry,
                                gather_columns=not on_ring)
  n = cols.z.shape[0] * (jax.lax.axis_size(axis_name) if on_ring else 1)
  shape = (rows.z.shape[0], n)
  if kind == "pair":
    if on_ring or block_size is not None:
      raise ValueError(
          f"reduction={reduction.kind!r} of the {type(rule).__name__} rule's "
          "pair terms needs the dense engine (the tiled engines keep per-"
          "anchor sums); drop `block_size` and `collective=\"ring\"`.")
    return _pair_reduction(rule, rows, cols, shape, pos_mask, neg_mask,
                           reduction, axis_name,
                           rule.column_stage and ref is None)
  run = _engine(rule, rows, cols, shape=shape, axis_name=axis_name,
                on_ring=on_ring, block_size=block_size,
                pos_mask=checks.check_mask(pos_mask, shape, "pos_mask"),
                neg_mask=checks.check_mask(neg_mask, shape, "neg_mask"))
  first, aux = _first_stage(rule), None
  if first is not None:
    t, _ = run(first)
    t_cols = None
    if rule.column_stage and ref is None:  # the columns are the anchors
      t_cols = t if on_ring else ops.gather_global(t, axis_name)
    aux = (t, t_cols)
  values, valid = run(rule, aux=aux)
  return reduce_per_anchor(rule, values, valid, axis_name,
                           reduction=reduction, labels=rows.labels)


def pair_terms(rule, similarity, pos, neg, aux=None):
  """A pair rule's terms on a whole block (:func:`term_kind`): ``(v_p,
  v_n)``, ``[M, N]`` each, a pair's term (``rule.pair_values``, times its
  set's ``rule.side_weights()``) where the rule selects it and 0 elsewhere.
  ``aux``: a two-stage rule's first-stage values, as
  :func:`circle_jax.losses.engine.dense.dense_per_anchor`'s."""
  aux = None if aux is None else tiles.pair_aux(*aux)
  x = tiles.prepare(rule, similarity, aux)
  pre = tiles.prepass_update(rule, None, similarity, pos, neg, keepdims=True,
                             aux=aux)
  sel_p, sel_n = rule.select(jax.lax.stop_gradient(x), pos, neg, pre)
  v_p, v_n = rule.pair_values(x, sel_p, sel_n)
  w_p, w_n = rule.side_weights()
  return jnp.where(sel_p, w_p * v_p, 0.0), jnp.where(sel_n, w_n * v_n, 0.0)


def _pair_reduction(rule, rows, cols, shape, pos_mask, neg_mask, reduction,
                    axis_name, column_stage):
  """``reduction`` of a pair rule's terms: each set's pairs (the label and
  miner masks) reduced on its own, the two added. A two-stage rule's first
  stage runs on the same block (the columns' values gathered where
  ``column_stage``), differentiated by autodiff."""
  s = rule.geometry.tile(rows.z, cols.z)
  pos, neg = sides.checked_pair_masks(rows, cols, shape, pos_mask, neg_mask)
  aux, first = None, _first_stage(rule)
  if first is not None:
    t, _ = dense.dense_per_anchor(first, s, pos, neg)
    aux = (t, ops.gather_global(t, axis_name) if column_stage else None)
  v_p, v_n = pair_terms(rule, s, pos, neg, aux)
  return reductions.reduce_pair_sets(((v_p, pos), (v_n, neg)), reduction,
                                     labels=rows.labels, axis_name=axis_name)


def _engine(rule, rows, cols, *, shape, axis_name, on_ring, block_size,
            pos_mask, neg_mask):
  """The one choice of engine: ``run(rule, aux=None) -> (per_anchor,
  valid)`` on ``rows x cols``, ``aux`` a two-stage rule's first-stage values
  of the rows and the columns (``[M]``, ``[N]`` or ``None``). The dense
  engine forms its block once for both stages of a two-stage rule, so its
  gradient takes one pull-back through the geometry; it is called directly
  (no adapter frame between the loss and the rule).
  """
  if on_ring:
    return functools.partial(_on_sides, ring.ring_per_anchor, rows, cols,
                             axis_name=axis_name, block_size=block_size,
                             pos_mask=pos_mask, neg_mask=neg_mask)
  if block_size is not None:
    return functools.partial(_on_sides, blockwise.blockwise_per_anchor, rows,
                             cols, block_size=block_size, pos_mask=pos_mask,
                             neg_mask=neg_mask)
  s = rule.geometry.tile(rows.z, cols.z)
  pos, neg = sides.checked_pair_masks(rows, cols, shape, pos_mask, neg_mask)
  return functools.partial(dense.dense_per_anchor, similarity=s, pos=pos,
                           neg=neg)


def _on_sides(per_anchor, rows, cols, rule, aux=None, **kwargs):
  """A tiled engine's ``per_anchor(rule, rows, cols, **kwargs)`` with the
  sides' ``aux`` set to ``aux`` (a two-stage rule's second stage)."""
  if aux is not None:
    rows, cols = rows._replace(aux=aux[0]), cols._replace(aux=aux[1])
  return per_anchor(rule, rows, cols, **kwargs)


def _first_stage(rule):
  """A two-stage rule's first stage (same geometry), else ``None``."""
  first = rule.first_stage()
  if first is not None and first.geometry != rule.geometry:
    raise ValueError(
        f"The first stage of {type(rule).__name__} must have its geometry "
        f"({rule.geometry}); got {first.geometry}.")
  return first


def matrix_loss(rule, matrix, labels, *, pos_mask=None, neg_mask=None,
                name: str = "similarity") -> Array:
  """A pair loss of a square ``[B, B]`` matrix (the ``*_from_*`` forms)."""
  matrix, _, pos, neg = sides.square_block(matrix, labels, pos_mask, neg_mask,
                                           name)
  aux, first = None, _first_stage(rule)
  if first is not None:  # the columns are the anchors
    t, _ = dense.dense_per_anchor(first, matrix, pos, neg)
    aux = (t, t if rule.column_stage else None)
  return reduce_per_anchor(rule, *dense.dense_per_anchor(rule, matrix, pos,
                                                         neg, aux))


def distance_matrix_loss(rule, distance, labels, *, pos_mask=None,
                         neg_mask=None) -> Array:
  """A pair loss of a square ``[B, B]`` distance matrix (the
  ``*_from_distance`` forms): :func:`matrix_loss` of ``rule`` with its
  static field ``on_distance`` set, so its ``prepare`` reads the block as
  distances, and with bad input named ``distance``.
  """
  if "on_distance" not in {f.name for f in dataclasses.fields(rule)}:
    raise ValueError(f"{type(rule).__name__} has no `on_distance` field: it "
                     "reads similarities only; use matrix_loss.")
  return matrix_loss(dataclasses.replace(rule, on_distance=True), distance,
                     labels, pos_mask=pos_mask, neg_mask=neg_mask,
                     name="distance")


def class_level_loss(rule, embeddings, labels, class_weights) -> Array:
  """A rule with class-level labels: each sample against ``C`` class vectors.

  The positive set is the sample's own class, the negatives the others; the
  result is the mean over all samples (a label outside ``[0, C)`` has no
  positive and contributes 0).
  """
  embeddings = checks.check_embeddings(embeddings)
  labels = checks.check_labels(labels, embeddings.shape[0])
  class_weights = checks.check_class_vectors(
      class_weights, embeddings.shape[1], name="class_weights")
  similarity = rule.geometry.tile(rule.geometry.embed(embeddings),
                                  rule.geometry.embed(class_weights))
  classes = jnp.arange(class_weights.shape[0], dtype=labels.dtype)
  pos = labels[:, None] == classes[None, :]
  values, _ = dense.dense_per_anchor(rule, similarity, pos, ~pos)
  return reductions.to_float32_scalar(jnp.mean(values))


def dense_block(embeddings, labels, *, loss: str, reason: str,
                distance: bool = False, axis_name=None, pos_mask=None,
                neg_mask=None, block_size: Optional[int] = None,
                collective: str = "all_gather",
                ref: Optional[sides.Candidates] = None, geometry=None,
                reduction=None):
  """The dense ``[M, N]`` block of a pair loss that is not a rule.

  Such a loss takes the same ``**options`` as the rule-based ones
  (:func:`embedding_loss`) and builds its block here; a tiled engine
  (``block_size``, ``collective="ring"``) is refused with ``reason``.

  Args:
    embeddings, labels: as :func:`embedding_loss`.
    loss: the loss's name, for the message.
    reason: why it has no tiled form, for the message.
    distance: return the geometry's distances instead of the similarities.
    axis_name, pos_mask, neg_mask, block_size, collective, ref, geometry:
      the options of :func:`embedding_loss` (default geometry: cosine).
    reduction: refused unless ``None``: a loss that reduces its own terms
      (the triplet loss) takes it out of its options first and hands it to
      :func:`circle_jax.losses.engine.reductions.reduce_terms`.

  Returns:
    ``(rows, cols, s, pos, neg)`` as :func:`sides.pair_block` (``s`` the
    distances with ``distance``).
  """
  tiled = block_size is not None or (
      check_collective(collective) == "ring" and axis_name is not None)
  if tiled:
    raise ValueError(
        f"The {loss} has only the dense engine ({reason}); drop "
        "`block_size` and `collective=\"ring\"`.")
  reductions.refuse_reduction(reductions.as_reduction(reduction), loss,
                              "its terms are not exposed")
  geometry = geometry_lib.resolve(geometry) or geometry_lib.COSINE
  rows, cols, s, pos, neg = sides.pair_block(
      embeddings, labels, axis_name=axis_name, pos_mask=pos_mask,
      neg_mask=neg_mask, ref=ref, geometry=geometry)
  return rows, cols, geometry.to_distance(s) if distance else s, pos, neg
