"""Shared cases of the engine tests: a labelled batch, a rule of every
kind, each rule's public embedding form, and their block and masks."""


import jax.numpy as jnp
import numpy as np

import circle_jax.losses as losses
from circle_jax.losses import engine
from circle_jax.losses.circle import Circle, Unified
from circle_jax.losses.multi_similarity import MultiSimilarity
from circle_jax.losses.contrastive import Contrastive
from circle_jax.losses.ranked_list import RankedList
from circle_jax.losses.triplet import BatchHard

# Label 9 is a singleton (no positives); 16 samples, 8 devices x 2.
LABELS = np.array([0, 1, 2, 0, 1, 2, 3, 3, 0, 1, 2, 3, 9, 0, 1, 2], np.int32)
B = len(LABELS)

RULES = {
    "circle": Circle(),
    "circle_m": Circle(margin=0.25, gamma=32.0),
    "unified": Unified(gamma=16.0),
    "ms": MultiSimilarity(),
    "ms_no_mining": MultiSimilarity(mining=False, beta=20.0),
    "rll": RankedList(),
    "rll_t_pos": RankedList(t_pos=3.0, t_neg=4.0, imbalance=0.3),
    "contrastive": Contrastive(pos_margin=0.3, neg_margin=1.2),
    "triplet_batch_hard": BatchHard(margin=0.3),
}

# The public embedding form of each rule (all take block_size).
PUBLIC = {
    "circle": (losses.circle_loss, {}),
    "circle_m": (losses.circle_loss, dict(margin=0.25, gamma=32.0)),
    "unified": (losses.unified_loss, dict(gamma=16.0)),
    "ms": (losses.multi_similarity_loss, {}),
    "ms_no_mining": (losses.multi_similarity_loss,
                     dict(mining=False, beta=20.0)),
    "rll": (losses.ranked_list_loss, {}),
    "rll_t_pos": (losses.ranked_list_loss,
                  dict(t_pos=3.0, t_neg=4.0, imbalance=0.3)),
    "contrastive": (losses.contrastive_loss,
                    dict(pos_margin=0.3, neg_margin=1.2)),
    "triplet_batch_hard": (losses.triplet_margin_loss,
                           dict(margin=0.3, mining="batch_hard")),
}


def embeddings(seed=0, dim=6):
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(10, dim))
  return (centres[LABELS] + 0.9 * rng.normal(size=(B, dim))).astype(np.float32)


def block():
  x = embeddings()
  _, _, s, pos, neg = engine.pair_block(jnp.asarray(x), jnp.asarray(LABELS))
  return s, pos, neg


def miner_masks():
  rng = np.random.default_rng(3)
  return (jnp.asarray(rng.random((B, B)) < 0.7),
          jnp.asarray(rng.random((B, B)) < 0.7))


# ----------------------------------------------------------------------------
# Derived dL/dS == autodiff of the dense engine.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# Dense == blockwise through the public losses.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# global_sum.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# A third engine from the tile-level pieces.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# Each default once.
# ----------------------------------------------------------------------------
