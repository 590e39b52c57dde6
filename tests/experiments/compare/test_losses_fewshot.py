"""experiments/compare/: few-shot columns, ablations and notes."""

import os

import pytest

from experiments.compare import losses as compare
from experiments.compare import runs as compare_runs
from experiments.compare import report as compare_report
from tests.experiments.compare import test_losses as base

ABLATION = ("norot", ["--config.loss.gamma=64"])


def _fewshot(acc20):
  """Test metrics with few-shot accuracies (the trainer's keys)."""
  m = base._test_metrics(0.6, 0.3, 0.4)
  m.update({"fewshot_5way_1shot": 0.95, "fewshot_5way_1shot_ci95": 0.004,
            "fewshot_20way_1shot": acc20, "fewshot_20way_1shot_ci95": 0.003})
  return m


def _runs(tmp_path):
  """circle and proxy_anchor x 3 seeds, and circle x 3 seeds of an ablation."""
  runs = []
  cells = [("", "circle", tmp_path, [], (0.90, 0.92, 0.94)),
           ("", "proxy_anchor", tmp_path, [], (0.80, 0.80, 0.83)),
           ("norot", "circle", tmp_path / "ablation_norot", ABLATION[1],
            (0.85, 0.86, 0.87))]
  for variant, loss, root, overrides, accs in cells:
    for seed, acc in enumerate(accs):
      workdir = base._write_run(root, loss, seed, _fewshot(acc),
                                overrides=overrides, selection="validation",
                                wall=30.0)
      flag_args = compare_runs.config_args(base.DIGITS, loss, seed, overrides)
      run = compare_runs.Run(loss, seed, workdir,
                        compare_runs.main_command(flag_args, workdir),
                        compare_runs.resolve_config(flag_args), variant=variant)
      compare_runs.prepare(run)
      assert run.status == "reused", run.error
      # The few-shot evaluator's config section (its contract).
      run.metrics["config"]["fewshot"] = {
          "episodes": 1000, "queries": 15, "classifier": "prototype",
          "seed": 0}
      runs.append(run)
  return runs


def test_seed_interval_by_hand():
  assert compare_report.t95(3) == pytest.approx(4.302653, rel=1e-6)
  ci = compare_report.seed_ci95(compare_report.aggregate([0.90, 0.92, 0.94]))
  # std 0.02; 4.3027 * 0.02 / sqrt(3) = 0.04968.
  assert (ci.mean, ci.n) == (pytest.approx(0.92), 3)
  assert ci.std == pytest.approx(0.049683, rel=1e-4)
  one = compare_report.aggregate([0.5])
  assert compare_report.seed_ci95(one) == one


def test_report_has_fewshot_table_ablation_rows_and_notes(tmp_path):
  runs = _runs(tmp_path)
  notes = tmp_path / "notes.md"
  notes.write_text("## Published\n\nBPL 3.3 % error.\n")
  out = str(tmp_path / "results" / "fs")
  md_path, png_path = compare_report.report(
      out, command="python -m experiments.compare.losses ...",
      config_name="experiments/configs/digits.py",
      losses=["circle", "proxy_anchor"], seeds=[0, 1, 2], runs=runs,
      elapsed=1.0, ablations=[ABLATION], notes=str(notes))
  md = md_path.read_text()
  for fragment in (
      "## Few-shot accuracy",
      "1000 episodes per setting, 15 queries per class, classifier "
      "`prototype`, episode seed 0",
      "| loss | runs | 5-way 1-shot | 20-way 1-shot | train s |",
      # 20-way: circle 92.0 +- 4.3027 * 2.0 / sqrt(3); proxy_anchor 81.0,
      # std 1.732 -> 4.3; the ablation 86.0, std 1 -> 2.5.
      "| `circle` | 3 | **95.0 ± 0.0** | **92.0 ± 5.0** | 10 ± 0 |",
      "| `proxy_anchor` | 3 | **95.0 ± 0.0** | 81.0 ± 4.3 | 10 ± 0 |",
      "| `circle (norot)` | 3 | **95.0 ± 0.0** | 86.0 ± 2.5 | 10 ± 0 |",
      "- `circle (norot)`: `--config.loss.gamma=64`",
      "Lowest 20-way 1-shot error (100 - accuracy): 8.0 ± 5.0 % (`circle`, "
      "3 seeds).",
      "| loss | seed | step | R@1 | MAP@R | NMI | 5-way 1-shot | 20-way 1-shot "
      "| train s | wall s |",
      "| `circle (norot)` | 2 | 3 (validation) | 60.0 | 30.0 | 40.0 | "
      "95.0 ± 0.4 | 87.0 ± 0.3 | 10 | 30 |",
      "## Published\n\nBPL 3.3 % error.\n\n## Hyperparameters",
  ):
    assert fragment in md, fragment
  # The retrieval table has the losses only; the ablation is not a loss row.
  main = md[:md.index("## Few-shot accuracy")]
  assert "`circle (norot)`" not in main and "| `circle` | 3 |" in main
  assert png_path.read_bytes()[:8] == base.PNG_SIGNATURE


def test_chart_panels_are_recall_and_the_hardest_one_shot(tmp_path,
                                                          monkeypatch):
  from experiments.figures import plots  # pylint: disable=g-import-not-at-top
  drawn = {}
  monkeypatch.setattr(plots, "write_bars",
                      lambda path, summary, metrics, title: drawn.update(
                          metrics=metrics, summary=summary))
  runs = _runs(tmp_path)
  compare_report.report(str(tmp_path / "fs"), command="c", config_name="d",
                        losses=["circle", "proxy_anchor"], seeds=[0, 1, 2],
                        runs=runs, elapsed=1.0, ablations=[ABLATION])
  assert drawn["metrics"] == (("recall@1", "R@1"),
                              ("fewshot_20way_1shot", "20-way 1-shot"))
  assert list(drawn["summary"]) == ["circle", "proxy_anchor"]
  assert drawn["summary"]["circle"]["fewshot_20way_1shot"].mean == (
      pytest.approx(0.92))


def test_no_fewshot_keys_no_fewshot_section(tmp_path):
  run = base._run(tmp_path, "circle", 0)
  base._write_run(tmp_path, "circle", 0, base._test_metrics(0.6, 0.3, 0.4))
  compare_runs.prepare(run)
  md = compare_report.write_markdown(
      tmp_path / "x.md", command="c", config_name="d", losses=["circle"],
      seeds=[0], runs=[run], elapsed=1.0)
  assert "Few-shot" not in md and "5-way" not in md


def test_ablation_runs_and_arguments(tmp_path):
  ablations = compare.parse_ablations(
      ["norot:--config.dataset.rotations=1",
       "noaug:--config.dataset.preprocess.preset=grayscale "
       "--config.num_train_steps=5"], ["circle"])
  assert ablations == [
      ("norot", ["--config.dataset.rotations=1"]),
      ("noaug", ["--config.dataset.preprocess.preset=grayscale",
                 "--config.num_train_steps=5"])]
  for bad, match in (("norot", "expected 'NAME\\[@LOSS\\]:"),
                     ("Bad:--config.seed=1", "expected 'NAME\\[@LOSS\\]:"),
                     ("circle:--config.num_train_steps=5", "is taken"),
                     ("x:", "no --config"),
                     ("x:--config.seed=3", "sets config.seed"),
                     ("x:--steps=3", "unexpected argument")):
    with pytest.raises(ValueError, match=match):
      compare.parse_ablations([bad], ["circle"])
  args = type("Args", (), dict(losses="circle,triplet", seeds="2",
                               config=base.DIGITS, workdir=str(tmp_path),
                               ablation_loss="circle"))
  runs = compare.build_runs(args, ["--config.num_train_steps=7"],
                            [("fast", ["--config.num_train_steps=3"])])
  # The ablation runs come right after their loss's runs.
  assert [(r.variant, r.loss, r.seed) for r in runs] == [
      ("", "circle", 0), ("", "circle", 1), ("fast", "circle", 0),
      ("fast", "circle", 1), ("", "triplet", 0), ("", "triplet", 1)]
  assert runs[2].workdir == os.path.join(tmp_path, "ablation_fast", "circle",
                                         "seed_0")
  assert [r.config["num_train_steps"] for r in runs] == [7, 7, 3, 3, 7, 7]



def test_ablation_with_its_own_loss(tmp_path):
  """``NAME@LOSS`` trains LOSS (not in --losses) after the losses' runs,
  and an unknown LOSS is refused."""
  texts = ["views@nt_xent:--config.batch.sampler=views",
           "fast:--config.num_train_steps=3"]
  ablations = compare.parse_ablations(texts, ["circle"])
  assert [name for name, _ in ablations] == ["views", "fast"]
  assert compare.ablation_losses(texts) == {"views": "nt_xent"}
  with pytest.raises(ValueError, match="unknown loss 'nt_xnet'"):
    compare.parse_ablations(["v@nt_xnet:--config.num_train_steps=3"],
                            ["circle"])
  args = type("Args", (), dict(losses="circle", seeds="1",
                               config=base.DIGITS, workdir=str(tmp_path),
                               ablation_loss="circle"))
  runs = compare.build_runs(args, [], ablations, compare.ablation_losses(texts))
  assert [(r.variant, r.loss) for r in runs] == [
      ("", "circle"), ("fast", "circle"), ("views", "nt_xent")]
  assert runs[2].config["loss"]["name"] == "nt_xent"
  assert runs[2].config["batch"]["sampler"] == "views"
  assert runs[2].workdir == os.path.join(tmp_path, "ablation_views",
                                         "nt_xent", "seed_0")
