"""Smoke test of the SupCon / NT-Xent benchmark against the peer library."""

import numpy as np
import pytest

from experiments.bench import contrastive as bench_contrastive

# Slow (a benchmark script run): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


def test_bench_contrastive_writes_every_table(tmp_path):
  out = tmp_path / "contrastive.md"
  bench_contrastive.main([
      "--batch-sizes", "32", "--dims", "16", "--no-peer", "--repeats", "1",
      "--large-batches", "256", "--ring-batch", "512", "--block-size", "64",
      "--large-dim", "16", "--run-max", "256", "--record", "--out", str(out)])
  text = out.read_text()
  rows = [l for l in text.splitlines() if l.startswith(("| supcon |",
                                                        "| nt_xent |"))]
  assert len(rows) == 2
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[4]) > 0 and float(cells[5]) > 0  # ours ms, / floor
  big = [l for l in text.splitlines() if l.startswith(("| blockwise |",
                                                       "| ring |"))]
  assert [l.split("|")[3].strip() for l in big] == ["256", "512"]
  assert all(float(l.split("|")[6]) > 0 for l in big)  # peak MiB
  assert float(big[0].split("|")[8]) > 0  # B <= --run-max: one step timed


def test_the_peer_child_matches_our_loss():
  pytest.importorskip("pytorch_metric_learning")
  for loss in bench_contrastive.LOSSES:
    r = bench_contrastive.peer_child(loss, loss, 32, 8, 4, [1, 2], 1)
    x = bench_contrastive.jnp.asarray(bench_contrastive.embeddings(32, 8))
    labels = bench_contrastive.jnp.asarray(
        bench_contrastive.labels_for(loss, 32, 4))
    compiled, peak = bench_contrastive.compile_ours(loss, x, labels)
    ours = float(compiled(x, labels)[0])
    assert peak > 0
    np.testing.assert_allclose(r["value"], ours, rtol=1e-5)
    assert r["seconds"] == min(r["by_threads"].values()) > 0


def test_the_out_of_memory_batch_solves_the_fit():
  measured = {1024: 1.0 + 2.0 * 1024**2, 4096: 1.0 + 2.0 * 4096**2}
  b = bench_contrastive.batch_at(measured, 2, 1.0 + 2.0 * 10000**2)
  assert b == pytest.approx(10000, rel=1e-6)
  assert bench_contrastive.predicted_peak(measured, 8192, 2) == pytest.approx(
      measured[4096] * 4)


def test_the_peer_is_never_run_where_it_would_need_gigabytes():
  # NTXentLoss asks 68.7 GB for its pair matrix at B = 4096 (two views).
  assert bench_contrastive.least_peak("nt_xent", 4096) > 68e9
  assert bench_contrastive.least_peak("supcon", 4096) == 4 * 4096**2
