"""Angular loss: a hand-computed case, pytorch-metric-learning 2.9's value
and gradient, a float64 loop reference with miner masks, the dense engine on
one and on 8 devices, the tiled engines refused."""

import jax
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

X, Y = pml_checks.batch(seed=4), pml_checks.LABELS


def angular_ref(x, y, alpha, pos_mask=None, neg_mask=None, ref=None,
                ref_y=None):
  """Wang et al.'s eq. 8 pair by pair, float64."""
  unit = lambda v: v / np.linalg.norm(v, axis=1, keepdims=True)
  z = unit(x)
  c, cy = (z, y) if ref is None else (unit(ref), ref_y)
  t = np.tan(np.radians(alpha)) ** 2
  terms = []
  for a in range(len(y)):
    for p in range(len(cy)):
      if (ref is None and p == a) or cy[p] != y[a] or (
          pos_mask is not None and not pos_mask[a, p]):
        continue
      inner = 0.0
      for n in range(len(cy)):
        if cy[n] != y[a] and (neg_mask is None or neg_mask[a, n]):
          inner += np.exp(4 * t * (z[a] + c[p]) @ c[n]
                          - 2 * (1 + t) * z[a] @ c[p])
      terms.append(np.log1p(inner))
  return np.mean(terms) if terms else 0.0


def test_hand_computed():
  x = jnp.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
  got = losses.angular_loss(x, jnp.array([0, 0, 1]), alpha=45.0)
  # tan^2 45 = 1: both ordered pairs have (x_a + x_p).x_n = -1, x_a.x_p = 0.
  np.testing.assert_allclose(float(got), np.log1p(np.exp(-4.0)), rtol=1e-6)


def _unit(x):
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def _tangent(g, x):
  """PML's gradient at unit-norm ``x`` projected onto the tangent space of
  the sphere (what normalising every input, as the paper does, gives)."""
  z = _unit(x)
  return g - np.sum(g * z, axis=1, keepdims=True) * z


@pytest.mark.parametrize("alpha", [40.0, 30.0, 55.0, 70.0])
def test_equals_the_float64_reference(alpha):
  got = pml_checks.vg(losses.angular_loss, X, Y, alpha=alpha)
  want = angular_ref(X, Y, alpha)
  grad = engine_checks.grad_ref(lambda x: angular_ref(x, Y, alpha), X)
  pml_checks.close(got, (want, grad))


@pytest.mark.parametrize("alpha", [40.0, 30.0, 55.0, 70.0])
def test_equals_pytorch_metric_learning_on_unit_vectors(alpha):
  z = _unit(X)
  value, grad = pml_checks.pml_vg(pml.AngularLoss(alpha=alpha), z, Y)
  pml_checks.close(pml_checks.vg(losses.angular_loss, z, Y, alpha=alpha),
                   (value, _tangent(grad, z)))


def test_pml_does_not_normalise_the_negatives():
  # PML 2.9 multiplies (x_a + x_p) by the raw embeddings: off the sphere
  # its value is not the paper's (ours is, above).
  value, _ = pml_checks.pml_vg(pml.AngularLoss(), X, Y)
  assert abs(value - angular_ref(X, Y, 40.0)) > 1.0


def test_the_defaults_are_pmls():
  assert losses.get_loss("angular").defaults == {"alpha": 40.0}
  np.testing.assert_allclose(float(pml.AngularLoss().alpha),
                             np.radians(40.0))


def test_eight_devices_equal_one():
  want = pml_checks.vg(losses.angular_loss, X, Y)
  pml_checks.close(pml_checks.sharded_dense(losses.angular_loss, X, Y),
                   want)


def test_reference_embeddings_equal_pmls_ref_emb():
  mem = _unit(pml_checks.batch(seed=5, n=8))
  mem_y = np.array([0, 1, 2, 3, 0, 1, 7, 7])
  value, (dx, dmem) = pml_checks.pml_vg(pml.AngularLoss(), X, Y, mem, mem_y)
  got = jax.jit(jax.value_and_grad(
      lambda x, mem: losses.angular_loss(
          x, jnp.asarray(Y), ref=losses.Candidates(mem, jnp.asarray(mem_y))),
      argnums=(0, 1)))(jnp.asarray(X, jnp.float32),
                       jnp.asarray(mem, jnp.float32))
  pml_checks.close(got, (value, (dx, _tangent(dmem, mem))))
  np.testing.assert_allclose(value, angular_ref(X, Y, 40.0, ref=mem,
                                                ref_y=mem_y), rtol=1e-10)


def test_mined_positive_pairs_equal_pmls_indices_tuple():
  rng = np.random.default_rng(6)
  same = Y[:, None] == Y[None, :]
  pm = rng.random((16, 16)) < 0.6
  z = _unit(X)
  value, grad = pml_checks.pml_vg(
      pml.AngularLoss(), z, Y, indices_tuple=pml_checks.pairs_of(
          pm & same & ~np.eye(16, dtype=bool), ~same))
  got = pml_checks.vg(losses.angular_loss, z, Y, pos_mask=jnp.asarray(pm))
  pml_checks.close(got, (value, _tangent(grad, z)))


def test_a_negative_mask_restricts_the_sum():
  rng = np.random.default_rng(7)
  pm, nm = (rng.random((16, 16)) < 0.6 for _ in range(2))
  got = pml_checks.vg(losses.angular_loss, X, Y, pos_mask=jnp.asarray(pm),
                      neg_mask=jnp.asarray(nm), alpha=50.0)
  np.testing.assert_allclose(float(got[0]), angular_ref(X, Y, 50.0, pm, nm),
                             rtol=2e-5)
  pml_checks.close(pml_checks.engine_checks.sharded_vg(
      losses.angular_loss, jnp.asarray(X, jnp.float32), jnp.asarray(Y),
      jnp.asarray(pm), jnp.asarray(nm), alpha=50.0), got)


def test_no_positive_gives_zero_loss_and_zero_gradient():
  for got in (pml_checks.vg(losses.angular_loss, X, np.arange(16)),
              pml_checks.sharded_dense(losses.angular_loss, X,
                                       np.arange(16))):
    assert float(got[0]) == 0.0
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)


def test_no_negative_gives_zero_loss_and_zero_gradient():
  got = pml_checks.vg(losses.angular_loss, X, np.zeros(16, np.int32))
  assert float(got[0]) == 0.0
  np.testing.assert_array_equal(np.asarray(got[1]), 0.0)


def test_check_grads():
  x = jnp.asarray(X[:8], jnp.float32)
  f = lambda x: losses.angular_loss(x, jnp.asarray(Y[:8]))
  check_grads(f, (x,), order=1, modes=("rev",), eps=1e-2, atol=2e-2,
              rtol=2e-2)


@pytest.mark.parametrize("kw,match", [
    ({"alpha": 0.0}, r"alpha.*\(0, 72\]"),
    ({"alpha": 80.0}, r"alpha.*\(0, 72\]"),
    ({"block_size": 4}, "only the dense engine"),
    ({"geometry": "dot"}, "unit vectors"),
])
def test_bad_input_is_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as err:
    losses.angular_loss(jnp.asarray(X), jnp.asarray(Y), **kw)
  assert "\n" not in str(err.value)


def test_reductions_equal_pmls_reducers_on_its_positive_pairs():
  """``reduction``: PML's reducers on PML's own elements, the ordered
  positive pairs, on unit-norm inputs (the PML bug above): values, the
  gradient in the sphere's tangent space; ``"none"`` the ``[B, B]``
  terms."""
  x = pml_checks.batch(7)
  x = x / np.linalg.norm(x, axis=1, keepdims=True)
  pml_checks.reductions_equal_pml(
      lambda x, y, **kw: losses.angular_loss(x, y, alpha=35.0, **kw),
      lambda r: pml.AngularLoss(alpha=35.0, reducer=r), x,
      pml_checks.LABELS, tangent=True)
