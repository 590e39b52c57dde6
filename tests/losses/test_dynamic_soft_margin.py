"""Dynamic soft margin loss: a hand-computed case, pytorch-metric-learning
2.9's value, gradient and running histogram (first and second step, other
hyperparameters, references, miner pairs, 8 devices), bad inputs."""

import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses import pml_checks

# Slow (value and gradient against PML, 8 simulated devices): not in the
# fast tier (CONTRIBUTING.md); CI runs it.
pytestmark = pytest.mark.slow

pml = pytest.importorskip("pytorch_metric_learning.losses")

X, Y = pml_checks.batch(seed=1), pml_checks.LABELS
OTHER = {"min_val": -2.5, "num_bins": 7, "momentum": 0.3}


def test_hand_computed():
  # One triplet: d_ap = sqrt(2), d_an = 0, delta = sqrt(2) in bin 8 of 10
  # (width 0.4 from -2), all of it in bins 8 and 9: CDF(bin 8) = 1 - alpha
  # with alpha = frac((sqrt(2) + 2) / 0.4).
  x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
  got = losses.dynamic_soft_margin_loss(x, jnp.array([0, 0, 1]),
                                        pos_mask=jnp.eye(3, k=1, dtype=bool),
                                        neg_mask=jnp.eye(3, k=2, dtype=bool))
  d = np.sqrt(2.0)
  alpha = (d + 2) / 0.4 - 8
  np.testing.assert_allclose(float(got), (1 - alpha) * d, rtol=1e-5)


def test_equals_pytorch_metric_learning_over_two_steps():
  x2 = pml_checks.batch(seed=2)
  for kw in ({}, OTHER):
    loss = pml.DynamicSoftMarginLoss(**kw)
    want = pml_checks.pml_vg(loss, X, Y)
    pml_checks.close(
        pml_checks.vg(losses.dynamic_soft_margin_loss, X, Y, **kw), want)
    hist = jnp.asarray(loss.hist_.detach().numpy(), jnp.float32)
    loss.hist_ = loss.hist_.detach()  # PML's bug (the module docstring)
    want = pml_checks.pml_vg(loss, x2, Y)
    step = lambda x, y, **k: losses.dynamic_soft_margin_step(x, y, hist,
                                                             **k)[0]
    pml_checks.close(pml_checks.vg(step, x2, Y, **kw), want)
    _, new = losses.dynamic_soft_margin_step(
        jnp.asarray(x2, jnp.float32), jnp.asarray(Y), hist, **kw)
    np.testing.assert_allclose(np.asarray(new), loss.hist_.detach().numpy(),
                               atol=1e-6)


def test_references_miner_pairs_and_devices_equal_pmls():
  mem = pml_checks.batch(seed=2, n=8)
  mem_y = np.array([0, 1, 2, 3, 0, 1, 7, 7])
  want = pml_checks.pml_vg(pml.DynamicSoftMarginLoss(), X, Y, mem, mem_y)
  got = pml_checks.vg(
      lambda x, y: losses.dynamic_soft_margin_loss(
          x, y, ref=losses.Candidates(jnp.asarray(mem, jnp.float32),
                                      jnp.asarray(mem_y))), X, Y)
  pml_checks.close((got[0], got[1]), (want[0], want[1][0]))
  rng = np.random.default_rng(3)
  pm, nm = (rng.random((16, 16)) < 0.5 for _ in range(2))
  want = pml_checks.pml_vg(
      pml.DynamicSoftMarginLoss(), X, Y, indices_tuple=pml_checks.pairs_of(
          pm & (Y[:, None] == Y) & ~np.eye(16, dtype=bool),
          nm & (Y[:, None] != Y)))
  got = pml_checks.vg(losses.dynamic_soft_margin_loss, X, Y,
                      pos_mask=jnp.asarray(pm), neg_mask=jnp.asarray(nm))
  pml_checks.close(got, want)
  want = pml_checks.pml_vg(pml.DynamicSoftMarginLoss(**OTHER), X, Y)
  pml_checks.close(pml_checks.sharded_dense(
      losses.dynamic_soft_margin_loss, X, Y, **OTHER), want)


def test_the_defaults_are_pmls():
  assert losses.get_loss("dynamic_soft_margin").defaults == {
      "min_val": -2.0, "num_bins": 10, "momentum": 0.01}
  loss = pml.DynamicSoftMarginLoss()
  assert (loss.min_val, loss.num_bins, loss.momentum) == (-2.0, 10, 0.01)


def test_no_triplet_gives_zero_loss_and_zero_gradient():
  value, grad = pml_checks.vg(losses.dynamic_soft_margin_loss, X,
                              np.arange(16))
  assert float(value) == 0.0
  np.testing.assert_array_equal(np.asarray(grad), 0.0)


@pytest.mark.parametrize("kw,match", [
    ({"num_bins": 1}, r"num_bins"),
    ({"momentum": 1.5}, r"momentum"),
    ({"min_val": 1.0}, r"min_val.*negative"),
    ({"block_size": 4}, r"only the dense engine \(each triplet's weight"),
    ({"geometry": "dot"}, r"cosine geometry"),
])
def test_bad_input_is_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as err:
    losses.dynamic_soft_margin_loss(jnp.asarray(X), jnp.asarray(Y), **kw)
  assert "\n" not in str(err.value)
