"""experiments/bench/hier.py at tiny shapes: its measurement and its row."""

import sys

from experiments.bench import hier as hier_bench


def test_measure_times_the_program_and_reads_its_cost():
  r = hier_bench.measure(8, 4, 6, 3, repeats=2)
  assert set(r) == {"ms", "gflop", "gb", "mtrans"}
  assert r["ms"] > 0 and r["gb"] > 0 and r["mtrans"] > 0


def test_main_prints_the_setting_and_one_row(monkeypatch, capsys):
  monkeypatch.setattr(sys, "argv", [
      "hier", "--batch", "8", "--dim", "4", "--proxies", "6", "--triplets",
      "3", "--repeats", "1"])
  hier_bench.main()
  out = capsys.readouterr().out
  assert "batch 8, 4-d, 6 proxies, 3 triplets per anchor" in out
  row = out.strip().splitlines()[-1]
  ms, gflop, gb, mtrans = (float(v) for v in row.strip("|").split("|"))
  assert ms > 0 and min(gflop, gb, mtrans) >= 0
