"""Tests of the margin loss (circle_jax/losses/margin.py); the checks shared by
the pair baselines are in engine/test_dispatch.py."""


import numpy as np
import pytest

from circle_jax import losses
from tests.losses.conftest import (DPN, PAIR_BETA, PAIR_DW_KEY, PAIR_X,
                                   PAIR_Y, S2, check_pair_case)
from tests.losses.reference import margin_ref



def test_margin_hand_computed(tiny):
  # positives (a,p),(p,a), beta_0=0.9: [1 - 0.9 + 0.2] = 0.3 each, reg 0.45.
  # negatives: (a,n) beta 0.9: [0.9 - sqrt2 + .2]_+ = 0; (p,n): 1.1 - d_pn;
  # (n,a) beta 1.3: 1.5 - sqrt2; (n,p): 1.5 - d_pn.
  terms = [0.3, 0.3, 1.1 - DPN, 1.5 - S2, 1.5 - DPN]
  want = (sum(terms) + 2 * 0.5 * 0.9) / len(terms)
  np.testing.assert_allclose(tiny["margin"], want, rtol=1e-5)


def test_reductions_of_its_pair_terms_equal_the_loops():
  """``reduction`` on the margin loss's pairs (PML's element is the
  triplet, so the loops are the reference), with a per-class ``beta`` and
  ``nu``, each set reduced on its own; ``"none"`` the ``[B, B]`` terms."""
  from circle_jax import losses
  from tests.losses import pml_checks
  from tests.losses import reference
  x, y = pml_checks.batch(9, n=12), np.array([0, 1, 2, 3] * 3)
  beta = np.linspace(0.9, 1.3, 4)
  pml_checks.reductions_equal_reference(
      lambda x, y, **kw: losses.margin_loss(
          x, y, np.asarray(beta, np.float32), margin=0.3, nu=0.1, **kw),
      reference.margin_terms_ref(x, y, beta, 0.3, 0.1), x, y,
      sets_of=lambda x: reference.margin_terms_ref(x, y, beta, 0.3, 0.1))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["margin", "margin_masked", "margin_scalar_beta"])
def test_matches_float64_reference(case_values, name):
  check_pair_case(case_values, name)


@pytest.mark.slow
def test_margin_with_key_equals_weighted_form_of_the_sampler(case_values):
  w = case_values["dw_weights"]
  assert w.max() >= 1 and np.all(w == np.round(w))
  np.testing.assert_allclose(
      float(case_values["margin_dw"]),
      margin_ref(PAIR_X, PAIR_Y, PAIR_BETA, 0.2, 0.05, weights=w), rtol=2e-5)
  np.testing.assert_allclose(float(case_values["margin_dw_weights"]),
                             float(case_values["margin_dw"]), rtol=1e-6)
  with pytest.raises(ValueError, match="not both"):
    losses.margin_loss(PAIR_X, PAIR_Y, PAIR_BETA, key=PAIR_DW_KEY,
                       pair_weights=w)
