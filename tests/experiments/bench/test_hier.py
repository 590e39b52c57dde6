"""Smoke test of experiments/bench/hier.py (tiny shapes)."""

import os
import pathlib
import subprocess
import sys

import pytest

# Slow (whole jobs or benchmarks): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

REPO = str(pathlib.Path(__file__).resolve().parents[3])


def test_bench_hier_prints_its_time_and_cost_row():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             CIRCLE_JAX_NO_HUGEPAGES="1")
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.bench.hier", "--batch", "8",
       "--dim", "4", "--proxies", "6", "--triplets", "3", "--repeats", "2"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert "8, 4-d, 6 proxies, 3 triplets per anchor" in proc.stdout
  row = proc.stdout.strip().splitlines()[-1]
  ms, gflop, gb, mtrans = (float(v) for v in row.strip("|").split("|"))
  assert ms > 0 and min(gflop, gb, mtrans) >= 0
