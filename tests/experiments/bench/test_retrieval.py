"""Smoke tests of the retrieval and matmul benchmark scripts."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments.bench import matmul as bench_matmul
from experiments.bench import retrieval as bench_retrieval

# Slow (whole jobs or benchmarks): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

_REPO = str(pathlib.Path(__file__).resolve().parents[3])


def test_bench_retrieval_writes_a_table_with_the_matmul_floor(tmp_path):
  out = tmp_path / "bench.md"
  env = dict(os.environ, CIRCLE_JAX_NO_HUGEPAGES="1")
  env.pop("XLA_FLAGS", None)  # one CPU device, as in a real run
  subprocess.run(
      [sys.executable, "-m", "experiments.bench.retrieval",
       "--datasets", "inshop", "--scale", "0.02", "--dim", "16",
       "--repeats", "1", "--output", str(out)],
      cwd=_REPO, check=True, env=env, capture_output=True, text=True,
      timeout=600)
  text = out.read_text()
  assert "malloc: default" in text
  ours = [l for l in text.splitlines() if "| ours |" in l]
  assert len(ours) == 1 and "bare tile matmuls alone:" in ours[0]
  cells = [c.strip() for c in ours[0].strip("|").split("|")]
  assert float(cells[2]) > 0  # first-call wall s
  faiss = [l for l in text.splitlines() if "| faiss |" in l]
  if faiss:  # faiss-cpu installed: both give the same metrics
    assert "max |metric diff| vs circle_jax 0.0e+00" in faiss[0]


def test_matmul_floor_times_every_chunk_and_tile():
  rng = np.random.default_rng(0)
  q = rng.standard_normal((20, 8), np.float32)
  g = rng.standard_normal((30, 8), np.float32)
  assert bench_retrieval._matmul_floor(q, g, chunk_size=8, repeats=2) > 0
  assert bench_retrieval._matmul_floor(q, None, chunk_size=64, repeats=1) > 0


def test_time_matmul_reports_min_below_median():
  for dtype in ("float32", "bfloat16"):
    lo, med = bench_matmul.time_matmul(16, 8, 24, dtype, repeats=3)
    assert 0 < lo <= med
