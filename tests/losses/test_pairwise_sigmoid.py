"""Tests of the pairwise sigmoid loss (circle_jax/losses/pairwise_sigmoid.py);
the checks it shares with SupCon, NT-Xent and pairwise CE are in
engine/test_dispatch.py, engine/test_backward.py and engine/test_sides.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses.engine import cases
from tests.losses.engine.cases import FAMILY_LABELS as LABELS
from tests.losses.engine.cases import family_batch
from tests.losses.engine.cases import family_vg as vg


@pytest.mark.parametrize("t,b", [(1e4, -1e4), (1e-6, 1e4), (10.0, -10.0)])
def test_sigmoid_range_ends_stay_finite(t, b):
  x, labels = family_batch(seed=6), jnp.asarray(LABELS)
  for bs in (None, 4):
    value, grad = vg(losses.pairwise_sigmoid_loss, x, labels, t=t, b=b,
                      block_size=bs)
    assert np.isfinite(float(value)) and np.all(np.isfinite(grad))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["pairwise_sigmoid", "pairwise_sigmoid_poincare"])
def test_value_and_gradient_equal_the_float64_reference(case):
  cases.check_family_float64_reference(case)
