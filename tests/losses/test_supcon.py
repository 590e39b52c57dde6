"""Tests of the supervised contrastive loss (circle_jax/losses/supcon.py); the
checks of the softmax it shares with NT-Xent and pairwise CE are here; the
contrastive family on every engine is in engine/test_dispatch.py,
engine/test_backward.py and engine/test_sides.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses.engine import cases
from tests.losses.engine.cases import FAMILY_B as B
from tests.losses.engine.cases import FAMILY_FNS as FNS
from tests.losses.engine.cases import FAMILY_LABELS as LABELS
from tests.losses.engine.cases import family_batch
from tests.losses.engine.cases import family_sharded_vg as sharded_vg
from tests.losses.engine.cases import family_vg as vg
from tests.losses.reference import loss_ref


def test_supcon_hand_computed_on_three_points():
  """Three unit vectors at 0, 60 and 90 degrees, labels (0, 0, 1), tau = 1:
  L_out of anchors 0 and 1 (anchor 2 has no positive and is left out):
  ``log(e^0.5 + e^0) - 0.5`` and ``log(e^0.5 + e^cos30) - 0.5``."""
  x = np.array([[1.0, 0.0], [0.5, np.sqrt(3) / 2], [0.0, 1.0]], np.float32)
  y = np.array([0, 0, 1])
  want = np.mean([np.log(np.exp(0.5) + 1.0) - 0.5,
                  np.log(np.exp(0.5) + np.exp(np.sqrt(3) / 2)) - 0.5])
  np.testing.assert_allclose(float(losses.supcon_loss(x, y, tau=1.0)), want,
                             rtol=1e-6)
  # The temperature divides every similarity: tau = 0.5 doubles them.
  want_half = np.mean([np.log(np.exp(1.0) + 1.0) - 1.0,
                       np.log(np.exp(1.0) + np.exp(np.sqrt(3))) - 1.0])
  np.testing.assert_allclose(float(losses.supcon_loss(x, y, tau=0.5)),
                             want_half, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["supcon", "supcon_poincare"])
def test_value_and_gradient_equal_the_float64_reference(case):
  cases.check_family_float64_reference(case)


# SupCon's softmax over the candidates is NT-Xent's and (through NT-Xent)
# the pairwise cross-entropy's: the checks of that shared part run on all
# three.


@pytest.mark.slow
@pytest.mark.parametrize("name", ["supcon", "nt_xent", "pairwise_ce"])
def test_no_positive_gives_zero_loss_and_zero_gradient(name):
  fn = FNS[name]
  labels = jnp.arange(B, dtype=jnp.int32)
  x = family_batch()
  for got in (vg(fn, x, labels), vg(fn, x, labels, block_size=3),
              sharded_vg(fn, x, labels, collective="ring", block_size=3)):
    assert float(got[0]) == 0.0
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["supcon", "nt_xent"])
def test_an_anchor_without_positives_adds_nothing(name):
  """Label 9's anchor only moves through the other anchors' denominators:
  masking its row out of every pair leaves the loss unchanged."""
  fn = FNS[name]
  x, labels = family_batch(), jnp.asarray(LABELS)
  row = np.ones((B, B), bool)
  row[14] = False
  np.testing.assert_allclose(
      float(fn(x, labels)),
      float(fn(x, labels, pos_mask=jnp.asarray(row),
               neg_mask=jnp.asarray(row))), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("tau", [1e-2, 1e-3])
@pytest.mark.parametrize("name", ["supcon", "nt_xent", "pairwise_ce"])
def test_small_temperatures_stay_finite_and_exact_under_jit(name, tau):
  fn = FNS[name]
  x, labels = family_batch(seed=6), jnp.asarray(LABELS)
  dense = vg(fn, x, labels, tau=tau)
  assert np.isfinite(float(dense[0]))
  assert np.all(np.isfinite(np.asarray(dense[1])))
  np.testing.assert_allclose(float(dense[0]),
                             loss_ref(name, x, LABELS, dict(tau=tau)),
                             rtol=1e-4)
  blockwise = vg(fn, x, labels, tau=tau, block_size=4)
  np.testing.assert_allclose(float(blockwise[0]), float(dense[0]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(blockwise[1]), np.asarray(dense[1]),
                             rtol=1e-3, atol=1e-3 * np.abs(dense[1]).max())
