"""The Circle-loss paper figures: the numbers they show, checked.

Figure 1: the decision boundaries traced from our losses lie on the line
``s_p = s_n + m`` (triplet, AM-Softmax, unified loss) or on the circle of
radius ``sqrt(2) m`` around ``(0, 1)`` (Circle loss) to ``TOLERANCE``, for two
margins. Figure 2: the gradients are the paper's eqs. 9-10 (alpha held
constant) and equal in magnitude for the (s_n - s_p) losses. Figure 5: the
pipeline from a run's workdir embeds what the run evaluated (the pair
statistics themselves: tests/analysis/test_pairs.py).
"""

import json
import math
import os
import pathlib

import numpy as np
import pytest
from scipy import stats as scipy_stats

from circle_jax.analysis import pair_plane
from circle_jax.analysis import pairs
from experiments.figures import circle_loss as cf
from tests.experiments.configs import recipe_checks

# Slow (whole jobs or benchmarks): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

RESULTS = str(pathlib.Path(__file__).resolve().parents[3] / "experiments"
              / "results" / "figures" / "circle_loss")

# Distance (in similarity units) of a traced point from the exact boundary.
# The bisection reaches float32 resolution: measured max 1.8e-7 (AM-Softmax),
# 1.1e-7 (unified, triplet), 8.6e-8 (Circle).
TOLERANCE = 1e-5
MARGINS = (0.25, 0.4)


@pytest.fixture(scope="module")
def fig1():
  return cf.fig1_data(MARGINS)


@pytest.fixture(scope="module")
def fig2():
  return cf.fig2_data()


def _curve(data, kind, margin):
  (c,) = [c for c in data["curves"]
          if c["loss"] == kind and c["margin"] == margin]
  return np.array(c["points"], np.float64)


def _softplus(x):
  return np.logaddexp(0.0, x)


# ----------------------------------------------------------------------------
# One pair per loss.
# ----------------------------------------------------------------------------


def test_each_loss_sees_exactly_the_one_pair(fig2):
  """The 3 x 3 matrix with masks (and the 2-class CosFace) give eqs. 1-6."""
  m, g = 0.4, 80.0
  s_n, s_p = np.meshgrid(fig2["grid_s_n"], fig2["grid_s_p"])
  alpha_n, alpha_p = np.maximum(s_n + m, 0.0), np.maximum(1.0 + m - s_p, 0.0)
  want = {
      "triplet": np.maximum(s_n - s_p + m, 0.0),
      "cosface": _softplus(g * (s_n - s_p + m)),
      "unified": _softplus(g * (s_n - s_p + m)),
      "circle": _softplus(g * (alpha_n * (s_n - m)
                               - alpha_p * (s_p - 1.0 + m))),
  }
  for kind, value in want.items():
    got = pair_plane.pair_values(pair_plane.pair_loss(kind, margin=m, gamma=g), s_n, s_p)
    np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5,
                               err_msg=kind)


# ----------------------------------------------------------------------------
# Figure 1: decision boundaries.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("margin", MARGINS)
@pytest.mark.parametrize("kind", cf.LINE_LOSSES)
def test_line_losses_boundary_is_the_line_sp_eq_sn_plus_m(fig1, kind, margin):
  pts = _curve(fig1, kind, margin)
  assert pts.shape == (pair_plane.NUM_RAYS, 2) and np.all(np.isfinite(pts))
  assert np.max(np.abs(pair_plane.line_residual(pts, margin))) < TOLERANCE
  # It spans the square: from (0, m) on the s_p axis to (1 - m, 1).
  np.testing.assert_allclose(pts[0], [0.0, margin], atol=TOLERANCE)
  np.testing.assert_allclose(pts[-1], [1.0 - margin, 1.0], atol=TOLERANCE)
  # ... and it is not the circle.
  assert np.max(np.abs(pair_plane.circle_residual(pts, margin))) > 0.1


@pytest.mark.parametrize("margin", MARGINS)
def test_circle_loss_boundary_is_the_circle_of_radius_sqrt2_m(fig1, margin):
  pts = _curve(fig1, "circle", margin)
  assert pts.shape == (pair_plane.NUM_RAYS, 2) and np.all(np.isfinite(pts))
  radius = np.hypot(pts[:, 0], pts[:, 1] - 1.0)
  np.testing.assert_allclose(radius, math.sqrt(2.0) * margin, atol=TOLERANCE)
  assert np.max(np.abs(pair_plane.line_residual(pts, margin))) > 0.1
  other = [m for m in MARGINS if m != margin][0]
  assert np.min(np.abs(pair_plane.circle_residual(pts, other))) > 0.1


def test_fig1_arrows_equal_for_line_losses_and_reweighted_for_circle(fig1):
  m = fig1["arrows"]["circle"]["hyper"]["margin"]
  for name, p in fig1["arrows"]["unified"]["points"].items():
    assert p["ratio_n_over_p"] == pytest.approx(1.0, rel=1e-6), name
  for name, p in fig1["arrows"]["circle"]["points"].items():
    want = (p["s_n"] + m) / (1.0 + m - p["s_p"])   # alpha_n / alpha_p
    assert p["ratio_n_over_p"] == pytest.approx(want, rel=1e-5), name
  circle = fig1["arrows"]["circle"]["points"]
  # The paper: for A (s_n near 0) Circle emphasises s_p, for B s_n.
  assert circle["A"]["ratio_n_over_p"] < 1.0 < circle["B"]["ratio_n_over_p"]


# ----------------------------------------------------------------------------
# Figure 2: gradients.
# ----------------------------------------------------------------------------


def test_circle_gradient_at_A_is_the_papers_alpha_ratio(fig2):
  a = fig2["panels"]["circle"]["points"]["A"]
  assert (a["s_n"], a["s_p"]) == (0.8, 0.8) and fig2["margin"] == 0.4
  assert abs(a["dL_ds_n"]) > abs(a["dL_ds_p"])
  assert a["dL_ds_n"] > 0 > a["dL_ds_p"]
  # alpha_n / alpha_p = [s_n + m]_+ / [1 + m - s_p]_+ = 1.2 / 0.6. Had alpha
  # been differentiated, the ratio would be d(s_n^2)/d(-(s_p - 1)^2) =
  # 1.6 / 0.4 = 4.
  assert a["ratio_n_over_p"] == pytest.approx(2.0, rel=1e-5)
  # At B, s_n has dropped, and so has its emphasis: 0.7 / 0.6.
  b = fig2["panels"]["circle"]["points"]["B"]
  assert b["ratio_n_over_p"] == pytest.approx(0.7 / 0.6, rel=1e-4)


def test_circle_gradients_are_eqs_9_10_with_alpha_constant(fig2):
  """dL/ds_n = Z gamma alpha_n, dL/ds_p = -Z gamma alpha_p, Z = 1 - e^-L."""
  m, g = fig2["margin"], fig2["gamma"]
  s_n, s_p = np.meshgrid(fig2["grid_s_n"], fig2["grid_s_p"])
  loss = pair_plane.pair_loss("circle", margin=m, gamma=g)
  z = -np.expm1(-pair_plane.pair_values(loss, s_n, s_p))
  panel = fig2["panels"]["circle"]
  alpha_n, alpha_p = np.maximum(s_n + m, 0), np.maximum(1 + m - s_p, 0)
  np.testing.assert_allclose(panel["dL_ds_n"], z * g * alpha_n, rtol=2e-5)
  np.testing.assert_allclose(panel["dL_ds_p"], -z * g * alpha_p, rtol=2e-5)


@pytest.mark.parametrize("kind", ["triplet", "cosface"])
def test_sn_minus_sp_losses_have_equal_gradient_magnitudes(fig2, kind):
  panel = fig2["panels"][kind]
  g_n, g_p = np.array(panel["dL_ds_n"]), np.array(panel["dL_ds_p"])
  assert np.all(g_n >= 0) and np.all(g_p <= 0)
  # CosFace's cross-entropy gradient (softmax - one-hot) is resolved to about
  # scale * float32 eps: where the loss is ~1e-8 one component rounds to 0.
  atol = 4 * panel["hyper"].get("scale", 1.0) * 2.0**-23
  np.testing.assert_allclose(g_n, -g_p, rtol=1e-5, atol=atol)
  assert np.mean(np.abs(g_n) > atol) > 0.5
  if kind == "triplet":  # 1 where violated, 0 where satisfied
    s_n, s_p = np.meshgrid(fig2["grid_s_n"], fig2["grid_s_p"])
    hinge = s_n - s_p + fig2["margin"]
    off = np.abs(hinge) > 1e-6  # the grid has points on the line itself
    np.testing.assert_array_equal(g_n[off], np.where(hinge > 0, 1.0, 0.0)[off])


# ----------------------------------------------------------------------------
# The committed figures.
# ----------------------------------------------------------------------------


def _load(stem):
  assert os.path.exists(os.path.join(RESULTS, stem + ".png")), stem
  with open(os.path.join(RESULTS, stem + ".json")) as f:
    return json.load(f)


def test_committed_fig1_json_is_current_and_on_the_boundaries(fig1):
  saved = _load("fig1_decision_boundaries")
  assert saved["margins"] == list(MARGINS)
  for want, got in zip(fig1["curves"], saved["curves"]):
    assert (want["loss"], want["margin"]) == (got["loss"], got["margin"])
    pts = np.array(got["points"], np.float64)
    np.testing.assert_allclose(pts, np.array(want["points"], np.float64),
                               atol=1e-6)
    residual = (pair_plane.circle_residual if got["loss"] == "circle" else
                pair_plane.line_residual)(pts, got["margin"])
    assert np.max(np.abs(residual)) < TOLERANCE, got["loss"]


def test_committed_fig2_json_is_current(fig2):
  saved = _load("fig2_gradients")
  for kind, panel in fig2["panels"].items():
    for key in ("dL_ds_n", "dL_ds_p"):
      np.testing.assert_allclose(saved["panels"][kind][key], panel[key],
                                 rtol=1e-5, atol=1e-5, err_msg=kind)
  a = saved["panels"]["circle"]["points"]["A"]
  assert a["ratio_n_over_p"] == pytest.approx(2.0, rel=1e-5)


# ----------------------------------------------------------------------------
# Figure 5: pair similarity statistics.
# ----------------------------------------------------------------------------


def test_parse_runs():
  assert cf.parse_runs("circle=/a,cosface=/b/c") == {"circle": "/a",
                                                     "cosface": "/b/c"}
  with pytest.raises(ValueError):
    cf.parse_runs("circle")


@pytest.fixture(scope="module")
def tiny_digits_run(tmp_path_factory):
  """Six Circle-loss steps on digits, evaluated and checkpointed at the end."""
  from circle_jax.train import loop
  from experiments.configs import digits
  c = digits.get_config()
  c.dataset.data_dir = str(tmp_path_factory.mktemp("tfds"))
  c.dataset.num_threads = 2
  c.num_train_steps = 6
  c.eval_every_steps = 0
  c.checkpoint_every_steps = 0
  c.eval_at_init = False
  c.eval_clustering = False
  c.log_every_steps = 6
  c.parallelism = "none"  # one device: fewer and smaller compilations
  workdir = str(tmp_path_factory.mktemp("digits_run"))
  result = loop.train_and_evaluate(c, workdir)
  return workdir, result


def test_fig5_pipeline_from_a_run_workdir(tiny_digits_run, tmp_path):
  from circle_jax import evaluation
  workdir, result = tiny_digits_run
  out = tmp_path / "figs"
  cf.main(["--out", str(out), "--figures", "5", "--fig5-runs",
           f"circle={workdir},same={workdir}"])
  assert (out / "fig5_similarity_histograms.png").stat().st_size > 10_000
  assert not (out / "fig1_decision_boundaries.png").exists()
  with open(out / "fig5_similarity_histograms.json") as f:
    saved = json.load(f)
  assert list(saved["panels"]) == ["circle", "same"]
  panel = saved["panels"]["circle"]
  recipe_checks.assert_loss_recipe(panel["loss"], {
      "name": "circle", "margin": 0.4, "gamma": 80.0, "geometry": "cosine",
      "c": 0.1, "r": 2.3})
  assert (panel["dataset"], panel["split"]) == ("digits", "test")
  assert (panel["checkpoint"], panel["step"]) == ("best", 6)
  # The embeddings are those the run was evaluated with: same recall@1.
  emb, labels, _ = cf.embed_run(workdir)
  assert emb.shape == (panel["num_images"], 4) == (896, 4)
  got = evaluation.retrieval_metrics(emb, labels, ks=(1,))
  assert float(got["recall@1"]) == pytest.approx(
      result["final"]["recall@1"], abs=1.5 / len(labels))
  # Pair counts from the class sizes; histograms and moments from a float64
  # row-by-row loop; the rank statistic from scipy's Mann-Whitney ranks.
  sizes = np.bincount(labels)
  n = len(labels)
  assert panel["num_pos"] == int(np.sum(sizes * (sizes - 1) // 2))
  assert panel["num_pos"] + panel["num_neg"] == n * (n - 1) // 2
  x = np.asarray(emb, np.float64)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  edges = np.array(panel["bins"])
  pos, neg = [], []
  for i in range(n - 1):
    s = np.clip(x[i + 1:] @ x[i], -1.0, 1.0)
    same = labels[i + 1:] == labels[i]
    pos.append(s[same])
    neg.append(s[~same])
  pos, neg = np.concatenate(pos), np.concatenate(neg)
  assert panel["pos_counts"] == np.histogram(pos, edges)[0].tolist()
  assert panel["neg_counts"] == np.histogram(neg, edges)[0].tolist()
  assert panel["mean_pos"] == pytest.approx(pos.mean(), abs=1e-10)
  assert panel["mean_neg"] == pytest.approx(neg.mean(), abs=1e-10)
  ranks = scipy_stats.rankdata(np.concatenate([pos, neg]))
  auc = (ranks[:pos.size].sum() - pos.size * (pos.size + 1) / 2) / (
      pos.size * neg.size)
  assert panel["neg_above_pos"] == pytest.approx(1.0 - auc, abs=1e-9)
  assert saved["panels"]["same"]["pos_counts"] == panel["pos_counts"]
  h_n, h_p = pairs.hardest_pairs(emb, labels)
  np.testing.assert_allclose(panel["anchor_hardest_s_n"], h_n, atol=1e-6)
  np.testing.assert_allclose(panel["anchor_hardest_s_p"], h_p, atol=1e-6)
  assert panel["anchors_separated"] == pytest.approx(np.mean(h_p > h_n))


# The committed Fig. 5 analogue: trained runs cannot be rerun in a test, so
# check that its numbers are consistent with the Omniglot-small test split
# (106 characters x 20 drawers, every unordered pair once) and with each other,
# and that the README quotes them as they are.
OMNIGLOT_TEST_CLASSES, OMNIGLOT_DRAWERS = 106, 20


@pytest.fixture(scope="module")
def fig5():
  return _load("fig5_similarity_histograms")


def test_committed_fig5_counts_every_test_pair_once(fig5):
  assert list(fig5["panels"]) == ["circle", "cosface", "triplet"]
  n = OMNIGLOT_TEST_CLASSES * OMNIGLOT_DRAWERS
  for name, p in fig5["panels"].items():
    assert p["loss"]["name"] == name
    assert (p["dataset"], p["split"], p["num_images"]) == (
        "omniglot_small", "test", n)
    assert p["num_pos"] == OMNIGLOT_TEST_CLASSES * math.comb(
        OMNIGLOT_DRAWERS, 2)
    assert p["num_pos"] + p["num_neg"] == math.comb(n, 2)
    assert sum(p["pos_counts"]) == p["num_pos"]
    assert sum(p["neg_counts"]) == p["num_neg"]
    assert len(p["anchor_hardest_s_n"]) == len(p["anchor_hardest_s_p"]) == n


def test_committed_fig5_summaries_agree_with_its_histograms(fig5):
  for p in fig5["panels"].values():
    edges = np.array(p["bins"])
    centres = (edges[:-1] + edges[1:]) / 2
    width = np.max(np.diff(edges))
    for key in ("pos", "neg"):
      counts = np.array(p[f"{key}_counts"], np.float64)
      # The binned mean is within half a bin of the exact one.
      binned = float(counts @ centres / counts.sum())
      assert abs(binned - p[f"mean_{key}"]) <= width / 2, key
      assert 0 < p[f"std_{key}"] < 1
    pos = np.array(p["pos_counts"]) / p["num_pos"]
    neg = np.array(p["neg_counts"]) / p["num_neg"]
    assert p["histogram_overlap"] == pytest.approx(
        np.minimum(pos, neg).sum(), abs=1e-9)
    # P(s_n > s_p) is exact; the binned histograms bound it: pairs in
    # different bins are ordered by their bins, pairs sharing a bin may go
    # either way.
    lower_cdf_pos = np.concatenate([[0.0], np.cumsum(pos)[:-1]])
    strictly = float(neg @ lower_cdf_pos)
    assert strictly <= p["neg_above_pos"] <= strictly + float(neg @ pos)
    h_n = np.array(p["anchor_hardest_s_n"], np.float64)
    h_p = np.array(p["anchor_hardest_s_p"], np.float64)
    assert p["anchors_separated"] == pytest.approx(np.mean(h_p > h_n),
                                                   abs=1e-3)
    # The hardest pairs are pairs: within the range of all pairs.
    assert h_n.max() <= edges[np.nonzero(p["neg_counts"])[0][-1] + 1] + 1e-6
    assert h_p.min() >= edges[np.nonzero(p["pos_counts"])[0][0]] - 1e-6


def test_readme_quotes_the_committed_fig5_numbers(fig5):
  with open(os.path.join(RESULTS, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  for row in cf.fig5_table(fig5):
    assert row in readme, row
