"""Tests of the supervised contrastive loss (circle_jax/losses/supcon.py); the
checks it shares with NT-Xent, pairwise CE and the pairwise sigmoid (engines,
geometries, float64 references) are in test_contrastive_family.py."""

import numpy as np

from circle_jax import losses


def test_supcon_hand_computed_on_three_points():
  """Three unit vectors at 0, 60 and 90 degrees, labels (0, 0, 1), tau = 1:
  L_out of anchors 0 and 1 (anchor 2 has no positive and is left out):
  ``log(e^0.5 + e^0) - 0.5`` and ``log(e^0.5 + e^cos30) - 0.5``."""
  x = np.array([[1.0, 0.0], [0.5, np.sqrt(3) / 2], [0.0, 1.0]], np.float32)
  y = np.array([0, 0, 1])
  want = np.mean([np.log(np.exp(0.5) + 1.0) - 0.5,
                  np.log(np.exp(0.5) + np.exp(np.sqrt(3) / 2)) - 0.5])
  np.testing.assert_allclose(float(losses.supcon_loss(x, y, tau=1.0)), want,
                             rtol=1e-6)
  # The temperature divides every similarity: tau = 0.5 doubles them.
  want_half = np.mean([np.log(np.exp(1.0) + 1.0) - 1.0,
                       np.log(np.exp(1.0) + np.exp(np.sqrt(3))) - 1.0])
  np.testing.assert_allclose(float(losses.supcon_loss(x, y, tau=0.5)),
                             want_half, rtol=1e-6)
