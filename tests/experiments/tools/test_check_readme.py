"""The README's main job, run as written, reproduces the README's figures."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from experiments.tools import check_readme

# Slow (whole jobs or benchmarks): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

REPO = str(pathlib.Path(__file__).resolve().parents[3])


def _readme():
  with open(os.path.join(REPO, "README.md")) as f:
    return f.read()


def _seeds():
  with open(check_readme.SEEDS_TABLE) as f:
    return check_readme.seed_stats(f.read())


def test_readme_table_parses():
  figures = check_readme.readme_figures(_readme())
  assert set(figures) == {(c, m) for c in ("init", "final")
                          for m in ("recall@1", "map@r", "nmi")}
  assert check_readme.readme_final_step(_readme()) == 150
  assert set(check_readme.readme_seeds(_readme())) == {"recall@1", "map@r",
                                                       "nmi"}


def test_seed_stats_reads_the_circle_row_of_the_comparison_table():
  table = ("| loss | runs | P@1 | R@1 | MAP@R | NMI |\n"
           "| --- | ---: | ---: | ---: | ---: | ---: |\n"
           "| `circle_class_level` | 3 | 1.0 ± 1.0 | 2.0 ± 1.0 | 3.0 ± 1.0 "
           "| 4.0 ± 1.0 |\n"
           "| `circle` | 3 | 50.0 ± 5.0 | **55.2 ± 5.9** | 22.7 ± 4.1 "
           "| 26.8 ± 4.4 |\n")
  got = check_readme.seed_stats(table)
  np.testing.assert_allclose([got["recall@1"], got["map@r"], got["nmi"]],
                             [(0.552, 0.059), (0.227, 0.041), (0.268, 0.044)])
  with pytest.raises(ValueError, match="no row for `margin`"):
    check_readme.seed_stats(table, "margin")
  with pytest.raises(ValueError, match="not 'mean ± std'"):
    check_readme.seed_stats(table.replace("22.7 ± 4.1", "22.7"))


def test_readme_seed_column_is_the_comparison_tables():
  seeds = _seeds()
  for key, (mean, std) in check_readme.readme_seeds(_readme()).items():
    assert mean == pytest.approx(round(seeds[key][0], 2))
    assert std == pytest.approx(round(seeds[key][1], 2))
  assert all(std > 0.02 for _, std in seeds.values())


def _metrics(final):
  figures = check_readme.readme_figures(_readme())
  metrics = {"step": 150, "init": {}, "final": {}}
  for (col, key), v in figures.items():
    metrics[col][key] = v + 0.004        # rounds to the README's value
  metrics["final"].update(final)
  return metrics


def test_compare_accepts_another_cpus_rounding_and_flags_the_rest():
  text, seeds = _readme(), _seeds()
  assert check_readme.compare(text, _metrics({}), seeds=seeds) == []
  # The other CPU generation's column: an AMD EPYC Zen 3 (AVX2).
  zen3 = {"recall@1": 0.6641, "map@r": 0.2983, "nmi": 0.3831}
  assert check_readme.readme_other_finals(text) == {
      "recall@1": [0.66], "map@r": [0.30], "nmi": [0.38]}
  assert check_readme.compare(text, _metrics(zen3)) == []
  # A third CPU within the seed spread (the Xeon's step-75 figures).
  other = {"recall@1": 0.6071, "map@r": 0.2679, "nmi": 0.3230}
  assert check_readme.compare(text, _metrics(other), seeds=seeds) == []
  # Without the seed spread, only rounding is allowed.
  assert len(check_readme.compare(text, _metrics(other))) == 3
  # A job that stops learning stays near its init: flagged.
  broken = _metrics({k: v for (c, k), v in
                     check_readme.readme_figures(text).items() if c == "init"})
  broken["init"]["map@r"] += 0.02
  broken["step"] = 120
  bad = check_readme.compare(text, broken, seeds=seeds)
  assert "final step" in bad[0] and len(bad) == 5
  assert any(b.startswith("init map@r") for b in bad)
  # A stale seeds column.
  stale = dict(seeds, nmi=(seeds["nmi"][0] + 0.05, seeds["nmi"][1]))
  bad = check_readme.compare(text, _metrics({}), seeds=stale)
  assert len(bad) == 1 and bad[0].startswith("seeds nmi")


def test_readme_main_job_reproduces_its_figures(tmp_path):
  """Runs the README's digits command (fresh workdir and data) and checks."""
  text = _readme()
  cmd = re.search(r"^(python -m experiments\.main --config "
                  r"experiments/configs/digits\.py --workdir \S+)$", text,
                  re.M).group(1)
  args = shlex.split(cmd)
  args[args.index("--workdir") + 1] = str(tmp_path / "run")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             TFDS_DATA_DIR=str(tmp_path / "tfds"),
             PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable] + args[1:], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The console: the result table on stdout, no library logs on stderr.
  assert proc.stdout.startswith("digits / conv4 / circle: test-split metrics")
  assert re.search(r"^num_queries +896 +896 +896$", proc.stdout, re.M)
  assert "checkpoint_manager" not in proc.stderr
  assert not re.search(r"^I\d{4} ", proc.stderr, re.M)
  with open(tmp_path / "run" / "metrics.json") as f:
    metrics = json.load(f)
  assert check_readme.compare(text, metrics, seeds=_seeds()) == [], (
      proc.stdout)
  assert check_readme.main(["--metrics", str(tmp_path / "run" /
                                             "metrics.json")]) == 0
