"""Tests of circle_jax/train/evaluate.py: the evaluator and the final table.

The summary line and the final table by hand, then the few-shot accuracies
in the trainer's evaluations (``config.fewshot``).
"""

import json
import os

import numpy as np
import pytest

from circle_jax import evaluation as eval_lib
from circle_jax import config_facts
from circle_jax.train import config_checks
from circle_jax.train import evaluate as evaluate_lib
from circle_jax.train import loop
from circle_jax.train import restore as restore_lib
from circle_jax.train import workdir as workdir_lib
from tests.train import helpers

FEWSHOT = {"fewshot.ways": (2,), "fewshot.shots": (1, 3),
           "fewshot.episodes": 30, "fewshot.seed": 7}
KEYS = {"fewshot_2way_1shot", "fewshot_2way_1shot_ci95",
        "fewshot_2way_3shot", "fewshot_2way_3shot_ci95"}


@pytest.mark.slow  # a training job
def test_fewshot_metrics_with_validation_selection(tmp_path):
  """Few-shot keys in every test and validation evaluation; the selected
  step's numbers are those of its checkpoint's embeddings; a few-shot
  accuracy can select the step."""
  c = helpers.digits_config(**{
      "dataset.data_dir": str(tmp_path / "tfds"), "dataset.num_threads": 2,
      "dataset.validation_fraction": 0.4, "batch.classes_per_batch": 3,
      "num_train_steps": 4, "eval_every_steps": 2,
      "checkpoint_every_steps": 2, "log_every_steps": 2,
      "eval_clustering": False, "best_metric": "fewshot_2way_1shot",
      **FEWSHOT})
  workdir = str(tmp_path / "run")
  result = loop.train_and_evaluate(c, workdir)
  with open(os.path.join(workdir, "metrics.json")) as f:
    saved = json.load(f)
  for part in (saved["init"], saved["final"], saved["best"]["test"],
               saved["best"]["validation"], saved["validation"]["init"]):
    assert KEYS <= set(part)
    for k in KEYS:
      assert 0.0 <= part[k] <= 1.0
    assert 0.0 < part["fewshot_2way_1shot_ci95"] < 0.25
  assert saved["best"]["metric"] == "fewshot_2way_1shot"
  # Independent check: the selected checkpoint's test embeddings, the
  # evaluator's function called directly.
  run = restore_lib.restore_run(workdir, "best")
  assert run.step == saved["result"]["step"]
  emb, labels = run.embed_split()
  want = eval_lib.fewshot_metrics(emb, labels, ways=(2,), shots=(1, 3),
                                  episodes=30, seed=7)
  assert {k: saved["result"]["test"][k] for k in KEYS} == want
  table = evaluate_lib.result_table(result)
  rows = [line.split()[0] for line in table.splitlines()]
  assert rows.index("map@r") < rows.index(
      "fewshot_2way_1shot") < rows.index("fewshot_2way_1shot_ci95") < (
          rows.index("fewshot_2way_3shot"))
  assert "fewshot_2way_1shot" in evaluate_lib.summary(saved["final"])


def test_summary_orders_settings_by_ways_then_shots():
  metrics = {"recall@1": 0.5, "fewshot_20way_1shot": 0.3,
             "fewshot_5way_5shot": 0.8, "fewshot_5way_1shot": 0.6,
             "fewshot_5way_1shot_ci95": 0.01}
  assert evaluate_lib.summary(metrics) == (
      "recall@1 0.5000, fewshot_5way_1shot 0.6000, fewshot_5way_5shot "
      "0.8000, fewshot_20way_1shot 0.3000")


def test_default_is_off():
  c = helpers.digits_config()
  assert c.fewshot.ways == ()
  assert not any(n.startswith("fewshot") for n in config_facts.metric_names(
      (1,), True, c.fewshot))


@pytest.mark.parametrize("overrides, message", [
    ({"fewshot.ways": (1,)}, "config.fewshot.ways: must be a tuple of ints "
     ">= 2"),
    ({"fewshot.ways": (5,), "fewshot.shots": ()}, "config.fewshot.shots: is "
     "empty"),
    ({"fewshot.ways": (5,), "fewshot.shots": (0,)}, "config.fewshot.shots: "
     "must be a tuple of ints >= 1"),
    ({"fewshot.ways": (6,)}, "config.fewshot.ways: 6-way episodes but the "
     "test split of 'digits' has 5 classes"),
    ({"fewshot.ways": (3,), "dataset.validation_fraction": 0.4,
      "batch.classes_per_batch": 3}, "config.fewshot.ways: 3-way episodes but "
     "the validation split of 'digits' has 2 classes"),
    ({"fewshot.ways": (5,), "fewshot.classifier": "knn"},
     "config.fewshot.classifier: must be one of"),
    ({"fewshot.ways": (5,), "fewshot.episodes": 0},
     "config.fewshot.episodes: must be a positive int"),
    ({"fewshot.ways": (5,), "fewshot.queries": 0},
     "config.fewshot.queries: must be a positive int"),
    ({"best_metric": "fewshot_5way_1shot"}, "config.best_metric"),
])
def test_bad_fewshot_values_name_the_field(overrides, message):
  c = helpers.digits_config(**overrides)
  with pytest.raises(config_checks.ConfigError, match=message) as e:
    config_checks.check_config(c, device_count=8, process_count=1)
  assert "\n" not in str(e.value)


def test_fewshot_metric_can_be_the_best_metric():
  c = helpers.digits_config(**{"fewshot.ways": (5,),
                               "best_metric": "fewshot_5way_5shot"})
  config_checks.check_config(c, device_count=8, process_count=1)
  assert np.isin(["fewshot_5way_1shot"], config_facts.metric_names(
      (1,), False, c.fewshot)).all()


def test_runs_saved_before_the_fewshot_section_resume_and_compare_equal():
  old = workdir_lib.config_to_dict(helpers.digits_config())
  del old["fewshot"]
  new = helpers.digits_config()
  assert workdir_lib.config_diff(old, workdir_lib.config_to_dict(new)) == []
  new.fewshot.ways = (5,)
  diff = workdir_lib.config_diff(old, workdir_lib.config_to_dict(new))
  assert diff == [("fewshot.ways", workdir_lib.ABSENT, [5])]
  # Evaluation settings: a run resumes with few-shot evaluation turned on.
  assert workdir_lib._resumable("fewshot.ways")
  # A field absent from one side but not at its default still differs.
  del old["eval_ks"]
  assert workdir_lib.config_diff(old, dict(old, eval_ks=[1, 2])) == [
      ("eval_ks", workdir_lib.ABSENT, [1, 2])]


_CONFIG = {"dataset": {"name": "digits"}, "model": {"name": "conv4"},
           "loss": {"name": "circle"}}
_FINAL = {"recall@1": 0.5, "map@r": 0.25, "nmi": 0.5}


def test_result_table_of_a_validation_selected_run():
  result = {"step": 20, "init": {"recall@1": 0.1, "map@r": 0.05},
            "final": _FINAL, "config": _CONFIG,
            "best": {"step": 10, "validation": {"recall@1": 0.75}},
            "result": {"selection": "validation", "step": 10,
                       "metric": "recall@1",
                       "test": {"recall@1": 0.625, "map@r": 0.125,
                                "nmi": 0.375}},
            "validation": {"num_classes": 2}}
  assert evaluate_lib.result_table(result).splitlines() == [
      "digits / conv4 / circle: test-split metrics",
      "metric         init   final@20 selected@10",
      "recall@1     0.1000     0.5000      0.6250",
      "map@r        0.0500     0.2500      0.1250",
      "nmi               -     0.5000      0.3750",
      "selected@10: the step with the best validation recall@1 (0.7500) on 2 "
      "held-out train classes; its test numbers are the result."]


def test_result_table_says_a_test_selected_step_is_optimistic():
  result = {"step": 20, "final": _FINAL, "config": _CONFIG,
            "best": {"step": 10},
            "result": {"selection": "test", "step": 10, "metric": "recall@1",
                       "test": {"recall@1": 0.625}}}
  lines = evaluate_lib.result_table(result).splitlines()
  assert lines[1].split() == ["metric", "final@20", "best@10",
                              "(test-selected)"]
  assert lines[2].split() == ["recall@1", "0.5000", "0.6250"]
  assert lines[3].split() == ["map@r", "0.2500", "-"]
  assert lines[-1].startswith("note: best@10 was selected on the TEST split")


def test_result_table_of_the_last_step_carries_its_note():
  result = {"step": 20, "init": None, "best": None, "final": _FINAL,
            "config": _CONFIG,
            "result": {"selection": "last", "step": 20, "metric": "recall@1",
                       "test": _FINAL, "note": "the best step is unreadable"}}
  assert evaluate_lib.result_table(result).splitlines() == [
      "digits / conv4 / circle: test-split metrics",
      "metric     final@20",
      "recall@1     0.5000",
      "map@r        0.2500",
      "nmi          0.5000",
      "note: the best step is unreadable"]


def test_summary_shows_the_headline_metrics_present():
  assert evaluate_lib.summary({"nmi": 0.5, "recall@1": 0.25, "ami": 0.1,
                               "map@r": 0.125}) == (
      "recall@1 0.2500, map@r 0.1250, nmi 0.5000")
  assert evaluate_lib.summary({"ami": 0.1}) == ""


def test_metrics_follow_eval_metrics_and_eval_avg_of_avgs():
  c = helpers.digits_config(**{
      "eval_metrics": ("map@r", "mean_reciprocal_rank"),
      "eval_avg_of_avgs": True, "eval_clustering": False,
      "best_metric": "mean_reciprocal_rank"})
  config_checks.check_config(c, device_count=8, process_count=1)
  assert config_facts.metric_names((1,), False, None,
                                   config_facts.retrieval_metrics(c)) == [
      "recall@1", "map@r", "mean_reciprocal_rank"]
  ev = evaluate_lib.Evaluator.__new__(evaluate_lib.Evaluator)  # no data
  ev.config, ev.ks = c, (1,)
  rng = np.random.default_rng(0)
  emb = rng.standard_normal((12, 4)).astype(np.float32)
  lab = np.array([0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2])
  got = ev._metrics(emb, lab)
  assert set(got) == {"recall@1", "map@r", "mean_reciprocal_rank",
                      "num_queries", "num_queries_without_match"}
  kw = dict(ks=(1,), metrics=("map@r", "mean_reciprocal_rank"))
  avg = eval_lib.retrieval_metrics(emb, lab, avg_of_avgs=True, **kw)
  mean = eval_lib.retrieval_metrics(emb, lab, **kw)
  assert mean["mean_reciprocal_rank"] != avg["mean_reciprocal_rank"]
  assert got["mean_reciprocal_rank"] == avg["mean_reciprocal_rank"]
