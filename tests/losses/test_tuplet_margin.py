"""Tuplet margin loss: a hand-computed case, pytorch-metric-learning 2.9's
value and gradient (with and without a miner, with references), a float64
loop reference, every engine."""

import jax.numpy as jnp
import numpy as np
import pytest
from tests.grad_check import check_grads

from circle_jax import losses
from tests.losses import engine_checks
from tests.losses import pml_checks

# Slow (value and gradient against PML on every engine, 8 simulated devices):
# not in the fast tier (CONTRIBUTING.md); CI runs it.
pytestmark = pytest.mark.slow

pml = pytest.importorskip("pytorch_metric_learning.losses")

X, Y = pml_checks.batch(seed=17), pml_checks.LABELS
FN = losses.tuplet_margin_loss


def tuplet_ref(x, y, margin=5.73, scale=64.0, pos_mask=None, neg_mask=None):
  """Yu and Tao's eq. 3 pair by pair, with arccos, float64."""
  z = x / np.linalg.norm(x, axis=1, keepdims=True)
  beta = np.radians(margin)
  terms = []
  for a in range(len(y)):
    for p in range(len(y)):
      if p == a or y[p] != y[a] or (pos_mask is not None
                                    and not pos_mask[a, p]):
        continue
      shifted = np.cos(np.arccos(z[a] @ z[p]) - beta)
      inner = sum(np.exp(scale * (z[a] @ z[n] - shifted))
                  for n in range(len(y)) if y[n] != y[a]
                  and (neg_mask is None or neg_mask[a, n]))
      terms.append(np.log1p(inner))
  return np.mean(terms) if terms else 0.0


def test_hand_computed():
  x = jnp.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
  got = FN(x, jnp.array([0, 0, 1]), margin=30.0, scale=2.0)
  # both pairs: theta = 90 deg, cos(60 deg) = 0.5; negative cosines 1 - 1 = 0
  # for anchor 0 (s = -1) and 0 for anchor 1: log(1 + e^{2 (-1 - 0.5)}) and
  # log(1 + e^{2 (0 - 0.5)}).
  want = (np.log1p(np.exp(-3.0)) + np.log1p(np.exp(-1.0))) / 2
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


@pytest.mark.parametrize("hyper", [{}, {"margin": 20.0, "scale": 16.0},
                                   {"margin": 0.0, "scale": 4.0}])
def test_equals_pytorch_metric_learning(hyper):
  want = pml_checks.pml_vg(pml.TupletMarginLoss(**hyper), X, Y)
  np.testing.assert_allclose(want[0], tuplet_ref(X, Y, **hyper), rtol=1e-10)
  pml_checks.close(pml_checks.vg(FN, X, Y, **hyper), want)


def test_the_gradient_equals_finite_differences_of_the_reference():
  got = pml_checks.vg(FN, X, Y, scale=8.0)
  grad = engine_checks.grad_ref(lambda x: tuplet_ref(x, Y, scale=8.0), X)
  pml_checks.close(got, (tuplet_ref(X, Y, scale=8.0), grad))


def test_the_defaults_are_pmls():
  loss = pml.TupletMarginLoss()
  assert losses.get_loss("tuplet_margin").defaults == {"margin": 5.73,
                                                       "scale": loss.scale}
  np.testing.assert_allclose(loss.margin, np.radians(5.73))


@pytest.mark.parametrize("hyper", [{}, {"margin": 15.0, "scale": 10.0}])
def test_every_engine_equals_the_dense_one(hyper):
  runs = pml_checks.engines(FN, X, Y, **hyper)
  for got in runs.values():
    pml_checks.close(got, runs["dense"])


def test_reference_embeddings_equal_pmls_ref_emb():
  mem = pml_checks.batch(seed=18, n=8)
  mem_y = np.array([0, 1, 2, 3, 0, 1, 7, 7])
  want = pml_checks.pml_vg(pml.TupletMarginLoss(scale=16.0), X, Y, mem,
                           mem_y)
  for got in pml_checks.with_references(FN, X, Y, mem, mem_y, scale=16.0):
    pml_checks.close(got, want)


def test_miner_masks_equal_pmls_indices_tuple():
  rng = np.random.default_rng(19)
  same = Y[:, None] == Y[None, :]
  pm = (rng.random((16, 16)) < 0.5) & same & ~np.eye(16, dtype=bool)
  nm = (rng.random((16, 16)) < 0.5) & ~same
  want = pml_checks.pml_vg(pml.TupletMarginLoss(scale=16.0), X, Y,
                           indices_tuple=pml_checks.pairs_of(pm, nm))
  np.testing.assert_allclose(want[0], tuplet_ref(X, Y, scale=16.0,
                                                 pos_mask=pm, neg_mask=nm),
                             rtol=1e-10)
  for got in pml_checks.masked(FN, X, Y, pm, nm, scale=16.0):
    pml_checks.close(got, want)


@pytest.mark.parametrize("labels", [np.arange(16), np.zeros(16, np.int32)])
def test_no_positive_or_no_negative_gives_zero_loss_and_gradient(labels):
  pml_checks.zero_everywhere(FN, X, labels)


def test_check_grads():
  x = jnp.asarray(X[:8], jnp.float32)
  f = lambda x: FN(x, jnp.asarray(Y[:8]), scale=4.0)
  check_grads(f, (x,), order=1, modes=("rev",), eps=1e-2, atol=2e-2,
              rtol=2e-2)


@pytest.mark.parametrize("kw,match", [
    ({"margin": -1.0}, r"margin.*\[0, 90\]"),
    ({"scale": 0.0}, r"scale.*\[1e-06, 10000\]"),
    ({"geometry": "dot"}, "unit vectors"),
])
def test_bad_input_is_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as err:
    FN(jnp.asarray(X), jnp.asarray(Y), **kw)
  assert "\n" not in str(err.value)


def test_reductions_equal_pmls_reducers_on_its_positive_pairs():
  """``reduction``: PML's reducers on PML's own elements, the ordered
  positive pairs: value and gradient; ``"none"`` the ``[B, B]`` terms."""
  pml_checks.reductions_equal_pml(
      lambda x, y, **kw: losses.tuplet_margin_loss(x, y, margin=8.0,
                                                   scale=16.0, **kw),
      lambda r: pml.TupletMarginLoss(margin=8.0, scale=16.0, reducer=r),
      pml_checks.batch(2), pml_checks.LABELS)
