"""Intra-pair variance loss: a hand-computed case, pytorch-metric-learning
2.9's value and gradient (with and without a miner), a float64 loop
reference, every engine."""

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

X, Y = pml_checks.batch(seed=11), pml_checks.LABELS
FN = losses.intra_pair_variance_loss


def ipv_ref(x, y, pos_eps=0.01, neg_eps=0.01, pos_mask=None,
            neg_mask=None, sim=None):
  """Yu and Tao's intra-pair variance loss, pair by pair, float64 (``sim``:
  the similarities, default the cosines)."""
  z = x / np.linalg.norm(x, axis=1, keepdims=True)
  sim = z @ z.T if sim is None else sim
  sp, sn = [], []
  for a in range(len(y)):
    for j in range(len(y)):
      if j != a and y[j] == y[a] and (pos_mask is None or pos_mask[a, j]):
        sp.append(sim[a, j])
      if y[j] != y[a] and (neg_mask is None or neg_mask[a, j]):
        sn.append(sim[a, j])
  loss = 0.0
  if sp:
    mu = np.mean(sp)
    loss += np.mean([max((1 - pos_eps) * mu - s, 0.0) ** 2 for s in sp])
  if sn:
    mu = np.mean(sn)
    loss += np.mean([max(s - (1 + neg_eps) * mu, 0.0) ** 2 for s in sn])
  return loss


def test_hand_computed():
  x = jnp.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
  got = FN(x, jnp.array([0, 0, 1, 1]), pos_eps=0.0, neg_eps=0.0)
  # Positive pairs (both orders): s = 1, 1, 0.8, 0.8, mean 0.9, hinges
  # 0, 0, 0.1, 0.1: 0.02 / 4. Negative pairs: s = 0, 0.6, 0, 0.6 (twice),
  # mean 0.3, hinges 0, 0.3, 0, 0.3: 0.18 / 4.
  np.testing.assert_allclose(float(got), 0.005 + 0.045, rtol=1e-5)


@pytest.mark.parametrize("hyper", [{}, {"pos_eps": 0.2, "neg_eps": 0.05},
                                   {"pos_eps": 0.0, "neg_eps": 0.5}])
def test_equals_pytorch_metric_learning(hyper):
  want = pml_checks.pml_vg(pml.IntraPairVarianceLoss(**hyper), X, Y)
  np.testing.assert_allclose(want[0], ipv_ref(X, Y, **hyper), rtol=1e-10)
  pml_checks.close(pml_checks.vg(FN, X, Y, **hyper), want)


def test_the_gradient_equals_finite_differences_of_the_reference():
  got = pml_checks.vg(FN, X, Y, pos_eps=0.1)
  grad = engine_checks.grad_ref(lambda x: ipv_ref(x, Y, pos_eps=0.1), X)
  pml_checks.close(got, (ipv_ref(X, Y, pos_eps=0.1), grad))


def test_the_defaults_are_pmls():
  loss = pml.IntraPairVarianceLoss()
  assert losses.get_loss("intra_pair_variance").defaults == {
      "pos_eps": loss.pos_eps, "neg_eps": loss.neg_eps}


@pytest.mark.parametrize("hyper", [{}, {"pos_eps": 0.3, "neg_eps": 0.2}])
def test_every_engine_equals_the_dense_one(hyper):
  runs = pml_checks.engines(FN, X, Y, **hyper)
  for got in runs.values():
    pml_checks.close(got, runs["dense"])


def test_reference_embeddings_equal_pmls_ref_emb():
  mem = pml_checks.batch(seed=12, n=8)
  mem_y = np.array([0, 1, 2, 3, 0, 1, 7, 7])
  want = pml_checks.pml_vg(pml.IntraPairVarianceLoss(), X, Y, mem, mem_y)
  for got in pml_checks.with_references(FN, X, Y, mem, mem_y):
    pml_checks.close(got, want)


def test_miner_masks_equal_pmls_indices_tuple():
  rng = np.random.default_rng(13)
  same = Y[:, None] == Y[None, :]
  pm = (rng.random((16, 16)) < 0.5) & same & ~np.eye(16, dtype=bool)
  nm = (rng.random((16, 16)) < 0.5) & ~same
  want = pml_checks.pml_vg(pml.IntraPairVarianceLoss(neg_eps=0.1), X, Y,
                           indices_tuple=pml_checks.pairs_of(pm, nm))
  np.testing.assert_allclose(want[0], ipv_ref(X, Y, neg_eps=0.1,
                                              pos_mask=pm, neg_mask=nm),
                             rtol=1e-10)
  for got in pml_checks.masked(FN, X, Y, pm, nm, neg_eps=0.1):
    pml_checks.close(got, want)


def test_one_empty_set_adds_nothing():
  only_neg = pml_checks.vg(FN, X, np.arange(16))
  np.testing.assert_allclose(float(only_neg[0]), ipv_ref(X, np.arange(16)),
                             rtol=2e-5)
  assert float(only_neg[0]) > 0


def test_no_pairs_give_zero_loss_and_zero_gradient():
  mask = np.zeros((16, 16), bool)
  for got in pml_checks.masked(FN, X, Y, mask, mask):
    assert float(got[0]) == 0.0
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)


def test_check_grads():
  x = jnp.asarray(X[:8], jnp.float32)
  f = lambda x: FN(x, jnp.asarray(Y[:8]), pos_eps=0.2, neg_eps=0.2)
  check_grads(f, (x,), order=1, modes=("rev",), eps=1e-2, atol=2e-2,
              rtol=2e-2)


@pytest.mark.parametrize("kw,match", [
    ({"pos_eps": -0.1}, r"pos_eps.*\[0, 1\]"),
    ({"neg_eps": 2.0}, r"neg_eps.*\[0, 1\]"),
])
def test_bad_input_is_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as err:
    FN(jnp.asarray(X), jnp.asarray(Y), **kw)
  assert "\n" not in str(err.value)


def test_takes_the_poincare_ball():
  ball = losses.Poincare(c=0.5, r=2.0)
  got = FN(jnp.asarray(X, jnp.float32), jnp.asarray(Y), geometry=ball)
  want = ipv_ref(X, Y, sim=-pml_checks.ball_distances(X, ball))
  np.testing.assert_allclose(float(got), want, rtol=1e-4)


def test_reductions_equal_pmls_reducers_on_its_pairs():
  """``reduction``: PML's reducers on PML's own elements, the positive and
  the negative pairs, each set reduced on its own: value and gradient;
  ``"none"`` the ``[B, B]`` terms of both sets."""
  pml_checks.reductions_equal_pml(
      lambda x, y, **kw: losses.intra_pair_variance_loss(
          x, y, pos_eps=0.05, neg_eps=0.2, **kw),
      lambda r: pml.IntraPairVarianceLoss(pos_eps=0.05, neg_eps=0.2,
                                          reducer=r),
      pml_checks.batch(8), pml_checks.LABELS)
