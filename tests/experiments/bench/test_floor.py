"""experiments/bench/floor.py: the matmul floor of the loss benchmarks."""

import numpy as np

from experiments.bench import floor


def test_floor_is_half_the_squared_similarities_and_their_gradient():
  # Hand-computed: X = [[1, 2]], Y = [[3, 0], [0, 1]] -> S = X Y^T = [[3, 2]],
  # f = (9 + 4) / 2 = 6.5, dX = S Y = [[9, 2]], dY = S^T X = [[3, 6], [2, 4]].
  x = np.array([[1.0, 2.0]], np.float32)
  y = np.array([[3.0, 0.0], [0.0, 1.0]], np.float32)
  value, (dx, dy) = floor.FLOOR(x, y)
  assert float(value) == 6.5
  np.testing.assert_array_equal(dx, [[9.0, 2.0]])
  np.testing.assert_array_equal(dy, [[3.0, 6.0], [2.0, 4.0]])
