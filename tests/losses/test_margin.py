"""Tests of the margin loss (circle_jax/losses/margin.py); the checks shared by the pair baselines are in test_pair_baselines.py."""


import numpy as np
from tests.losses.conftest import DPN, S2



def test_margin_hand_computed(tiny):
  # positives (a,p),(p,a), beta_0=0.9: [1 - 0.9 + 0.2] = 0.3 each, reg 0.45.
  # negatives: (a,n) beta 0.9: [0.9 - sqrt2 + .2]_+ = 0; (p,n): 1.1 - d_pn;
  # (n,a) beta 1.3: 1.5 - sqrt2; (n,p): 1.5 - d_pn.
  terms = [0.3, 0.3, 1.1 - DPN, 1.5 - S2, 1.5 - DPN]
  want = (sum(terms) + 2 * 0.5 * 0.9) / len(terms)
  np.testing.assert_allclose(tiny["margin"], want, rtol=1e-5)
