"""experiments/tools/metrics_diff.py: two runs compared metric by metric."""

from experiments.tools import metrics_diff


def _metrics(r1, nmi):
  part = {"recall@1": r1, "nmi": nmi, "num_queries": 10}
  return {"init": part, "final": part, "best": {"test": part},
          "result": {"step": 5, "test": part}, "step": 5}


def test_every_shared_metric_and_the_largest_difference():
  a, b = _metrics(0.5, 0.25), _metrics(0.75, 0.25)
  rows = list(metrics_diff.rows(a, b))
  assert ("result.test", "recall@1", 0.5, 0.75) in rows
  assert len(rows) == 4 * 3  # 4 parts x 3 metrics
  text = metrics_diff.report(a, b)
  assert "Largest absolute difference: 0.25 (init recall@1)." in text
  assert "Reported (result) step: A 5, B 5." in text
  same = metrics_diff.report(a, a)
  assert "Largest absolute difference: 0.0." in same
