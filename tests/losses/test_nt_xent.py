"""Tests of NT-Xent / InfoNCE (circle_jax/losses/nt_xent.py); the checks it
shares with SupCon, pairwise CE and the pairwise sigmoid (engines, geometries,
float64 references) are in engine/test_dispatch.py,
engine/test_backward.py, engine/test_sides.py and test_supcon.py."""

import numpy as np
import pytest

from circle_jax import losses
from tests.losses.engine import cases


def test_nt_xent_hand_computed_on_two_views_of_two_samples():
  """SimCLR's batch: views (0 and 30 degrees) of sample 0, (90 and 120) of
  sample 1, tau = 0.5; each anchor's one positive against every other
  view: ``-log(e^(s_ip / tau) / sum_(a != i) e^(s_ia / tau))``, averaged."""
  angles = np.radians([0.0, 90.0, 30.0, 120.0])
  x = np.stack([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
  y = np.array([0, 1, 0, 1])
  s = np.cos(angles[:, None] - angles[None, :]) / 0.5
  positive = {0: 2, 1: 3, 2: 0, 3: 1}
  want = np.mean([np.log(sum(np.exp(s[i, a]) for a in range(4) if a != i))
                  - s[i, p] for i, p in positive.items()])
  np.testing.assert_allclose(float(losses.nt_xent_loss(x, y, tau=0.5)), want,
                             rtol=1e-6)


def test_nt_xent_weighs_pairs_supcon_weighs_anchors():
  """With anchors of 2 and 1 positives the two reductions differ (NT-Xent:
  mean over positive pairs; SupCon: mean over anchors)."""
  angles = np.radians([0.0, 60.0, 120.0, 90.0, 200.0])
  x = np.stack([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
  y = np.array([0, 0, 0, 1, 1])
  a = float(losses.nt_xent_loss(x, y, tau=0.5))
  b = float(losses.supcon_loss(x, y, tau=0.5))
  assert abs(a - b) > 1e-3, (a, b)


def test_reductions_equal_pmls_reducers_on_its_positive_pairs():
  """``reduction``: PML's reducers on PML's own elements, the ordered
  positive pairs, with two views per label (with more, PML's denominator
  holds the pair's own positive only, ours every candidate): value and
  gradient; ``"none"`` the ``[B, B]`` terms."""
  import pytest
  from tests.losses import pml_checks
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  pml_checks.reductions_equal_pml(
      lambda x, y, **kw: losses.nt_xent_loss(x, y, tau=0.3, **kw),
      lambda r: pml.NTXentLoss(temperature=0.3, reducer=r),
      pml_checks.batch(3, n=12), np.arange(12) % 6)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["nt_xent", "nt_xent_poincare"])
def test_value_and_gradient_equal_the_float64_reference(case):
  cases.check_family_float64_reference(case)
