"""Tests of the contrastive loss (circle_jax/losses/contrastive.py); the checks
shared by the pair baselines are in engine/test_dispatch.py."""


import jax
import numpy as np
import pytest

from circle_jax import losses
from tests.losses.conftest import DPN
from tests.losses.reference import dist64
from tests.losses.conftest import check_pair_case
from tests.losses.engine.cases import pair_batch


def test_contrastive_hand_computed(tiny):
  # positives: (a,p),(p,a): 1-0.5 = 0.5 each. negatives (a,n),(n,a): sqrt2 > 1
  # -> 0; (p,n),(n,p): 1 - d_pn. Means over non-zero terms.
  np.testing.assert_allclose(tiny["contrastive"], 0.5 + (1 - DPN), rtol=1e-5)


def test_general_pair_weighting_of_contrastive_is_the_hinge_indicator():
  # dL/dD_ij = +1/#active positives on active positive pairs, -1/#active
  # negatives on active negative pairs, 0 elsewhere.
  x, y = pair_batch(14)
  d = dist64(x).astype(np.float32)
  w_pos, w_neg = jax.jit(lambda d, y: losses.pair_weights(
      losses.contrastive_loss_from_distance, d, y, pos_margin=0.5,
      neg_margin=1.0))(d, y)
  same = y[:, None] == y[None, :]
  pos, neg = same & ~np.eye(16, dtype=bool), ~same
  act_p, act_n = pos & (d > 0.5), neg & (d < 1.0)
  assert act_p.any() and act_n.any() and (neg & ~act_n).any()
  np.testing.assert_allclose(np.asarray(w_pos), act_p / act_p.sum(),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(w_neg), act_n / act_n.sum(),
                             rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["contrastive", "contrastive_masked"])
def test_matches_float64_reference(case_values, name):
  check_pair_case(case_values, name)
