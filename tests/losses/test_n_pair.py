"""Tests of the N-pair loss (circle_jax/losses/n_pair.py); the checks shared by
the pair baselines are in engine/test_dispatch.py."""


import numpy as np
import pytest

from circle_jax import losses
from tests.losses.conftest import check_pair_case
from tests.losses.engine_checks import jitted


def test_n_pair_with_pair_layout_masks_is_sohn():
  # N pairs of N classes laid out [anchors; positives]: Sohn's eq. 6, where
  # anchor i's negatives are the other classes' positives.
  n, d = 5, 4
  rng = np.random.default_rng(9)
  f_a = rng.normal(size=(n, d))
  f_p = rng.normal(size=(n, d))
  x = np.concatenate([f_a, f_p]).astype(np.float32)
  y = np.concatenate([np.arange(n), np.arange(n)])
  pm = np.zeros((2 * n, 2 * n), bool)
  nm = np.zeros((2 * n, 2 * n), bool)
  for i in range(n):
    pm[i, n + i] = True
    nm[i, n:] = True
  sohn = np.mean([np.log1p(sum(np.exp(f_a[i] @ f_p[j] - f_a[i] @ f_p[i])
                               for j in range(n) if j != i))
                  for i in range(n)])
  got = jitted(losses.n_pair_loss)(x, y, l2_reg=0.0, pos_mask=pm, neg_mask=nm)
  np.testing.assert_allclose(float(got), sohn, rtol=1e-5)


def test_reductions_of_the_tuplet_term_equal_the_loops():
  """``reduction`` on the positive pairs (a pair's term its softplus over
  the anchor's negatives; PML's element is one positive per anchor and
  class, so the loops are the reference); the L2 penalty keeps its mean
  and ``"none"`` leaves it out."""
  from tests.losses import pml_checks
  from tests.losses import reference
  x, y = pml_checks.batch(5, n=12, d=4) / 2, np.array([0, 1, 2, 3] * 3)
  pml_checks.reductions_equal_reference(
      lambda x, y, **kw: losses.n_pair_loss(x, y, l2_reg=0.0, **kw),
      reference.n_pair_terms_ref(x, y), x, y,
      sets_of=lambda x: reference.n_pair_terms_ref(x, y))
  import jax
  got, terms = jax.jit(lambda x: [
      losses.n_pair_loss(x, y, l2_reg=0.5, reduction=r)
      for r in ("sum", "none")])(np.asarray(x, np.float32))
  sets = reference.n_pair_terms_ref(x, y)
  want = (reference.reduce_ref(sets, y, "sum")
          + 0.5 * np.mean(np.sum(x * x, 1)))
  np.testing.assert_allclose(float(got), want, rtol=2e-5)
  np.testing.assert_allclose(  # "none": the pair terms, no penalty
      np.asarray(terms), reference.reduce_ref(sets, y, "none"), rtol=2e-5,
      atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["n_pair", "n_pair_masked"])
def test_matches_float64_reference(case_values, name):
  check_pair_case(case_values, name)
