"""Generalised lifted structure loss: a hand-computed case,
pytorch-metric-learning 2.9's value and gradient, a float64 loop reference
with miner masks and empty sets, every engine."""

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

X, Y = pml_checks.batch(seed=8), pml_checks.LABELS
# Every anchor with a positive and a negative (PML's empty-set convention
# differs, see the docstring).
Y_FULL = np.where(Y == 5, 0, Y)
FN = losses.generalized_lifted_structure_loss


def gls_ref(x, y, neg_margin=1.0, pos_margin=0.0, pos_mask=None,
            neg_mask=None, dist=None):
  """Hermans et al.'s generalised lifted structure, anchor by anchor,
  float64; an anchor without a positive or a negative adds nothing."""
  z = x / np.linalg.norm(x, axis=1, keepdims=True)
  terms = []
  for a in range(len(y)):
    sp = sn = 0.0
    for j in range(len(y)):
      d = np.linalg.norm(z[a] - z[j]) if dist is None else dist[a, j]
      if j != a and y[j] == y[a] and (pos_mask is None or pos_mask[a, j]):
        sp += np.exp(d - pos_margin)
      if y[j] != y[a] and (neg_mask is None or neg_mask[a, j]):
        sn += np.exp(neg_margin - d)
    if sp > 0 and sn > 0:
      terms.append(max(np.log(sp) + np.log(sn), 0.0))
  return np.mean(terms) if terms else 0.0


def test_hand_computed():
  x = jnp.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
  got = FN(x, jnp.array([0, 0, 1]), neg_margin=2.0)
  # anchor 0: d_p = sqrt 2, d_n = 2; anchor 1: d_p = sqrt 2, d_n = sqrt 2.
  want = (np.sqrt(2) + 0.0 + np.sqrt(2) + 2 - np.sqrt(2)) / 2
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


@pytest.mark.parametrize("hyper", [{}, {"neg_margin": 0.5},
                                   {"neg_margin": 1.5, "pos_margin": 0.3}])
def test_equals_pytorch_metric_learning(hyper):
  want = pml_checks.pml_vg(pml.GeneralizedLiftedStructureLoss(**hyper), X,
                           Y_FULL)
  np.testing.assert_allclose(want[0], gls_ref(X, Y_FULL, **hyper),
                             rtol=1e-10)
  pml_checks.close(pml_checks.vg(FN, X, Y_FULL, **hyper), want)


def test_the_defaults_are_pmls():
  loss = pml.GeneralizedLiftedStructureLoss()
  assert losses.get_loss("generalized_lifted_structure").defaults == {
      "neg_margin": loss.neg_margin, "pos_margin": loss.pos_margin}


def test_pml_charges_an_anchor_without_positives():
  # PML's log-sum-exp of an empty set is 0 and its mean runs over every
  # anchor; ours leaves the anchor out (the paper never has one).
  want = pml_checks.pml_vg(pml.GeneralizedLiftedStructureLoss(), X, Y)[0]
  got = float(FN(jnp.asarray(X), jnp.asarray(Y)))
  np.testing.assert_allclose(got, gls_ref(X, Y), rtol=2e-5)
  assert abs(got - want) > 1e-3


@pytest.mark.parametrize("hyper", [{}, {"neg_margin": 0.2,
                                        "pos_margin": 0.1}])
def test_every_engine_equals_the_dense_one(hyper):
  runs = pml_checks.engines(FN, X, Y, **hyper)
  for got in runs.values():
    pml_checks.close(got, runs["dense"])
  np.testing.assert_allclose(float(runs["dense"][0]), gls_ref(X, Y, **hyper),
                             rtol=2e-5)


def test_reference_embeddings_equal_pmls_ref_emb():
  mem = pml_checks.batch(seed=9, n=8)
  mem_y = np.array([0, 1, 2, 3, 4, 5, 0, 1])
  want = pml_checks.pml_vg(pml.GeneralizedLiftedStructureLoss(), X, Y_FULL,
                           mem, mem_y)
  for got in pml_checks.with_references(FN, X, Y_FULL, mem, mem_y):
    pml_checks.close(got, want)


def test_miner_masks_equal_pmls_indices_tuple():
  rng = np.random.default_rng(10)
  same = Y_FULL[:, None] == Y_FULL[None, :]
  pm = (rng.random((16, 16)) < 0.6) & same & ~np.eye(16, dtype=bool)
  # every anchor keeps a positive and a negative
  pm[np.arange(16), (np.arange(16) + 5) % 15] = True
  nm = (rng.random((16, 16)) < 0.6) & ~same
  nm[np.arange(16), (np.arange(16) + 1) % 16] = True
  nm &= ~same
  assert (pm & same).any(1).all() and nm.any(1).all()
  want = pml_checks.pml_vg(pml.GeneralizedLiftedStructureLoss(), X, Y_FULL,
                           indices_tuple=pml_checks.pairs_of(pm, nm))
  np.testing.assert_allclose(want[0], gls_ref(X, Y_FULL, pos_mask=pm,
                                              neg_mask=nm), rtol=1e-10)
  for got in pml_checks.masked(FN, X, Y_FULL, pm, nm):
    pml_checks.close(got, want)


@pytest.mark.parametrize("labels", [np.arange(16), np.zeros(16, np.int32)])
def test_no_positive_or_no_negative_gives_zero_loss_and_gradient(labels):
  pml_checks.zero_everywhere(FN, X, labels)


def test_check_grads():
  x = jnp.asarray(X[:8], jnp.float32)
  f = lambda x: FN(x, jnp.asarray(Y_FULL[:8]), neg_margin=1.5)
  check_grads(f, (x,), order=1, modes=("rev",), eps=1e-2, atol=2e-2,
              rtol=2e-2)


@pytest.mark.parametrize("kw,match", [
    ({"neg_margin": -0.1}, r"neg_margin.*\[0, 2\]"),
    ({"pos_margin": 3.0}, r"pos_margin.*\[0, 2\]"),
    ({"geometry": "dot"}, "no distance"),
])
def test_bad_input_is_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as err:
    FN(jnp.asarray(X), jnp.asarray(Y), **kw)
  assert "\n" not in str(err.value)


def test_takes_the_poincare_ball():
  ball = losses.Poincare(c=0.5, r=2.0)
  got = FN(jnp.asarray(X, jnp.float32), jnp.asarray(Y), geometry=ball)
  want = gls_ref(X, Y, dist=pml_checks.ball_distances(X, ball))
  np.testing.assert_allclose(float(got), want, rtol=1e-4)
