"""The dense engine: a rule on a whole ``[M, N]`` block, by autodiff.

Both label sets of a row share one ``exp`` pass
(:func:`circle_jax.ops.two_set_exp`); the gradient is JAX's, so the dense
engine is the reference the tiled engines (blockwise, ring) are tested
against.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses.engine import tiles
from circle_jax.losses.engine.rule import set_statistics

Array = jax.Array


def selected_pairs(rule, similarity: Array, pos: Array, neg: Array):
  """The pairs ``rule`` uses in a whole block (pre-pass and selection).

  Without gradient; e.g. Multi-Similarity's mining as a miner.

  Returns:
    ``(pos, neg)``, ``[M, N]`` bool.
  """
  s = jax.lax.stop_gradient(similarity)
  pre = tiles.prepass_update(rule, None, s, pos, neg, keepdims=True)
  return rule.select(rule.prepare(s), pos, neg, pre)


def dense_per_anchor(rule, similarity: Array, pos: Array, neg: Array,
                     aux=None) -> Tuple[Array, Array]:
  """Runs ``rule`` on a whole ``[M, N]`` block, differentiated by autodiff.

  Both sets of a row share one ``exp`` pass
  (:func:`circle_jax.ops.two_set_exp`).

  Args:
    rule: the pair rule.
    similarity: ``[M, N]`` float32 block (for a rule on distances, whatever
      its ``prepare`` reads).
    pos, neg: ``[M, N]`` bool label (and miner) masks, disjoint.
    aux: ``None``, or a two-stage rule's first-stage values ``(t_row [M],
      t_col [N] or None)`` (the sides' ``aux``, :func:`tiles.pair_aux`),
      differentiated by autodiff too.

  Returns:
    ``(per_anchor [M], valid [M])``.
  """
  aux = None if aux is None else tiles.pair_aux(*aux)
  x = tiles.prepare(rule, similarity, aux)
  pre = tiles.prepass_update(rule, None, similarity, pos, neg, keepdims=True,
                             aux=aux)
  pos, neg = rule.select(jax.lax.stop_gradient(x), pos, neg, pre)
  kind_p, kind_n = set_statistics(rule)
  v_p = v_n = None
  if (kind_p, kind_n) != ("lse", "lse"):
    v_p, v_n = rule.values(x)

  def total(mask, v):
    count = jnp.sum(mask.astype(tiles.F32), axis=-1)
    return jnp.sum(jnp.where(mask, v, 0.0), axis=-1), count

  if (kind_p, kind_n) == ("sum", "sum"):
    return rule.combine(total(pos, v_p), total(neg, v_n))
  logit_p, logit_n = rule.logits(x)
  # A "sum" set takes no exp (so it may overlap the other set).
  none = jnp.zeros_like(pos)
  e, m_p, m_n = ops.two_set_exp(logit_p, logit_n,
                                none if kind_p == "sum" else pos,
                                none if kind_n == "sum" else neg,
                                rule.shift(pre))

  def statistic(kind, mask, v, m):
    if kind == "sum":
      return total(mask, v)
    if kind == "lse":
      s = jnp.sum(jnp.where(mask, e, 0.0), axis=-1, keepdims=True)
      return jnp.squeeze(ops.log_of_shifted_sum(s, m), -1)
    # "mean": the weights are constant in backprop. An empty set has all
    # weights 0 (total 0); a non-empty one has total about >= 1 (its maximum
    # gives exp(0), up to the rounding of a recomputed logit, which at large
    # temperatures is not exactly 0).
    w = jax.lax.stop_gradient(e)
    total_w = jnp.sum(jnp.where(mask, w, 0.0), axis=-1)
    return (jnp.sum(jnp.where(mask, w * v, 0.0), axis=-1)
            / jnp.where(total_w == 0, 1.0, total_w))

  return rule.combine(statistic(kind_p, pos, v_p, m_p),
                      statistic(kind_n, neg, v_n, m_n))
