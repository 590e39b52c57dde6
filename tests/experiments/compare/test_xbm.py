"""experiments/compare/xbm.py: its runs and its effect table (no training)."""

import argparse

from circle_jax.results import aggregate
from experiments.compare import xbm as xbm_study


def test_runs_are_the_comparison_protocol_plus_the_memory(tmp_path):
  args = argparse.Namespace(losses="circle,contrastive", sizes="0,512",
                            seeds="2", start_step=100, workdir=str(tmp_path))
  runs = xbm_study.build_runs(args)
  assert [(r.loss, r.seed) for r in runs[:3]] == [
      ("circle, M=0", 0), ("circle, M=0", 1), ("circle, M=512", 0)]
  assert len(runs) == 8
  run = runs[2]
  assert run.config["xbm"] == {"size": 512, "start_step": 100, "weight": 1.0,
                               "dtype": "float32"}
  assert (run.config["num_train_steps"], run.config["eval_every_steps"],
          run.config["dataset"]["validation_fraction"]) == (800, 200, 0.2)
  assert run.config["loss"]["name"] == "circle"
  assert run.workdir == str(tmp_path / "xbm_512" / "circle" / "seed_0")
  assert "--config.xbm.size=512" in run.command


def test_effect_is_the_difference_of_the_means():
  summary = {
      "circle, M=0": {"recall@1": aggregate([0.60, 0.62]),
                      "map@r": aggregate([0.30, 0.30])},
      "circle, M=512": {"recall@1": aggregate([0.65, 0.67]),
                        "map@r": aggregate([0.29, 0.29])},
  }
  lines = xbm_study.effect_lines(summary, ["circle"], [0, 512])
  assert lines[2] == "| `circle` | 512 | +5.0 | -1.0 | 1.4, 1.4 |"
  assert len(lines) == 3


def test_a_rewrite_keeps_the_hand_written_discussion_once(tmp_path):
  path = tmp_path / "r.md"
  assert xbm_study._kept_discussion(path) == []  # pylint: disable=protected-access
  path.write_text("# t\n\n## Cost\n\nx\n\n## Discussion\n\nWhy.\n\n## Runs\n\n"
                  "| run |\n")
  assert xbm_study._kept_discussion(path) == [  # pylint: disable=protected-access
      "## Discussion\n\nWhy.", ""]
