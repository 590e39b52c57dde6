"""Smoke test of experiments/bench/max_pool.py (tiny shapes)."""

import pytest
import os
import pathlib
import subprocess
import sys

# Slow (whole jobs or benchmarks): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

REPO = str(pathlib.Path(__file__).resolve().parents[3])


def test_bench_max_pool_prints_a_row_per_pool_and_conv4():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             CIRCLE_JAX_NO_HUGEPAGES="1")
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.bench.max_pool", "--batch", "2",
       "--size", "16", "--width", "4", "--repeats", "1"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  rows = [l for l in proc.stdout.splitlines() if l.startswith("| pool of")]
  assert [r.split("|")[1].strip() for r in rows] == [
      "pool of [2, 16, 16, 4]", "pool of [2, 8, 8, 4]", "pool of [2, 4, 4, 4]",
      "pool of [2, 2, 2, 4]"]
  assert "| conv4 (4 blocks) |" in proc.stdout
