"""Tests of the N-pair loss (circle_jax/losses/n_pair.py); the checks shared by the pair baselines are in test_pair_baselines.py."""


import numpy as np

from circle_jax import losses
from tests.losses.test_pair_baselines import jitted


def test_n_pair_with_pair_layout_masks_is_sohn():
  # N pairs of N classes laid out [anchors; positives]: Sohn's eq. 6, where
  # anchor i's negatives are the other classes' positives.
  n, d = 5, 4
  rng = np.random.default_rng(9)
  f_a = rng.normal(size=(n, d))
  f_p = rng.normal(size=(n, d))
  x = np.concatenate([f_a, f_p]).astype(np.float32)
  y = np.concatenate([np.arange(n), np.arange(n)])
  pm = np.zeros((2 * n, 2 * n), bool)
  nm = np.zeros((2 * n, 2 * n), bool)
  for i in range(n):
    pm[i, n + i] = True
    nm[i, n:] = True
  sohn = np.mean([np.log1p(sum(np.exp(f_a[i] @ f_p[j] - f_a[i] @ f_p[i])
                               for j in range(n) if j != i))
                  for i in range(n)])
  got = jitted(losses.n_pair_loss)(x, y, l2_reg=0.0, pos_mask=pm, neg_mask=nm)
  np.testing.assert_allclose(float(got), sohn, rtol=1e-5)
