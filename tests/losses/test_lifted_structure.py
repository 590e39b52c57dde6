"""Tests of the lifted structure loss (circle_jax/losses/lifted_structure.py); the checks shared by the pair baselines are in test_pair_baselines.py."""


import numpy as np
from tests.losses.conftest import DPN, S2



def test_lifted_hand_computed(tiny):
  # One unordered positive pair (a, p): N_a = {n}, N_p = {n}.
  j = np.log(np.exp(1.0 - S2) + np.exp(1.0 - DPN)) + 1.0
  np.testing.assert_allclose(tiny["lifted"], j**2 / 2, rtol=1e-5)
