"""General Pair Weighting: the pair weights of any similarity-matrix loss.

Wang et al. (2019) observe that for a loss ``L(S)`` of the similarity matrix,
back-propagation through ``S`` scales every pair's contribution by
``dL/dS_ij``: positives are pulled with weight ``w+_ij = |dL/dS_ij|`` and
negatives pushed with ``w-_ij = |dL/dS_ij|``. Every pair-based loss in
:mod:`circle_jax.losses` has a similarity (or distance) matrix form, so its
weights come from autodiff instead of a hand derivation.

References:
  Wang, Han, Huang, Dong, Scott. "Multi-Similarity Loss with General Pair
  Weighting for Deep Metric Learning". CVPR 2019.
"""

from __future__ import annotations

from typing import Callable, Tuple

import jax
import jax.numpy as jnp

from circle_jax.losses import engine

Array = jax.Array


def pair_weights(loss_fn: Callable[..., Array], similarity: Array,
                 labels: Array, **hyper) -> Tuple[Array, Array]:
  r"""Pair weights ``|dL/dS_ij|`` of a similarity-matrix loss, by autodiff.

  .. math::

    w^+_{ij} = \Big|\frac{\partial L}{\partial S_{ij}}\Big|\ \text{on positive
    pairs}, \qquad
    w^-_{ij} = \Big|\frac{\partial L}{\partial S_{ij}}\Big|\ \text{on negative
    pairs},

  and 0 elsewhere. Positive pairs share the label and are not the diagonal;
  negative pairs have different labels. ``S_ij`` and ``S_ji`` are separate
  entries: row ``i`` holds the pairs as seen from anchor ``i``. The weights
  include the loss's reduction (e.g. the ``1/B`` of the MS loss or the
  ``1/#valid anchors`` of the Circle loss), and for losses that treat some
  factors as constants in backprop (Circle's ``alpha``) they are the weights
  the optimiser actually applies.

  ``loss_fn`` is a Python callable, so to ``jax.jit`` this function close
  over it: ``jax.jit(functools.partial(pair_weights, loss_fn))``.

  Args:
    loss_fn: a square matrix form ``loss_fn(similarity, labels, **hyper) ->
      scalar``, e.g. ``multi_similarity_loss_from_similarity`` or
      ``circle_loss_from_similarity`` (a ``*_from_distance`` form works too:
      the weights are then ``|dL/dD_ij|``).
    similarity: ``[B, B]`` float similarity (or distance) matrix.
    labels: ``[B]`` integer labels.
    **hyper: keyword hyperparameters passed to ``loss_fn`` (including
      ``pos_mask`` / ``neg_mask``).

  Returns:
    ``(w_pos, w_neg)``: two ``[B, B]`` float32 arrays.

  References:
    Wang et al., "Multi-Similarity Loss with General Pair Weighting for Deep
    Metric Learning", CVPR 2019, Sec. 3 (General Pair Weighting).
  """
  if not callable(loss_fn):
    raise TypeError(
        f"`loss_fn` must be a callable similarity-matrix loss such as "
        f"`multi_similarity_loss_from_similarity`; got {type(loss_fn)}.")
  similarity, labels, pos, neg = engine.square_block(similarity, labels)
  grad = jax.grad(lambda s: loss_fn(s, labels, **hyper))(similarity)
  magnitude = jnp.abs(grad).astype(jnp.float32)
  return (jnp.where(pos, magnitude, 0.0), jnp.where(neg, magnitude, 0.0))
