"""Tests of Smooth-AP (circle_jax/losses/smooth_ap.py); the checks it shares
with FastAP (references, tiles, devices, masks, memory) are in
test_ranking.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.grad_check import check_grads

from circle_jax import losses
from circle_jax.losses import engine
from tests.losses.reference import unit64, smooth_ap_ref
from tests.losses.engine import cases
from tests.losses.engine.cases import RANKING_LABELS as LABELS
from tests.losses.engine.cases import ranking_batch


def test_hand_computed_smooth_ap_is_the_exact_ap_at_a_small_temperature():
  # Unit vectors at 0, 60, 30 and 180 degrees, labels 0, 0, 1, 1. Ranks of
  # each anchor's one positive among its 3 candidates: 2, 2, 3, 2, so the
  # APs are 1/2, 1/2, 1/3, 1/2 and the loss 1 - (11/6) / 4 = 13/24.
  angles = np.deg2rad([0.0, 60.0, 30.0, 180.0])
  x = np.stack([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
  y = np.array([0, 0, 1, 1])
  for bs in (None, 1, 3):
    got = float(losses.smooth_ap_loss(x, y, tau=1e-3, block_size=bs))
    np.testing.assert_allclose(got, 13 / 24, rtol=1e-6)


def test_smooth_ap_takes_another_geometry():
  x, labels = ranking_batch(seed=11), jnp.asarray(LABELS)
  # Ranking is invariant to a positive scale of the similarity: the raw
  # inner products of vectors of one norm rank as their cosines.
  x = x / np.linalg.norm(x, axis=1, keepdims=True) * 3.0
  dot = losses.smooth_ap_loss(x, labels, tau=0.9, geometry=engine.DOT)
  cos = losses.smooth_ap_loss(x, labels, tau=0.1)
  np.testing.assert_allclose(float(dot), float(cos), rtol=1e-5)


def _official_smooth_ap(x, y, tau):
  """The official code's sets: the anchor is its own positive and one of
  the candidates; only k = j is left out of each rank."""
  s = unit64(x) @ unit64(x).T
  sig = lambda v: 0.5 * (1.0 + np.tanh(0.5 * v))
  aps = []
  for i in range(len(y)):
    group = [j for j in range(len(y)) if y[j] == y[i]]
    ap = 0.0
    for j in group:
      num = 1 + sum(sig((s[i, k] - s[i, j]) / tau) for k in group if k != j)
      den = 1 + sum(sig((s[i, k] - s[i, j]) / tau) for k in range(len(y))
                    if k != j)
      ap += num / den
    aps.append(ap / len(group))
  return 1.0 - np.mean(aps)


def test_what_pytorch_metric_learning_computes():
  # PML 2.9.0's SmoothAPLoss is the official form (anchor included) when
  # the batch has as many classes as samples per class, and groups the
  # batch by the class count otherwise; ours is the paper's sets.
  torch = pytest.importorskip("torch")
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  for classes, per_class, same in ((4, 4, True), (2, 3, False)):
    y = np.repeat(np.arange(classes), per_class)
    x = ranking_batch(seed=13, n=len(y))
    want = pml.SmoothAPLoss(temperature=0.1)(
        torch.tensor(x), torch.tensor(y)).item()
    official = _official_smooth_ap(x, y, 0.1)
    assert np.isclose(want, official, rtol=1e-5) == same
    ours = float(losses.smooth_ap_loss(x, jnp.asarray(y), tau=0.1))
    np.testing.assert_allclose(ours, smooth_ap_ref(x, y, 0.1), rtol=2e-5)
    assert not np.isclose(ours, official)


def test_reductions_of_its_anchor_terms_equal_the_loops():
  """``reduction`` on the anchors with a positive (``1 - AP_i``; PML's
  elements too, but its AP is the official grouping's, so the loops are
  the reference): a singleton anchor is no element."""
  from tests.losses import pml_checks
  from tests.losses import reference
  x, y = pml_checks.batch(10, n=10, d=4), np.array([0, 1, 2] * 3 + [3])
  terms = reference.per_anchor_ref(smooth_ap_ref, x, y, tau=0.1)
  pml_checks.reductions_equal_reference(
      lambda x, y, **kw: losses.smooth_ap_loss(x, y, tau=0.1, **kw),
      ((terms, np.arange(10) < 9),), x, y)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["smooth_ap", "smooth_ap_default"])
def test_value_and_gradient_equal_the_float64_reference(case):
  cases.check_ranking_float64_reference(case)


@pytest.mark.slow
def test_the_temperature_gradient_is_exact():
  x, labels = jnp.asarray(ranking_batch(seed=4)), jnp.asarray(LABELS)
  f = jax.jit(lambda tau: losses.smooth_ap_loss(x, labels, tau=tau,
                                                block_size=5))
  check_grads(f, (jnp.float32(0.3),), order=1, modes=("rev",), eps=1e-3,
              atol=2e-3, rtol=2e-3)
