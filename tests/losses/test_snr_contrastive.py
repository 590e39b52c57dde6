"""SNR contrastive loss and the SNR geometry: a hand-computed distance,
pytorch-metric-learning 2.9's value and gradient (with and without a miner,
with references), a float64 loop reference, every engine."""

import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses import engine_checks
from tests.losses import pml_checks

# Slow (value and gradient against PML on every engine, 8 simulated devices):
# not in the fast tier (CONTRIBUTING.md); CI runs it.
pytestmark = pytest.mark.slow

pml = pytest.importorskip("pytorch_metric_learning.losses")
pml_distances = pytest.importorskip("pytorch_metric_learning.distances")

X, Y = pml_checks.batch(seed=14), pml_checks.LABELS
FN = losses.snr_contrastive_loss


def snr_ref(x, y=None):
  """``var(x_i - x_j) / var(x_i)`` of the normalised rows, float64."""
  z = x / np.linalg.norm(x, axis=1, keepdims=True)
  y = z if y is None else y / np.linalg.norm(y, axis=1, keepdims=True)
  return np.array([[np.var(a - b, ddof=1) / np.var(a, ddof=1) for b in y]
                   for a in z])


def snr_contrastive_ref(x, y, pos_margin=0.0, neg_margin=1.0, d=None):
  """Two-margin contrastive on the SNR distance (or ``d``), averaged over
  the non-zero terms of each set, float64."""
  d = snr_ref(x) if d is None else d
  lp, ln = [], []
  for i in range(len(y)):
    for j in range(len(y)):
      if i != j and y[i] == y[j]:
        lp.append(max(d[i, j] - pos_margin, 0.0))
      elif y[i] != y[j]:
        ln.append(max(neg_margin - d[i, j], 0.0))
  mean_nz = lambda v: np.mean([t for t in v if t > 0]) if any(
      t > 0 for t in v) else 0.0
  return mean_nz(lp) + mean_nz(ln)


def test_the_geometry_is_the_snr_distance():
  # x = (1, 0), y = (0, 1): var(x - y) / var(x) = 2 / 0.5 = 4.
  s = losses.SNR().tile(jnp.array([[1.0, 0.0]]), jnp.array([[0.0, 1.0]]))
  np.testing.assert_allclose(float(s[0, 0]), -4.0, rtol=1e-6)
  geo = losses.SNR()
  z = geo.embed(jnp.asarray(X, jnp.float32))
  want = pml_distances.SNRDistance()(*(pml_checks_torch(X),) * 2).numpy()
  np.testing.assert_allclose(-np.asarray(geo.tile(z, z)), want, atol=2e-5)
  np.testing.assert_allclose(want, snr_ref(X), rtol=1e-10, atol=1e-12)


def pml_checks_torch(x):
  import torch
  return torch.tensor(np.asarray(x, np.float64))


@pytest.mark.parametrize("hyper", [{}, {"pos_margin": 0.2, "neg_margin": 0.8},
                                   {"neg_margin": 1.3}])
def test_equals_pytorch_metric_learning(hyper):
  want = pml_checks.pml_vg(pml.SignalToNoiseRatioContrastiveLoss(**hyper), X,
                           Y)
  np.testing.assert_allclose(want[0], snr_contrastive_ref(X, Y, **hyper),
                             rtol=1e-10)
  pml_checks.close(pml_checks.vg(FN, X, Y, **hyper), want)


def test_the_gradient_equals_finite_differences_of_the_reference():
  got = pml_checks.vg(FN, X, Y, neg_margin=1.2)
  grad = engine_checks.grad_ref(
      lambda x: snr_contrastive_ref(x, Y, neg_margin=1.2), X)
  pml_checks.close(got, (snr_contrastive_ref(X, Y, neg_margin=1.2), grad))


def test_the_defaults_are_pmls():
  loss = pml.SignalToNoiseRatioContrastiveLoss()
  assert losses.get_loss("snr_contrastive").defaults == {
      "pos_margin": loss.pos_margin, "neg_margin": loss.neg_margin}


@pytest.mark.parametrize("hyper", [{}, {"pos_margin": 0.3}])
def test_every_engine_equals_the_dense_one(hyper):
  runs = pml_checks.engines(FN, X, Y, **hyper)
  for got in runs.values():
    pml_checks.close(got, runs["dense"])


def test_reference_embeddings_equal_pmls_ref_emb():
  mem = pml_checks.batch(seed=15, n=8)
  mem_y = np.array([0, 1, 2, 3, 0, 1, 7, 7])
  want = pml_checks.pml_vg(pml.SignalToNoiseRatioContrastiveLoss(), X, Y,
                           mem, mem_y)
  for got in pml_checks.with_references(FN, X, Y, mem, mem_y):
    pml_checks.close(got, want)


def test_miner_masks_equal_pmls_indices_tuple():
  rng = np.random.default_rng(16)
  same = Y[:, None] == Y[None, :]
  pm = (rng.random((16, 16)) < 0.5) & same & ~np.eye(16, dtype=bool)
  nm = (rng.random((16, 16)) < 0.5) & ~same
  want = pml_checks.pml_vg(pml.SignalToNoiseRatioContrastiveLoss(), X, Y,
                           indices_tuple=pml_checks.pairs_of(pm, nm))
  for got in pml_checks.masked(FN, X, Y, pm, nm):
    pml_checks.close(got, want)


def test_no_pairs_give_zero_loss_and_zero_gradient():
  mask = np.zeros((16, 16), bool)
  for got in pml_checks.masked(FN, X, Y, mask, mask):
    assert float(got[0]) == 0.0
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)


def test_another_loss_takes_the_snr_geometry_by_name():
  got = float(losses.contrastive_loss(jnp.asarray(X), jnp.asarray(Y),
                                      neg_margin=1.0, geometry="snr"))
  np.testing.assert_allclose(got, float(FN(jnp.asarray(X), jnp.asarray(Y))),
                             rtol=1e-6)


# No check_grads: the non-zero-term means jump where a hinge reaches 0 (the
# count changes), so float32 finite differences with a wide step straddle
# jumps; the float64 finite-difference test above checks the gradient.


@pytest.mark.parametrize("kw,match", [
    ({"pos_margin": -0.1}, r"pos_margin.*\[0, inf\)"),
    ({"neg_margin": -1.0}, r"neg_margin.*\[0, inf\)"),
])
def test_bad_input_is_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as err:
    FN(jnp.asarray(X), jnp.asarray(Y), **kw)
  assert "\n" not in str(err.value)


def test_takes_the_poincare_ball():
  ball = losses.Poincare(c=0.5, r=2.0)
  got = FN(jnp.asarray(X, jnp.float32), jnp.asarray(Y), geometry=ball,
           neg_margin=3.0)
  want = snr_contrastive_ref(X, Y, neg_margin=3.0,
                             d=pml_checks.ball_distances(X, ball))
  np.testing.assert_allclose(float(got), want, rtol=1e-4)
