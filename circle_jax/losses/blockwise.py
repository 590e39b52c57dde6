"""Blockwise (memory-efficient) forms of the rule-based pair losses.

The blockwise engine itself is :func:`circle_jax.losses.engines.blockwise_per_anchor`;
every rule-based loss runs it when given ``block_size`` (``circle_loss(...,
block_size=1024)``). The functions here are the same losses with
``block_size`` required, kept for the callers that name them; they hold no
formula and no defaults of their own.
"""

from __future__ import annotations

from circle_jax.losses import circle
from circle_jax.losses import multi_similarity
from circle_jax.losses import ranked_list


def circle_loss_blockwise(embeddings, labels, *, block_size: int, **kwargs):
  """:func:`circle_jax.losses.circle_loss` with a required ``block_size``."""
  return circle.circle_loss(embeddings, labels, block_size=block_size,
                            **kwargs)


def multi_similarity_loss_blockwise(embeddings, labels, *, block_size: int,
                                    **kwargs):
  """:func:`circle_jax.losses.multi_similarity_loss` with a required
  ``block_size``."""
  return multi_similarity.multi_similarity_loss(
      embeddings, labels, block_size=block_size, **kwargs)


def ranked_list_loss_blockwise(embeddings, labels, *, block_size: int,
                               **kwargs):
  """:func:`circle_jax.losses.ranked_list_loss` with a required
  ``block_size``."""
  return ranked_list.ranked_list_loss(embeddings, labels,
                                      block_size=block_size, **kwargs)
