"""The README's main job, run as written, reproduces the README's figures."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from experiments import check_readme

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def _readme():
  with open(os.path.join(REPO, "README.md")) as f:
    return f.read()


def test_readme_table_parses():
  figures = check_readme.readme_figures(_readme())
  assert set(figures) == {(c, m) for c in ("init", "final")
                          for m in ("recall@1", "map@r", "nmi")}
  assert check_readme.readme_final_step(_readme()) == 150


def test_compare_flags_every_mismatch():
  text = _readme()
  figures = check_readme.readme_figures(text)
  metrics = {"step": 150, "init": {}, "final": {}}
  for (col, key), v in figures.items():
    metrics[col][key] = v + 0.004        # rounds to the README's value
  assert check_readme.compare(text, metrics) == []
  metrics["final"]["map@r"] += 0.02
  metrics["step"] = 120
  bad = check_readme.compare(text, metrics)
  assert len(bad) == 2 and "final step" in bad[0] and "final map@r" in bad[1]


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
  assert check_readme.compare(text, metrics) == [], proc.stdout
  assert check_readme.main(["--metrics", str(tmp_path / "run" /
                                             "metrics.json")]) == 0
