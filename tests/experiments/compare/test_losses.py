"""Specification of experiments/compare/losses.py (the loss comparison)."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from circle_jax.evaluation import omniglot_oneshot
from circle_jax.train import restore as restore_lib
from experiments.compare import losses as compare
from experiments.compare import runs as compare_runs
from experiments.compare import report as compare_report

# Slow (whole jobs or benchmarks): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[3]
DIGITS = str(REPO / "experiments" / "configs" / "digits.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _test_metrics(r1, map_r, nmi):
  return {"recall@1": r1, "recall@2": min(1.0, r1 + 0.1),
          "recall@4": min(1.0, r1 + 0.2), "recall@8": min(1.0, r1 + 0.3),
          "precision@1": r1, "r_precision": map_r + 0.1, "map@r": map_r,
          "nmi": nmi, "ami": nmi - 0.01, "num_queries": 896.0,
          "num_queries_without_match": 0.0}


def _write_run(root, loss, seed, test, *, overrides=(), selection="test",
               step=3, train_seconds=10.0, wall=None, config=None):
  """A finished run's folder as the main job (and the runner) leave it."""
  flag_args = compare_runs.config_args(DIGITS, loss, seed, overrides)
  workdir = os.path.join(root, loss, f"seed_{seed}")
  os.makedirs(workdir, exist_ok=True)
  metrics = {
      "result": {"step": step, "selection": selection,
                 "metric": None if selection == "last" else "recall@1",
                 "test": test},
      "final": test, "best": None, "init": None, "validation": None,
      "step": step, "train_seconds": train_seconds,
      "config": config or compare_runs.resolve_config(flag_args),
  }
  with open(os.path.join(workdir, compare_runs.METRICS_FILE), "w") as f:
    json.dump(metrics, f)
  if wall is not None:
    with open(os.path.join(workdir, compare_runs.RUN_FILE), "w") as f:
      json.dump({"wall_seconds": wall, "nproc": 2, "cpu": "Test CPU",
                 "load_average": [1.0, 2.5]}, f)
  return workdir


def _run(root, loss, seed, overrides=()):
  flag_args = compare_runs.config_args(DIGITS, loss, seed, overrides)
  workdir = os.path.join(root, loss, f"seed_{seed}")
  return compare_runs.Run(loss, seed, workdir,
                     compare_runs.main_command(flag_args, workdir),
                     compare_runs.resolve_config(flag_args))


def test_metric_columns_follow_the_runs_recall_ks():
  run = compare_runs.Run("circle", 0, "", [], {})
  run.metrics = {"result": {"test": {"recall@10": 0.5, "recall@1": 0.2,
                                     "recall@100": 0.9, "map@r": 0.1}}}
  assert compare_report.metric_columns([run]) == [
      ("precision@1", "P@1"), ("recall@1", "R@1"), ("recall@10", "R@10"),
      ("recall@100", "R@100"), ("map@r", "MAP@R"), ("nmi", "NMI")]


# ----------------------------------------------------------------------------
# Skip-if-complete and conflicting workdirs.
# ----------------------------------------------------------------------------


def test_complete_run_with_the_same_config_is_reused(tmp_path):
  _write_run(tmp_path, "circle", 0, _test_metrics(0.5, 0.2, 0.3), wall=12.0,
             overrides=["--config.dataset.data_dir=/elsewhere"])
  run = _run(tmp_path, "circle", 0)
  compare_runs.prepare(run)
  # data_dir is where the data lives, not what the run computes.
  assert run.status == "reused" and run.wall_seconds == 12.0
  assert run.metrics["result"]["test"]["recall@1"] == 0.5


def test_incomplete_run_is_trained(tmp_path):
  workdir = _write_run(tmp_path, "circle", 0, _test_metrics(0.5, 0.2, 0.3))
  path = os.path.join(workdir, compare_runs.METRICS_FILE)
  with open(path) as f:
    metrics = json.load(f)
  del metrics["result"]
  with open(path, "w") as f:
    json.dump(metrics, f)
  run = _run(tmp_path, "circle", 0)
  compare_runs.prepare(run)
  assert run.status == "pending" and run.metrics is None
  with open(path, "w") as f:
    f.write('{"result": {"st')  # cut short
  compare_runs.prepare(run)
  assert run.status == "pending"


def test_workdir_of_another_config_is_refused_naming_the_fields(tmp_path):
  _write_run(tmp_path, "circle", 0, _test_metrics(0.5, 0.2, 0.3),
             overrides=["--config.num_train_steps=7"])
  run = _run(tmp_path, "circle", 0, ["--config.num_train_steps=9"])
  compare_runs.prepare(run)
  assert run.status == "failed" and run.metrics is None
  assert "num_train_steps: 7 (there) vs 9 (this comparison)" in run.error
  assert run.workdir in run.error and "another --workdir" in run.error


def test_bad_arguments_fail_before_any_run(tmp_path, capsys):
  base = ["--config", DIGITS, "--workdir", str(tmp_path / "runs"),
          "--out", str(tmp_path / "out")]
  for extra, message in (
      (["--losses", "circle,circel"], "unknown loss(es) ['circel']"),
      (["--losses", "all", "--config.loss.gamma=64"],
       "has no hyperparameter 'gamma'"),
      (["--losses", "circle", "--config.seed=3"], "use --losses / --seeds"),
      (["--losses", "circle", "--config.nope=1"], "does not have"),
      (["--losses", "circle", "--seeds", "0"], "--seeds"),
  ):
    with pytest.raises(SystemExit):
      compare.main(base + extra)
    assert message in capsys.readouterr().err
  assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------
# Failure reporting and resuming (a stand-in for the main job).
# ----------------------------------------------------------------------------

_FAKE_MAIN = textwrap.dedent("""\
    import json, os, sys
    args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
    loss, seed = args["config.loss.name"], int(args["config.seed"])
    with open(os.environ["FAKE_MAIN_LOG"], "a") as f:
      f.write(f"{loss} {seed}\\n")
    if loss == "contrastive":
      print("Preparing ...\\nTraceback (most recent call last):\\n"
            "ValueError: boom", file=sys.stderr)
      sys.exit(3)
    r1 = 0.4 + 0.1 * seed
    test = {"recall@1": r1, "precision@1": r1, "map@r": r1 / 2, "nmi": 0.3}
    os.makedirs(args["workdir"], exist_ok=True)
    with open(os.path.join(args["workdir"], "metrics.json"), "w") as f:
      json.dump({"result": {"step": 3, "selection": "last", "metric": None,
                            "test": test}, "train_seconds": 1.5}, f)
    """)


def test_failed_run_is_reported_the_others_go_on_and_rerun_resumes(
    tmp_path, monkeypatch, capsys):
  fake = tmp_path / "fake_main.py"
  fake.write_text(_FAKE_MAIN)
  log = tmp_path / "calls.log"
  monkeypatch.setenv("FAKE_MAIN_LOG", str(log))
  monkeypatch.setattr(
      compare_runs, "main_command",
      lambda flag_args, workdir: [sys.executable, str(fake), *flag_args,
                                  f"--workdir={workdir}"])
  root, out = tmp_path / "runs", tmp_path / "res" / "cmp"
  argv = ["--config", DIGITS, "--losses", "contrastive,circle", "--seeds",
          "2", "--workdir", str(root), "--out", str(out),
          "--config.num_train_steps=3"]

  assert compare.main(argv) == 1
  err = capsys.readouterr().err
  assert log.read_text().split("\n")[:4] == [
      "contrastive 0", "contrastive 1", "circle 0", "circle 1"]
  assert "FAILED contrastive seed 0: exit status 3" in err
  assert str(root / "contrastive" / "seed_1") in err
  assert "ValueError: boom" in err
  assert "2 of 4 runs failed" in err
  md = pathlib.Path(str(out) + ".md").read_text()
  assert "| `contrastive` | 0/2 | – |" in md
  # circle: R@1 0.4 and 0.5 -> 45.0 +- 7.1.
  assert "| `circle` | 2 | **45.0 ± 7.1** | **45.0 ± 7.1** |" in md
  assert "## Failed runs" in md and "exit status 3" in md
  assert pathlib.Path(str(out) + ".png").read_bytes()[:8] == PNG_SIGNATURE

  # Again: the finished circle runs are reused, the failed ones retried.
  log.write_text("")
  assert compare.main(argv) == 1
  assert log.read_text().split() == ["contrastive", "0", "contrastive", "1"]
  assert "2 finished, 2 to train" in capsys.readouterr().out


# ----------------------------------------------------------------------------
# The report.
# ----------------------------------------------------------------------------


def test_report_from_fixture_runs(tmp_path):
  numbers = {("circle", 0): (0.60, 0.30, 0.40), ("circle", 1): (0.64, 0.34,
                                                                0.44),
             ("proxy_anchor", 0): (0.70, 0.20, 0.50),
             ("proxy_anchor", 1): (0.66, 0.22, 0.46)}
  runs = []
  for (loss, seed), (r1, map_r, nmi) in numbers.items():
    overrides = ["--config.loss.gamma=64"] if loss == "circle" else []
    _write_run(tmp_path, loss, seed, _test_metrics(r1, map_r, nmi),
               overrides=overrides, selection="last", step=3,
               train_seconds=20.0 + seed, wall=30.0 + seed)
    run = _run(tmp_path, loss, seed, overrides)
    compare_runs.prepare(run)
    assert run.status == "reused"
    runs.append(run)
  out = str(tmp_path / "results" / "cmp")
  md_path, png_path = compare_report.report(
      out, command="python -m experiments.compare.losses --seeds 2",
      config_name="experiments/configs/digits.py",
      losses=["circle", "proxy_anchor"], seeds=[0, 1], runs=runs,
      elapsed=5.0)
  assert (str(md_path), str(png_path)) == (out + ".md", out + ".png")
  md = md_path.read_text()
  for fragment in (
      "# Loss comparison: digits, conv4 4-d, 2 losses x 2 seeds",
      "```bash\npython -m experiments.compare.losses --seeds 2\n```",
      "- data: digits: train on 5 classes; test on 5 unseen classes (896 "
      "images, each retrieved among the others)",
      "- model: conv4 (width=32), avg pooling, embedding dim 4",
      "- batch: P x K = 5 classes x 8 images = 40",
      "- optimiser: adam, lr 0.001, weight decay 0, constant schedule",
      "- steps: 150; evaluation every 75 steps",
      "- seeds: 0, 1 ",
      "- reported step: the last step (no model selection)",
      "sample standard deviation (ddof=1)",
      "all 4 timed runs 122 s, per run 30 s wall",
      "training loop 20 s per run",
      "- machine: 2 CPUs (nproc), Test CPU; 1-min load average 1.0-2.5",
      "| loss | runs | P@1 | R@1 | R@2 | R@4 | R@8 | MAP@R | NMI | train s |",
      # circle R@1 62.0 +- 2.8, MAP@R 32.0 +- 2.8, NMI 42.0 +- 2.8;
      # proxy_anchor R@1 68.0 +- 2.8, MAP@R 21.0 +- 1.4, NMI 48.0 +- 2.8.
      "| `circle` | 2 | 62.0 ± 2.8 | 62.0 ± 2.8 | 72.0 ± 2.8 | "
      "82.0 ± 2.8 | 92.0 ± 2.8 | **32.0 ± 2.8** | 42.0 ± 2.8 | 20 ± 1 |",
      "| `proxy_anchor` | 2 | **68.0 ± 2.8** | **68.0 ± 2.8** | "
      "**78.0 ± 2.8** | **88.0 ± 2.8** | **98.0 ± 2.8** | 21.0 ± 1.4 | "
      "**48.0 ± 2.8** | 20 ± 1 |",
      "![R@1 and MAP@R per loss](cmp.png)",
      "| `circle` | `gamma=64.0` (paper default 80.0), `margin=0.4` | none | "
      "Sun et al., \"Circle Loss",
      "| `proxy_anchor` | `alpha=32.0`, `margin=0.1` | `proxies`: kaiming "
      "normal",
      "| `proxy_anchor` | 1 | 3 (last) | 66.0 | 22.0 | 46.0 | 21 | 31 |",
  ):
    assert fragment in md, fragment
  assert "Failed runs" not in md
  png = png_path.read_bytes()
  assert png[:8] == PNG_SIGNATURE and len(png) > 10_000


# ----------------------------------------------------------------------------
# End to end: the real CLI and the real main job.
# ----------------------------------------------------------------------------


def test_run_evaluated_otherwise_is_reevaluated_not_retrained(tmp_path):
  _write_run(tmp_path, "circle", 0, _test_metrics(0.5, 0.2, 0.3), wall=12.0)
  run = _run(tmp_path, "circle", 0, ["--config.eval_shift=1",
                                     "--config.fewshot.ways=(5,)"])
  compare_runs.prepare(run)
  assert run.status == "pending" and run.reevaluate
  assert run.wall_seconds == 12.0 and run.metrics is None
  # A training field among the differences: refused, as before.
  run = _run(tmp_path, "circle", 0, ["--config.eval_shift=1",
                                     "--config.num_train_steps=9"])
  compare_runs.prepare(run)
  assert run.status == "failed" and not run.reevaluate
  assert "num_train_steps" in run.error and "eval_shift" in run.error


def test_evaluation_fields_are_resumable():
  """The main job must accept what the runner re-evaluates."""
  from circle_jax.train import workdir as workdir_lib
  assert set(workdir_lib.EVALUATION_FIELDS) <= set(
      workdir_lib.RESUMABLE_FIELDS)


def test_cli_end_to_end_on_digits(tmp_path):
  env = dict(os.environ)
  env["XLA_FLAGS"] = ""  # one CPU device (conftest simulates 8)
  env["PYTHONPATH"] = str(REPO)
  out = tmp_path / "cmp"
  cmd = [sys.executable, "-m", "experiments.compare.losses", "--config", DIGITS,
         "--losses", "circle,multi_similarity", "--seeds", "2",
         "--oneshot", "2",
         "--workdir", str(tmp_path / "runs"), "--out", str(out),
         "--config.num_train_steps=3", "--config.eval_every_steps=0",
         "--config.checkpoint_every_steps=0", "--config.eval_at_init=False",
         # A one-block conv4 of width 8: the same jobs, a quarter the compile.
         "--config.model.kwargs.width=8", "--config.model.kwargs.num_blocks=1",
         f"--config.dataset.data_dir={tmp_path / 'tfds'}"]
  proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for loss in ("circle", "multi_similarity"):
    for seed in (0, 1):
      with open(tmp_path / "runs" / loss / f"seed_{seed}" /
                "metrics.json") as f:
        metrics = json.load(f)
      assert metrics["config"]["seed"] == seed
      assert metrics["config"]["loss"]["name"] == loss
      assert metrics["result"]["step"] == 3
  md = pathlib.Path(str(out) + ".md").read_text()
  assert "| `circle` | 2 | " in md and "| `multi_similarity` | 2 | " in md
  assert "`alpha=2.0`, `base=0.5`, `beta=50.0`" in md
  assert pathlib.Path(str(out) + ".png").read_bytes()[:8] == PNG_SIGNATURE
  # --oneshot 2: each loss's two seeds as one ensemble on the official
  # one-shot runs, as the library scores them.
  official = omniglot_oneshot.official_runs()
  for loss in ("circle", "multi_similarity"):
    embedders = [omniglot_oneshot.run_embedder(restore_lib.restore_run(
        str(tmp_path / "runs" / loss / f"seed_{seed}"))) for seed in (0, 1)]
    alone = [omniglot_oneshot.oneshot_errors(e, official).mean_error
             for e in embedders]
    both = omniglot_oneshot.oneshot_errors(
        omniglot_oneshot.ensemble_embedder(embedders), official)
    assert (f"| `{loss}` | 0, 1 | {alone[0]:.2f}, {alone[1]:.2f} | "
            f"**{both.mean_error:.2f}** | "
            + " | ".join(f"{e:.0f}" for e in both.errors) + " |") in md
    assert f"- `{loss}`: {both.mean_error:.2f} % over 1 ensemble of 2 runs" in md
  assert "one-shot `circle`: " in proc.stdout
  # The same command again trains nothing.
  proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "4 finished, 0 to train" in proc.stdout
  # Another evaluation of one finished run: re-evaluated, not retrained.
  workdir = tmp_path / "runs" / "circle" / "seed_0"
  before = json.loads((workdir / "metrics.json").read_text())
  ckpts = {str(p): p.stat().st_mtime_ns
           for p in (workdir / "checkpoints").rglob("*") if p.is_file()}
  wall = json.loads((workdir / "compare_run.json").read_text())["wall_seconds"]
  cmd2 = [a for a in cmd
          if a not in ("circle,multi_similarity", "2", "--oneshot")]
  cmd2[cmd2.index("--losses") + 1:cmd2.index("--losses") + 1] = ["circle"]
  cmd2[cmd2.index("--seeds") + 1:cmd2.index("--seeds") + 1] = ["1"]
  proc = subprocess.run(cmd2 + ["--config.eval_shift=1"], cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "0 finished, 0 to train, 1 to re-evaluate" in proc.stdout
  assert "circle seed 0 re-evaluated in " in proc.stdout
  assert "(0 runs trained, 1 re-evaluated, 0 reused)" in pathlib.Path(
      str(out) + ".md").read_text()
  after = json.loads((workdir / "metrics.json").read_text())
  # No step trained: the checkpoints are untouched, the training time is
  # the last checkpoint's (metrics.json's also counts its final write).
  assert ckpts == {str(p): p.stat().st_mtime_ns
                   for p in (workdir / "checkpoints").rglob("*")
                   if p.is_file()}
  assert after["train_seconds"] == pytest.approx(before["train_seconds"],
                                                 rel=0.2)
  assert after["config"]["eval_shift"] == 1 and after["result"]["step"] == 3
  assert after["result"]["test"] != before["result"]["test"]
  assert [list(c["changes"]) for c in after["config_changes"]] == [
      ["eval_shift"]]
  info = json.loads((workdir / "compare_run.json").read_text())
  assert info["wall_seconds"] == wall and len(info["reevaluated"]) == 1
