"""Tests of the regularizers (circle_jax/losses/regularizers.py): PML 2.9's
value and gradient on random float64 matrices, the config's sum, and the
global batch of the embeddings' regularizer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.losses import regularizers as R
from tests.losses import engine_checks


def _pml(reg, x):
  import torch
  xt = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
  value = reg(xt)
  value.backward()
  return float(value.detach()), xt.grad.numpy()


def _ours(fn, x):
  return jax.value_and_grad(fn)(jnp.asarray(x, jnp.float32))


def test_regularizers_equal_pml():
  pytest.importorskip("pytorch_metric_learning")
  from pytorch_metric_learning import regularizers as pr
  rng = np.random.default_rng(0)
  w = rng.normal(size=(6, 4)) * rng.uniform(0.5, 2.0, size=(6, 1))
  cases = [
      (R.lp_regularizer, pr.LpRegularizer()),
      (functools.partial(R.lp_regularizer, p=1.0, power=2.0),
       pr.LpRegularizer(p=1, power=2)),
      (functools.partial(R.lp_regularizer, p=3.0, power=0.5),
       pr.LpRegularizer(p=3, power=0.5)),
      (R.zero_mean_regularizer, pr.ZeroMeanRegularizer()),
      (R.center_invariant_regularizer, pr.CenterInvariantRegularizer()),
      (R.regular_face_regularizer, pr.RegularFaceRegularizer()),
      (functools.partial(R.sparse_centers_regularizer, centers_per_class=2),
       pr.SparseCentersRegularizer(num_classes=3, centers_per_class=2)),
      (functools.partial(R.sparse_centers_regularizer, centers_per_class=3),
       pr.SparseCentersRegularizer(num_classes=2, centers_per_class=3)),
  ]
  run = jax.jit(lambda w: [jax.value_and_grad(fn)(w) for fn, _ in cases])
  for got, (_, theirs) in zip(run(jnp.asarray(w, jnp.float32)), cases):
    engine_checks.close(got, _pml(theirs, w))


def test_regularization_adds_the_configured_terms():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(6, 3)), jnp.float32)
  assert float(R.regularization({}, x, w)) == 0.0
  got = R.regularization(
      {"embedding_regularizer": "lp", "embedding_reg_weight": 0.5,
       "weight_regularizer": "sparse_centers", "weight_reg_weight": 2.0,
       "reg_p": None}, x, w, centers_per_class=3)
  want = (0.5 * R.lp_regularizer(x)
          + 2.0 * R.sparse_centers_regularizer(w, centers_per_class=3))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  with pytest.raises(ValueError, match="must be one of \\['lp'\\]"):
    R.regularization({"embedding_regularizer": "regular_face"}, x, w)
  with pytest.raises(ValueError, match="needs a loss with a class matrix"):
    R.regularization({"weight_regularizer": "lp"}, x, None)
  with pytest.raises(ValueError, match="divide"):
    R.sparse_centers_regularizer(w, centers_per_class=4)


def test_embedding_regularizer_of_the_global_batch():
  x = jnp.asarray(np.random.default_rng(2).normal(size=(16, 3)), jnp.float32)
  y = jnp.zeros(16, jnp.int32)
  fn = lambda x, y, **kw: R.lp_regularizer(x, power=2.0, **kw)
  engine_checks.close(engine_checks.sharded_vg(fn, x, y),
                      _ours(lambda x: fn(x, y), x))
