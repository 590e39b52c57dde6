"""Tests of FastAP (circle_jax/losses/fastap.py); the checks it shares with
Smooth-AP (references, tiles, devices, masks, memory) are in
test_ranking.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses.engine import cases
from tests.losses.engine.cases import RANKING_LABELS as LABELS
from tests.losses.engine.cases import ranking_close as close
from tests.losses.engine.cases import ranking_batch
from tests.losses.engine.cases import ranking_vg


def test_hand_computed_fastap_on_bin_centres():
  # L = 2: centres 0, 2, 4. x0 = x1 = e1 (label 0), x2 = e2, x3 = -e2
  # (label 1). Anchors 0, 1: the positive at d = 0, the negatives at d = 2:
  # FastAP 1. Anchors 2, 3: the positive at d = 4, the negatives at 2:
  # h+ = (0, 0, 1), H = (0, 2, 3): FastAP 1/3. Loss 1 - (8/3) / 4 = 1/3.
  x = np.array([[1, 0], [1, 0], [0, 1], [0, -1]], np.float32)
  y = np.array([0, 0, 1, 1])
  for bs in (None, 1, 3):
    got = float(losses.fastap_loss(x, y, L=2, block_size=bs))
    np.testing.assert_allclose(got, 1 / 3, rtol=1e-6)


def test_fastap_equals_pytorch_metric_learning():
  torch = pytest.importorskip("torch")
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  x, labels = ranking_batch(seed=12), LABELS
  xt = torch.tensor(x, requires_grad=True)
  want = pml.FastAPLoss(num_bins=10)(xt, torch.tensor(labels, dtype=torch.int64))
  want.backward()
  got = ranking_vg(losses.fastap_loss, x, jnp.asarray(labels), block_size=5)
  close(got, (want.item(), xt.grad.numpy()))


def test_reductions_equal_pmls_reducers_on_its_anchors():
  """``reduction``: PML's reducers on PML's own elements, the anchors with
  a positive (``1 - FastAP_i``): value and gradient; ``"none"`` the
  ``[B]`` terms (0 for an anchor without a positive)."""
  from tests.losses import pml_checks
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  pml_checks.reductions_equal_pml(
      lambda x, y, **kw: losses.fastap_loss(x, y, L=6, **kw),
      lambda r: pml.FastAPLoss(num_bins=6, reducer=r),
      pml_checks.batch(11), pml_checks.LABELS)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fastap", "fastap_coarse"])
def test_value_and_gradient_equal_the_float64_reference(case):
  cases.check_ranking_float64_reference(case)
