"""Fixtures of the loss tests: the hand-computed tiny case of the pair
baselines (three points on the unit circle), evaluated once, and their cases
against the float64 references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from circle_jax.losses import miners
from tests.losses.engine.cases import pair_batch
from tests.losses.reference import (contrastive_ref, lifted_ref_ordered,
                                    lifted_ref_paper, margin_ref, n_pair_ref,
                                    triplet_ref)


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


# ----------------------------------------------------------------------------
# The pair baselines against the float64 references, with and without miner
# masks: every case in one compiled program, shared by their test files.
# ----------------------------------------------------------------------------

PAIR_X, PAIR_Y = pair_batch(1)
_RNG = np.random.default_rng(2)
PAIR_PM, PAIR_NM = _RNG.random((16, 16)) < 0.6, _RNG.random((16, 16)) < 0.6
PAIR_BETA = np.linspace(0.8, 1.4, 7).astype(np.float32)
PAIR_DW_KEY = jax.random.PRNGKey(3)
_PM, _NM, _BETA = PAIR_PM, PAIR_NM, PAIR_BETA

# name -> (loss(x, y, **kw) under jit, float64 reference(x, y)).
PAIR_CASES = {
    "contrastive": (
        functools.partial(losses.contrastive_loss, pos_margin=0.6,
                          neg_margin=1.2),
        lambda x, y: contrastive_ref(x, y, 0.6, 1.2)),
    "contrastive_masked": (
        functools.partial(losses.contrastive_loss, pos_margin=0.6,
                          neg_margin=1.2, pos_mask=_PM, neg_mask=_NM),
        lambda x, y: contrastive_ref(x, y, 0.6, 1.2, _PM, _NM)),
    **{f"triplet_{m}{suffix}": (
        functools.partial(losses.triplet_margin_loss, margin=0.3, mining=m,
                          **masks),
        functools.partial(triplet_ref, margin=0.3, mining=m, **masks))
       for m in ("all", "batch_hard", "semi_hard")
       for suffix, masks in (("", {}),
                             ("_masked", {"pos_mask": _PM,
                                          "neg_mask": _NM}))},
    "lifted": (functools.partial(losses.lifted_structure_loss, margin=1.0),
               lambda x, y: lifted_ref_paper(x, y, 1.0)),
    "lifted_masked": (
        functools.partial(losses.lifted_structure_loss, margin=0.7,
                          pos_mask=_PM, neg_mask=_NM),
        lambda x, y: lifted_ref_ordered(x, y, 0.7, _PM, _NM)),
    "n_pair": (functools.partial(losses.n_pair_loss, l2_reg=0.1),
               lambda x, y: n_pair_ref(x, y, 0.1)),
    "n_pair_masked": (
        functools.partial(losses.n_pair_loss, l2_reg=0.1, pos_mask=_PM,
                          neg_mask=_NM),
        lambda x, y: n_pair_ref(x, y, 0.1, _PM, _NM)),
    "margin": (
        lambda x, y: losses.margin_loss(x, y, _BETA, margin=0.2, nu=0.1),
        lambda x, y: margin_ref(x, y, _BETA, 0.2, 0.1)),
    "margin_scalar_beta": (
        lambda x, y: losses.margin_loss(x, y, 1.1, margin=0.2, nu=0.1),
        lambda x, y: margin_ref(x, y, 1.1, 0.2, 0.1)),
    "margin_masked": (
        lambda x, y: losses.margin_loss(x, y, _BETA, pos_mask=_PM,
                                        neg_mask=_NM),
        lambda x, y: margin_ref(x, y, _BETA, 0.2, 0.0, pos_mask=_PM,
                                neg_mask=_NM)),
}


@pytest.fixture(scope="session")
def case_values():
  """Every case of ``PAIR_CASES`` plus the sampler's weights: one program."""
  @jax.jit
  def run(x, y):
    out = {name: fn(x, y) for name, (fn, _) in PAIR_CASES.items()}
    out["dw_weights"] = miners.distance_weighted_miner(x, y, PAIR_DW_KEY)
    out["margin_dw"] = losses.margin_loss(x, y, _BETA, key=PAIR_DW_KEY,
                                          nu=0.05)
    out["margin_dw_weights"] = losses.margin_loss(
        x, y, _BETA, nu=0.05, pair_weights=out["dw_weights"])
    return out
  return jax.tree.map(np.asarray, run(PAIR_X, PAIR_Y))


def check_pair_case(case_values, name):
  """The ``PAIR_CASES`` case ``name`` equals its float64 reference."""
  want = PAIR_CASES[name][1](PAIR_X, PAIR_Y)
  assert want > 0
  np.testing.assert_allclose(float(case_values[name]), want, rtol=2e-5)
