"""Tests of the combinations of losses (circle_jax/losses/combine.py):
PML 2.9's MultipleLosses and SelfSupervisedLoss, value and gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses import pml_checks


def _vg2(fn, x, r):
  return jax.value_and_grad(fn, argnums=(0, 1))(x, r)


def _pml_vg2(fn, x, r):
  import torch
  xt = torch.tensor(x, requires_grad=True)
  rt = torch.tensor(r, requires_grad=True)
  value = fn(xt, rt)
  value.backward()
  return float(value.detach()), (xt.grad.numpy(), rt.grad.numpy())


def test_multiple_losses_equal_pml_with_weights_and_a_miner():
  pytest.importorskip("pytorch_metric_learning")
  from pytorch_metric_learning import losses as pl, miners as pm
  x = pml_checks.batch(7, n=12, d=6)
  y = pml_checks.LABELS[:12]
  terms = [losses.Term(losses.contrastive_loss, 0.7),
           losses.Term(functools.partial(losses.triplet_margin_loss,
                                         margin=0.1), 2.0,
                       miner=losses.batch_hard_miner)]
  got = jax.jit(jax.value_and_grad(lambda x: losses.multiple_losses(
      x, jnp.asarray(y), terms=terms)))(jnp.asarray(x, jnp.float32))
  theirs = pl.MultipleLosses(
      [pl.ContrastiveLoss(pos_margin=0.0, neg_margin=0.5),
       pl.TripletMarginLoss(margin=0.1)],
      miners=[None, pm.BatchHardMiner()], weights=[0.7, 2.0])
  pml_checks.close(got, pml_checks.pml_vg(
      lambda e, l, _: theirs(e, l), x, y))


def test_multiple_losses_pass_each_term_its_parameters():
  x = jnp.asarray(pml_checks.batch(8, n=6, d=4), jnp.float32)
  y = jnp.array([0, 0, 1, 1, 2, 2])
  w = jax.random.normal(jax.random.PRNGKey(0), (3, 4))
  terms = [losses.Term(losses.circle_loss, 0.5),
           losses.Term(losses.normface_loss, 3.0, takes_params=True)]
  got, want = jax.jit(lambda x, w: (
      losses.multiple_losses(x, y, [None, w], terms=terms),
      0.5 * losses.circle_loss(x, y) + 3.0 * losses.normface_loss(x, y, w)))(
          x, w)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  with pytest.raises(ValueError, match="one entry per term"):
    losses.multiple_losses(x, y, [w], terms=terms)
  with pytest.raises(ValueError, match="at least one loss"):
    losses.multiple_losses(x, y, terms=[])


def test_self_supervised_loss_equals_pml_symmetric_and_not():
  pytest.importorskip("pytorch_metric_learning")
  from pytorch_metric_learning import losses as pl
  rng = np.random.default_rng(9)
  x, r = rng.normal(size=(6, 5)), rng.normal(size=(6, 5))
  pairs = ((losses.contrastive_loss,
            lambda: pl.ContrastiveLoss(pos_margin=0.0, neg_margin=0.5)),
           (functools.partial(losses.triplet_margin_loss, margin=0.1),
            lambda: pl.TripletMarginLoss(margin=0.1)))
  cases = [(ours, theirs, symmetric) for symmetric in (True, False)
           for ours, theirs in pairs]
  run = jax.jit(lambda x, r: [_vg2(
      lambda x, r, ours=ours, sym=sym: losses.self_supervised_loss(
          ours, x, r, symmetric=sym), x, r) for ours, _, sym in cases])
  for got, (_, theirs, sym) in zip(run(jnp.asarray(x, jnp.float32),
                                       jnp.asarray(r, jnp.float32)), cases):
    want = _pml_vg2(pl.SelfSupervisedLoss(theirs(), symmetric=sym), x, r)
    np.testing.assert_allclose(float(got[0]), want[0], rtol=2e-5)
    for g, w in zip(got[1], want[1]):
      np.testing.assert_allclose(np.asarray(g), w, atol=5e-5)


def test_self_supervised_is_the_views_sampler_layout_and_checks_shapes():
  """Symmetric: the loss of both views with the pair index as the label,
  as the 'views' sampler's batch (each image's views in consecutive rows,
  its index the label) gives it."""
  rng = np.random.default_rng(10)
  x = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
  r = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
  views = jnp.stack([x, r], axis=1).reshape(8, 3)
  want = losses.supcon_loss(views, jnp.repeat(jnp.arange(4), 2))
  got = losses.self_supervised_loss(losses.supcon_loss, x, r)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  with pytest.raises(ValueError, match="shape of `embeddings`"):
    losses.self_supervised_loss(losses.supcon_loss, x, r[:3])
