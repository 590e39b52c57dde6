"""Calibration against scikit-learn, cut-points, match, OPIS."""

import numpy as np
import pytest
from sklearn import metrics

from circle_jax.search import calibrate


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_curve_equals_sklearns_precision_recall_curve(seed):
  rng = np.random.default_rng(seed)
  scores = np.round(rng.random(400), 2).astype(np.float32)  # many ties
  correct = rng.random(400) < scores
  curve = calibrate.calibration_curve(scores, correct)
  precision, recall, thresholds = metrics.precision_recall_curve(
      correct, scores)
  np.testing.assert_array_equal(curve["threshold"], thresholds)
  np.testing.assert_allclose(curve["precision"], precision[:-1], rtol=1e-12)
  np.testing.assert_allclose(curve["recall"], recall[:-1], rtol=1e-12)
  for i, t in enumerate(curve["threshold"]):
    pred = scores >= t
    assert curve["accuracy"][i] == pytest.approx(
        metrics.accuracy_score(correct, pred))
    assert curve["f1"][i] == pytest.approx(metrics.f1_score(correct, pred))


def test_hand_computed_curve_and_cutpoints():
  # scores 0.9 (right), 0.8 (wrong), 0.7 (right), 0.2 (wrong)
  curve = calibrate.calibration_curve([0.9, 0.8, 0.7, 0.2],
                                      [True, False, True, False])
  assert curve["threshold"].tolist() == pytest.approx([0.2, 0.7, 0.8, 0.9])
  assert curve["precision"].tolist() == pytest.approx([0.5, 2 / 3, 0.5, 1])
  assert curve["recall"].tolist() == [1, 1, 0.5, 0.5]
  assert curve["accuracy"].tolist() == [0.5, 0.75, 0.5, 0.75]
  cuts = calibrate.cutpoints(curve, target_precisions=(0.99, 0.6),
                             target_recalls=(1.0,))
  assert cuts["best_f1"]["threshold"] == pytest.approx(0.7)   # f1 0.8
  assert cuts["precision_0.99"]["threshold"] == pytest.approx(0.9)
  assert cuts["precision_0.6"]["threshold"] == pytest.approx(0.7)
  assert cuts["recall_1"]["threshold"] == pytest.approx(0.7)


def test_match_answers_the_nearest_label_or_unknown():
  got = calibrate.match([0.95, 0.5, 0.7], ["cat", "dog", 3], threshold=0.7)
  assert got == ["cat", calibrate.UNKNOWN, 3]
  with pytest.raises(calibrate.CalibrationError, match="no cut-points"):
    calibrate.cutpoint({}, None)
  with pytest.raises(calibrate.CalibrationError, match="no cut-point 'x'"):
    calibrate.cutpoint({"best_f1": {}}, "x")


def test_opis_is_zero_for_identical_classes_and_hand_computed_otherwise():
  # Two classes arranged identically: every per-class curve is the overall.
  q = np.array([[1, 0], [0, 1]], np.float32)
  g = np.array([[1, 0], [0, 1]], np.float32)
  assert calibrate.opis(q, [0, 1], g, [0, 1])["opis"] == 0.0
  # Class a: positive at similarity 1, negative at 0. Class b: its positive
  # at 0 (cos 90 deg), its negative at 1. Thresholds over [0, 1]: at t <= 0
  # both classes accept all pairs: F1 = 2/3 each and overall. For 0 < t <=
  # 1: class a F1 = 1, class b F1 = 0, overall F1 = 2*1/(2*1+1+1) = 0.5.
  # OPIS = mean over the grid of ((1-.5)^2 + (0-.5)^2) / 2 = 0.25, except
  # at the grid point of similarity 0. The grid: the 1000 bins of width
  # 0.001 from 0 (similarity 1 falls in the last bin).
  q = np.array([[1, 0], [1, 0]], np.float32)
  g = np.array([[1, 0], [0, 1]], np.float32)
  out = calibrate.opis(q, ["a", "b"], g, ["a", "b"])
  points = calibrate.OPIS_BINS // 2
  assert out["opis"] == pytest.approx(0.25 * (points - 1) / points)
  assert out["num_classes"] == 2
  assert out["threshold_low"] == 0.0 and out["threshold_high"] == 1.0
