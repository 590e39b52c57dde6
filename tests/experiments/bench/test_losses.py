"""Smoke test of the loss benchmark script."""

import pytest

from experiments.bench import losses as bench_losses

# Slow (a benchmark script run): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


def test_bench_losses_writes_a_table_with_the_floor_ratio(tmp_path):
  out = tmp_path / "bench.md"
  bench_losses.main([
      "--losses", "circle,proxy_anchor", "--batch-sizes", "16",
      "--dtypes", "float32", "--no-torch", "--warmup", "1", "--repeats", "1",
      "--out", str(out)])
  text = out.read_text()
  assert "malloc:" in text
  rows = [l for l in text.splitlines() if l.startswith("| circle |")
          or l.startswith("| proxy_anchor |")]
  assert len(rows) == 2
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[4]) > 0  # fwd+bwd ms
    assert float(cells[9]) > 0  # ratio to the floor
