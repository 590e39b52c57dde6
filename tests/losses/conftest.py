"""Fixtures of the loss tests: the hand-computed tiny case of the pair
baselines (three points on the unit circle), evaluated once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses


# Three points on the unit circle: a and p at 0 and 60 degrees (same class),
# n at 90 degrees. Distances: d(a,p)=1, d(a,n)=sqrt(2), d(p,n)=2 sin(15deg).
TINY_X = np.array([[1.0, 0.0], [0.5, np.sqrt(3) / 2], [0.0, 1.0]],
                  np.float32)
TINY_Y = np.array([0, 0, 1])
S2 = np.sqrt(2.0)
DPN = 2 * np.sin(np.pi / 12)


@pytest.fixture(scope="session")
def tiny():
  """Every hand-computed case, in one compiled program."""
  @jax.jit
  def run(x, y):
    return {
        "contrastive": losses.contrastive_loss(x, y, pos_margin=0.5,
                                               neg_margin=1.0),
        **{f"triplet_{m}": losses.triplet_margin_loss(x, y, margin=1.0,
                                                      mining=m)
           for m in ("all", "batch_hard", "semi_hard")},
        "lifted": losses.lifted_structure_loss(x, y, margin=1.0),
        "margin": losses.margin_loss(x, y, jnp.array([0.9, 1.3]), margin=0.2,
                                     nu=0.5),
    }
  return {k: float(v) for k, v in run(TINY_X, TINY_Y).items()}
