"""NCA loss: a hand-computed case, pytorch-metric-learning 2.9's value and
gradient, a float64 loop reference with miner masks, every engine."""

import jax.numpy as jnp
import numpy as np
import pytest
from tests.grad_check import check_grads

from circle_jax import losses
from tests.losses import pml_checks

# Slow (value and gradient against PML on every engine, 8 simulated devices):
# not in the fast tier (CONTRIBUTING.md); CI runs it.
pytestmark = pytest.mark.slow

pml = pytest.importorskip("pytorch_metric_learning.losses")

X, Y = pml_checks.batch(seed=1), pml_checks.LABELS


def nca_ref(x, y, scale, pos_mask=None, neg_mask=None, d=None):
  """Goldberger et al.'s NCA, anchor by anchor, float64 (``d``: the
  distances, default those of the normalised rows)."""
  z = x / np.linalg.norm(x, axis=1, keepdims=True)
  if d is None:
    d = np.linalg.norm(z[:, None] - z[None], axis=2)
  terms = []
  for i in range(len(y)):
    num = den = 0.0
    for j in range(len(y)):
      if j == i:
        continue
      w = np.exp(-scale * d[i, j] ** 2)
      if y[j] == y[i] and (pos_mask is None or pos_mask[i, j]):
        num += w
        den += w
      elif y[j] != y[i] and (neg_mask is None or neg_mask[i, j]):
        den += w
    if num > 0:
      terms.append(-np.log(num / den))
  return np.mean(terms) if terms else 0.0


def test_hand_computed():
  x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
  got = losses.nca_loss(x, jnp.array([0, 0, 1]))
  # anchor 0: d2 = 2 to its positive, 0 to its negative; anchor 1: 2 and 2;
  # anchor 2 has no positive.
  want = (np.log1p(np.exp(2.0)) + np.log(2.0)) / 2
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 0.3, 4.0])
def test_equals_pytorch_metric_learning(scale):
  want = pml_checks.pml_vg(pml.NCALoss(softmax_scale=scale), X, Y)
  got = pml_checks.vg(losses.nca_loss, X, Y, softmax_scale=scale)
  pml_checks.close(got, want)
  np.testing.assert_allclose(want[0], nca_ref(X, Y, scale), rtol=1e-10)


def test_the_defaults_are_pmls():
  assert losses.get_loss("nca").defaults == {"softmax_scale": 1.0}
  assert pml.NCALoss().softmax_scale == 1.0


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_every_engine_equals_the_dense_one(scale):
  runs = pml_checks.engines(losses.nca_loss, X, Y, softmax_scale=scale)
  for name, got in runs.items():
    pml_checks.close(got, runs["dense"])
  pml_checks.close(runs["dense"],
                   pml_checks.pml_vg(pml.NCALoss(softmax_scale=scale), X, Y))


def test_reference_embeddings_equal_pmls_ref_emb():
  mem = pml_checks.batch(seed=2, n=8)
  mem_y = np.array([0, 1, 2, 3, 0, 1, 7, 7])
  want = pml_checks.pml_vg(pml.NCALoss(), X, Y, mem, mem_y)
  for got in pml_checks.with_references(losses.nca_loss, X, Y, mem, mem_y):
    pml_checks.close(got, want)


def test_miner_masks_restrict_the_sets():
  rng = np.random.default_rng(3)
  pm, nm = (rng.random((16, 16)) < 0.6 for _ in range(2))
  want = nca_ref(X, Y, 2.0, pm, nm)
  runs = pml_checks.masked(losses.nca_loss, X, Y, pm, nm, softmax_scale=2.0)
  for got in runs:
    np.testing.assert_allclose(float(got[0]), want, rtol=2e-5)
    pml_checks.close(got, runs[0])


def test_no_positive_gives_zero_loss_and_zero_gradient():
  pml_checks.zero_everywhere(losses.nca_loss, X, np.arange(16))


def test_check_grads():
  x = jnp.asarray(X[:8], jnp.float32)
  f = lambda x: losses.nca_loss(x, jnp.asarray(Y[:8]), softmax_scale=2.0)
  check_grads(f, (x,), order=1, modes=("rev",), eps=1e-2, atol=2e-2,
              rtol=2e-2)


@pytest.mark.parametrize("kw,match", [
    ({"softmax_scale": -1.0}, r"softmax_scale.*\[1e-06, 10000\]"),
    ({"softmax_scale": 1e5}, r"softmax_scale"),
])
def test_bad_hyperparameters_are_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as err:
    losses.nca_loss(jnp.asarray(X), jnp.asarray(Y), **kw)
  assert "\n" not in str(err.value)


def test_bad_embeddings_are_one_line():
  with pytest.raises(ValueError) as err:
    losses.nca_loss(jnp.ones(4), jnp.arange(4))
  assert "\n" not in str(err.value)


def test_takes_the_poincare_ball():
  ball = losses.Poincare(c=0.5, r=2.0)
  got = losses.nca_loss(jnp.asarray(X, jnp.float32), jnp.asarray(Y),
                        geometry=ball)
  want = nca_ref(X, Y, 1.0, d=pml_checks.ball_distances(X, ball))
  np.testing.assert_allclose(float(got), want, rtol=1e-4)
