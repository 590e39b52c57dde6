"""Smoke test of experiments/bench/sharded_classes.py (tiny shapes)."""

import pytest

from experiments.bench import sharded_classes as bench

# Slow (a benchmark script run): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


def test_sharding_the_class_rows_shrinks_the_per_device_step():
  c, dim, batch = 4096, 64, 32
  peak = {m: bench.measure(m, c, dim, batch)["peak"] for m in bench.MODES}
  # Class rows + Adam moments: replicated holds all, sharded an eighth.
  assert peak["sharded"] < peak["replicated"] / 3
  assert peak["sharded_r0.1"] < peak["sharded"]


def test_largest_fitting_solves_the_affine_peak():
  assert bench.largest_fitting([(10, 110), (20, 210)], 1010) == 100
