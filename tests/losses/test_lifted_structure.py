"""Tests of the lifted structure loss (circle_jax/losses/lifted_structure.py);
the checks shared by the pair baselines are in engine/test_dispatch.py."""


import numpy as np
import pytest
from tests.losses.conftest import DPN, S2, check_pair_case



def test_lifted_hand_computed(tiny):
  # One unordered positive pair (a, p): N_a = {n}, N_p = {n}.
  j = np.log(np.exp(1.0 - S2) + np.exp(1.0 - DPN)) + 1.0
  np.testing.assert_allclose(tiny["lifted"], j**2 / 2, rtol=1e-5)


# Slow (8 simulated devices, four engines): CI runs it.
@pytest.mark.slow
def test_pos_margin_equals_pytorch_metric_learning_on_every_engine():
  from circle_jax import losses
  from tests.losses import pml_checks
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  x, y = pml_checks.batch(seed=1), pml_checks.LABELS
  want = pml_checks.pml_vg(
      pml.LiftedStructureLoss(neg_margin=0.8, pos_margin=0.3), x, y)
  runs = pml_checks.engines(losses.lifted_structure_loss, x, y, margin=0.8,
                            pos_margin=0.3)
  for got in runs.values():
    pml_checks.close(got, want)
  assert pml.LiftedStructureLoss().pos_margin == losses.get_loss(
      "lifted_structure").defaults["pos_margin"]


def test_reductions_equal_pmls_reducers_on_its_positive_pairs():
  """``reduction``: PML's reducers on PML's own elements, the ordered
  positive pairs (a term ``[J]_+^2 / 2``): value and gradient; ``"none"``
  the ``[B, B]`` pair terms."""
  import functools
  from circle_jax import losses
  from tests.losses import pml_checks
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  pml_checks.reductions_equal_pml(
      functools.partial(losses.lifted_structure_loss, margin=1.3,
                        pos_margin=0.1),
      lambda r: pml.LiftedStructureLoss(neg_margin=1.3, pos_margin=0.1,
                                        reducer=r),
      pml_checks.batch(1), pml_checks.LABELS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lifted", "lifted_masked"])
def test_matches_float64_reference(case_values, name):
  check_pair_case(case_values, name)
