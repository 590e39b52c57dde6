"""Tests of Hyp-ViT's pairwise cross-entropy (circle_jax/losses/pairwise_ce.py);
the checks it shares with SupCon, NT-Xent and the pairwise sigmoid (engines,
geometries, float64 references) are in engine/test_dispatch.py,
engine/test_backward.py, engine/test_sides.py and test_supcon.py."""

import inspect

import numpy as np
import pytest

from circle_jax import losses
from circle_jax.losses import pairwise_ce
from tests.losses.engine import cases

X = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
Y = np.array([0, 1, 2, 3, 0, 1, 2, 3])


def test_pairwise_ce_is_nt_xent_on_hyp_vits_ball_at_its_temperature():
  """The defaults are Hyp-ViT's: ``tau = 0.2`` and the ball of curvature
  0.1 clipped at radius 2.3; with them the loss is NT-Xent's rule."""
  assert inspect.signature(losses.pairwise_ce_loss).parameters[
      "tau"].default == pairwise_ce.PAIRWISE_CE_TAU == 0.2
  assert pairwise_ce.HYP_VIT_BALL == losses.Poincare(c=0.1, r=2.3)
  np.testing.assert_allclose(
      float(losses.pairwise_ce_loss(X, Y)),
      float(losses.nt_xent_loss(X, Y, tau=0.2,
                                geometry=losses.Poincare(c=0.1, r=2.3))),
      rtol=1e-6)


def test_pairwise_ce_in_sphere_mode_is_nt_xent():
  np.testing.assert_allclose(
      float(losses.pairwise_ce_loss(X, Y, tau=0.5, geometry="cosine")),
      float(losses.nt_xent_loss(X, Y, tau=0.5)), rtol=1e-6)
  # The ball changes the value (the test above can fail).
  assert abs(float(losses.pairwise_ce_loss(X, Y, tau=0.5))
             - float(losses.nt_xent_loss(X, Y, tau=0.5))) > 1e-3


def test_reductions_equal_the_loops_on_its_positive_pairs():
  """``reduction`` on the positive pairs (NT-Xent's terms; PML has no such
  loss), in sphere mode against the float64 loops."""
  from tests.losses import pml_checks
  from tests.losses import reference
  x, y = pml_checks.batch(4, n=12), np.array([0, 1, 2, 3] * 3)
  pml_checks.reductions_equal_reference(
      lambda x, y, **kw: losses.pairwise_ce_loss(x, y, geometry="cosine",
                                                 **kw),
      reference.nt_xent_terms_ref(x, y, 0.2), x, y,
      sets_of=lambda x: reference.nt_xent_terms_ref(x, y, 0.2))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["pairwise_ce", "pairwise_ce_cosine"])
def test_value_and_gradient_equal_the_float64_reference(case):
  cases.check_family_float64_reference(case)
