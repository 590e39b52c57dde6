"""Specification of circle_jax/analysis/pair_plane.py: one pair per loss.

The decision boundaries of Sun et al., "Circle Loss: A Unified Perspective of
Pair Similarity Optimization", CVPR 2020, Fig. 1, traced from the package's
losses: the line ``s_p = s_n + m`` for the ``(s_n - s_p)`` losses, the circle
of radius ``sqrt(2) m`` around ``(0, 1)`` for Circle loss; and the loss of one
pair equal to its closed form (float64 numpy).
"""

import math

import numpy as np
import pytest

from circle_jax.analysis import pair_plane

# The bisection reaches float32 resolution (measured max 1.8e-7).
TOLERANCE = 1e-5


@pytest.mark.parametrize("kind", ["triplet", "cosface", "unified", "circle"])
def test_traced_boundary_is_the_line_or_the_circle(kind):
  margin = 0.3
  pts = pair_plane.trace_boundary(pair_plane.pair_loss(kind, margin=margin),
                                  num_rays=31)
  crossing = pts[np.isfinite(pts[:, 0])]
  assert len(crossing) >= 10
  residual = (pair_plane.circle_residual if kind == "circle"
              else pair_plane.line_residual)(crossing, margin)
  assert np.max(np.abs(residual)) < TOLERANCE


def test_the_boundary_does_not_depend_on_gamma():
  for kind in ("circle", "unified", "cosface"):
    a = pair_plane.trace_boundary(
        pair_plane.pair_loss(kind, margin=0.3, gamma=16.0))
    b = pair_plane.trace_boundary(
        pair_plane.pair_loss(kind, margin=0.3, gamma=256.0))
    np.testing.assert_allclose(a, b, atol=TOLERANCE, err_msg=kind)


def test_one_pair_losses_are_their_closed_forms():
  s_n = np.array([0.1, 0.5, 0.8, 0.3])
  s_p = np.array([0.9, 0.5, 0.8, 0.2])
  m, gamma = 0.25, 4.0
  softplus = lambda x: np.logaddexp(0.0, x)
  want = {
      "triplet": np.maximum(s_n - s_p + m, 0.0),
      "unified": softplus(gamma * (s_n - s_p + m)),
      # Circle (eq. 6 with O_p = 1 + m, O_n = -m, Delta_p = 1 - m,
      # Delta_n = m): alpha_p = [1 + m - s_p]_+, alpha_n = [s_n + m]_+.
      "circle": softplus(gamma * (np.maximum(s_n + m, 0) * (s_n - m)
                                  - np.maximum(1 + m - s_p, 0)
                                  * (s_p - 1 + m))),
      # AM-Softmax with two classes: cosines s_p (true) and s_n.
      "cosface": softplus(gamma * (s_n - s_p + m)),
  }
  for kind, value in want.items():
    loss = pair_plane.pair_loss(kind, margin=m, gamma=gamma)
    np.testing.assert_allclose(pair_plane.pair_values(loss, s_n, s_p), value,
                               rtol=2e-5, atol=2e-6, err_msg=kind)
  assert pair_plane.pair_loss("circle", margin=m).level == math.log(2.0)
  with pytest.raises(ValueError, match="Unknown pair loss"):
    pair_plane.pair_loss("arcface", margin=m)
