"""The shared ``geometry`` option on every pair loss.

Each registered pair loss with ``geometry=Poincare(c, r)`` equals its own
matrix form (``*_from_similarity`` / ``*_from_distance``) on the float64
Poincaré distances of Hyp-ViT's Möbius formula; the tiled engines
(blockwise, and the ring on 8 simulated devices) equal the dense one; names
resolve, and a bad geometry is a one-line error.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses.engine_checks import close as close_to
from tests.losses.reference import mobius_distance_ref, poincare_ref
from tests.losses.engine.cases import family_sharded_vg as sharded_vg
from tests.losses.engine.cases import family_vg as vg

# Slow (every engine compiled per rule): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

# 16 samples, 2 per device; label 9 has no positive.
LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 4, 9, 0], np.int32)
B = len(LABELS)
BALL = losses.Poincare(c=0.5, r=2.0)


def _x(seed=0):
  return np.random.default_rng(seed).normal(size=(B, 5)).astype(np.float32)


def _distance_ref(x):
  z = poincare_ref(x, BALL.c, BALL.r)
  d = mobius_distance_ref(z, z, BALL.c)
  np.fill_diagonal(d, 0.0)
  return d


# name -> (embedding form, hyperparameters, matrix form, "similarity" or
# "distance"): the distance forms take d, the similarity forms -d.
CASES = {
    "circle": (losses.circle_loss, dict(margin=0.25, gamma=4.0),
               losses.circle_loss_from_similarity, "similarity"),
    "unified": (losses.unified_loss, dict(margin=0.25, gamma=4.0),
                losses.unified_loss_from_similarity, "similarity"),
    "multi_similarity": (losses.multi_similarity_loss, dict(epsilon=10.0),
                         losses.multi_similarity_loss_from_similarity,
                         "similarity"),
    "ranked_list": (losses.ranked_list_loss, dict(alpha=1.8, margin=0.4),
                    losses.ranked_list_loss_from_distance, "distance"),
    "contrastive": (losses.contrastive_loss,
                    dict(pos_margin=0.2, neg_margin=1.9),
                    losses.contrastive_loss_from_distance, "distance"),
    "triplet_batch_hard": (losses.triplet_margin_loss,
                           dict(margin=0.3, mining="batch_hard"),
                           losses.triplet_margin_loss_from_distance,
                           "distance"),
    "triplet_all": (losses.triplet_margin_loss, dict(margin=0.3, mining="all"),
                    losses.triplet_margin_loss_from_distance, "distance"),
    "lifted_structure": (losses.lifted_structure_loss, dict(margin=1.0),
                         losses.lifted_structure_loss_from_distance,
                         "distance"),
    "n_pair": (losses.n_pair_loss, dict(l2_reg=0.0),
               losses.n_pair_loss_from_similarity, "similarity"),
}


def _registry_name(case):
  return case.split("_batch_hard")[0].split("_all")[0]


def test_every_pair_loss_takes_the_option():
  pair = {n for n, e in losses.LOSSES.items() if e.kind == "pair"
          and n != "vicreg"}  # VICReg compares no pairs: no geometry
  assert all(losses.LOSSES[n].geometry for n in pair)
  assert "geometry" in losses.engine.OPTIONS
  # Every pair loss is tested with the ball: here, in the margin test below
  # and (the contrastive family) in their own test files; TCM and PNP
  # in their own test files.
  assert {_registry_name(c) for c in CASES} | {
      "margin", "supcon", "nt_xent", "pairwise_ce", "pairwise_sigmoid",
      "smooth_ap", "fastap", "threshold_consistent_margin", "pnp"} | _ISSUE_40 == pair


# Issue #40's pair losses, each tested with the ball in its own test file
# (angular, tuplet_margin: on unit vectors only, which they check in one
# line).
_ISSUE_40 = {"nca", "generalized_lifted_structure", "intra_pair_variance",
             "snr_contrastive", "angular", "tuplet_margin"}
_ISSUE_40 |= {"instance", "histogram", "dynamic_soft_margin"}  # cosine only, checked in one line
_ISSUE_40 |= {"potential_field", "recall_at_k"}  # issue 41, own test files


@pytest.mark.parametrize("case", sorted(CASES))
def test_poincare_equals_the_matrix_form_on_float64_distances(case):
  fn, hyper, matrix_fn, kind = CASES[case]
  x = _x()
  d = _distance_ref(x)
  takes = inspect.signature(matrix_fn).parameters
  want = matrix_fn(jnp.asarray(-d if kind == "similarity" else d,
                               jnp.float32), jnp.asarray(LABELS),
                   **{k: v for k, v in hyper.items() if k in takes})
  got = fn(jnp.asarray(x), jnp.asarray(LABELS), geometry=BALL, **hyper)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-4, atol=1e-5)
  # The geometry changes the loss: the cosine value is another.
  cosine = fn(jnp.asarray(x), jnp.asarray(LABELS), **hyper)
  assert abs(float(cosine) - float(got)) > 1e-3


# The geometry is the tiles' similarity, the same for every rule: a one-pass
# rule on similarities and a two-stage rule on distances (with a column
# statistic) run it on every engine.
@pytest.mark.parametrize("case", ["circle", "lifted_structure"])
def test_poincare_runs_on_every_engine(case):
  fn, hyper, _, _ = CASES[case]
  x, labels = jnp.asarray(_x(seed=1)), jnp.asarray(LABELS)
  dense = vg(fn, x, labels, geometry=BALL, **hyper)
  assert np.all(np.isfinite(np.asarray(dense[1])))
  close_to(vg(fn, x, labels, geometry=BALL, block_size=5, **hyper), dense)
  close_to(sharded_vg(fn, x, labels, geometry=BALL, **hyper), dense)
  close_to(sharded_vg(fn, x, labels, geometry=BALL, collective="ring",
                     block_size=1, **hyper), dense)


def _smooth_ap_on(s, y, tau):
  """Smooth-AP of a float64 similarity matrix, every (i, j, k) by hand."""
  sig = lambda v: 0.5 * (1.0 + np.tanh(0.5 * v))
  losses_ = []
  for i in range(len(y)):
    pos = [j for j in range(len(y)) if j != i and y[j] == y[i]]
    cand = [k for k in range(len(y)) if k != i]
    if pos:
      ap = sum((1 + sum(sig((s[i, k] - s[i, j]) / tau) for k in pos if k != j))
               / (1 + sum(sig((s[i, k] - s[i, j]) / tau) for k in cand
                          if k != j)) for j in pos)
      losses_.append(1 - ap / len(pos))
  return float(np.mean(losses_))


def test_smooth_ap_on_the_ball_and_fastap_refusing_it():
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  got = losses.smooth_ap_loss(x, labels, tau=0.5, geometry=BALL,
                              block_size=5)
  want = _smooth_ap_on(-_distance_ref(_x()), LABELS, 0.5)
  np.testing.assert_allclose(float(got), want, rtol=1e-4)
  with pytest.raises(ValueError, match="only the cosine") as info:
    losses.fastap_loss(x, labels, geometry="poincare")
  assert "\n" not in str(info.value)


def test_margin_loss_with_the_ball_and_its_sampler_refused():
  beta = jnp.float32(1.2)
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  d = _distance_ref(_x())
  want = losses.margin_loss_from_distance(jnp.asarray(d, jnp.float32),
                                          labels, beta)
  got = losses.margin_loss(x, labels, beta, key=None, geometry=BALL)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-4)
  with pytest.raises(ValueError, match="unit vectors") as info:
    losses.margin_loss(x, labels, beta, key=jax.random.PRNGKey(0),
                       geometry=BALL)
  assert "\n" not in str(info.value)


def test_names_resolve_and_bad_geometries_are_one_line_errors():
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  by_name = losses.circle_loss(x, labels, geometry="poincare")
  by_object = losses.circle_loss(x, labels, geometry=losses.Poincare())
  assert float(by_name) == float(by_object)
  assert float(losses.circle_loss(x, labels, geometry="cosine")) == float(
      losses.circle_loss(x, labels))
  for bad, match in (("sphere", "must be one of"), (3, "must be a Geometry")):
    with pytest.raises(ValueError, match=match) as info:
      losses.multi_similarity_loss(x, labels, geometry=bad)
    assert "\n" not in str(info.value)
  with pytest.raises(ValueError, match="`r`"):
    losses.Poincare(r=-1.0)
  # Dot products have no distance: a distance loss names the fix.
  with pytest.raises(ValueError, match="no distance"):
    losses.contrastive_loss(x, labels, geometry="dot")


def test_registry_apply_builds_the_geometry_from_config_fields():
  entry = losses.get_loss("supcon")
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  got = entry.apply(x, labels, geometry="poincare", c=0.5, r=2.0)
  want = losses.supcon_loss(x, labels, geometry=BALL)
  assert float(got) == float(want)
  assert float(entry.apply(x, labels, geometry="cosine", c=0.5)) == float(
      losses.supcon_loss(x, labels))


# ----------------------------------------------------------------------------
# PML's distances as geometries (issue 40 item 5): "lp" and "snr".
# ----------------------------------------------------------------------------

LP_CASES = (dict(), dict(p=1.0), dict(p=3.0, power=2.0),
            dict(p=float("inf")), dict(normalize_embeddings=False, power=0.5))
SNR_CASES = (dict(), dict(power=2.0), dict(normalize_embeddings=False))


def test_lp_and_snr_equal_pml_distance_matrices():
  """Rows against other columns, float64 PML against our float32 tiles."""
  import torch
  from pytorch_metric_learning import distances as pml
  rng = np.random.default_rng(2)
  x, r = rng.normal(size=(6, 5)), rng.normal(size=(4, 5))
  for ours, theirs, cases in ((losses.Lp, pml.LpDistance, LP_CASES),
                              (losses.SNR, pml.SNRDistance, SNR_CASES)):
    for kw in cases:
      g = ours(**kw)
      want = theirs(**kw)(torch.tensor(x), torch.tensor(r)).numpy()
      got = g.to_distance(g.tile(g.embed(jnp.asarray(x, jnp.float32)),
                                 g.embed(jnp.asarray(r, jnp.float32))))
      np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5,
                                 atol=1e-6, err_msg=f"{ours.__name__} {kw}")
  # The registered names are the defaults; fields are checked.
  assert losses.engine.resolve_geometry("lp") == losses.Lp()
  assert losses.engine.resolve_geometry("snr") == losses.SNR()
  for bad in (dict(p=0.5), dict(power=0.0)):
    with pytest.raises(ValueError, match=next(iter(bad))) as info:
      losses.Lp(**bad)
    assert "\n" not in str(info.value)


def test_losses_on_lp_equal_pml_with_lp_distance():
  """Value and gradient of contrastive and triplet (all triplets) with
  ``geometry=Lp(...)`` equal PML's losses with the same LpDistance."""
  from pytorch_metric_learning import distances as pml_d
  from pytorch_metric_learning import losses as pml
  from tests.losses import pml_checks
  x = pml_checks.batch(seed=4)
  for kw in (dict(p=1.0, power=2.0), dict(normalize_embeddings=False)):
    dist = pml_d.LpDistance(**kw)
    cases = ((losses.contrastive_loss, dict(pos_margin=0.1, neg_margin=1.5),
              pml.ContrastiveLoss(pos_margin=0.1, neg_margin=1.5,
                                  distance=dist)),
             (losses.triplet_margin_loss, dict(margin=0.3, mining="all"),
              pml.TripletMarginLoss(margin=0.3, distance=dist)))
    for fn, hyper, peer in cases:
      want = pml_checks.pml_vg(peer, x, pml_checks.LABELS)
      got = pml_checks.vg(fn, x, pml_checks.LABELS, geometry=losses.Lp(**kw),
                          **hyper)
      pml_checks.close(got, want)


def test_lp_runs_on_every_engine():
  """The tile-by-tile p-norm (p = 3: the [R, C, D] differences) on the
  blockwise engine and the ring of 8 devices equals the dense one."""
  from tests.losses import pml_checks
  got = pml_checks.engines(losses.contrastive_loss, pml_checks.batch(seed=6),
                           pml_checks.LABELS, geometry=losses.Lp(p=3.0),
                           neg_margin=1.2)
  for name in ("blockwise", "all_gather", "ring"):
    pml_checks.close(got[name], got["dense"])


def test_config_fields_build_the_distance_geometries():
  entry = losses.get_loss("contrastive")
  assert {"p", "power", "normalize_embeddings", "c", "r"} <= set(
      entry.geometry_defaults())
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  got = entry.apply(x, labels, geometry="lp", p=1.0, power=2.0, c=0.5)
  want = losses.contrastive_loss(x, labels,
                                 geometry=losses.Lp(p=1.0, power=2.0))
  assert float(got) == float(want)
  assert float(entry.apply(x, labels, geometry="snr", power=2.0)) == float(
      losses.contrastive_loss(x, labels, geometry=losses.SNR(power=2.0)))
  with pytest.raises(ValueError, match="power"):
    entry.apply(x, labels, geometry="lp", power=-1.0)
  assert not losses.Lp(normalize_embeddings=False).head_normalizes
  assert losses.Lp().head_normalizes and losses.SNR().head_normalizes
