"""Tests of the (global) batch reductions
(circle_jax/losses/engine/reductions.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from circle_jax import ops
from circle_jax.losses.engine import reductions
from circle_jax.losses import engine


def _toy_global_loss(x, labels):
  _, _, s, pos, neg = engine.pair_block(x, labels)
  per = ops.log1p_sum_exp(10 * s, neg) + ops.log1p_sum_exp(-10 * s, pos)
  return reductions.mean_over_valid(per, pos.any(1))


def _toy_local_loss(x, labels, axis_name):
  _, _, s, pos, neg = engine.pair_block(x, labels, axis_name=axis_name)
  per = ops.log1p_sum_exp(10 * s, neg) + ops.log1p_sum_exp(-10 * s, pos)
  return reductions.mean_over_valid(per, pos.any(1), axis_name)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_global_batch_value_and_gradient_equal_single_device(mode):
  n = jax.device_count()
  assert n == 8
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 5))
  labels = jnp.array([0, 1, 2, 3] * 3 + [5, 6, 7, 0])
  ref_v, ref_g = jax.value_and_grad(_toy_global_loss)(x, labels)
  f = jax.value_and_grad(functools.partial(_toy_local_loss, axis_name="d"))
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, g = jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P("d")),
                         out_specs=(P(), P("d")))(x, labels)
  else:
    v, g = jax.pmap(f, axis_name="d")(x.reshape(n, -1, 5), labels.reshape(n, -1))
    v, g = v[0], g.reshape(16, 5)
  np.testing.assert_allclose(float(v), float(ref_v), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(g), np.asarray(ref_g), atol=1e-5)


# The `reduction` option: pytorch-metric-learning's reducers on a loss's
# terms (anchors, pairs, triplets).

_W = tuple(np.linspace(0.5, 2.0, 5))
# Every class has two samples or more: PML's per-anchor terms of an anchor
# without a positive are not 0 (its negatives' part), ours are.
_Y = np.array([0, 1, 2, 3, 4] * 3 + [4])


def _pml_reducers():
  import torch
  from pytorch_metric_learning import reducers as pr
  return [("mean", pr.MeanReducer(), {}), ("sum", pr.SumReducer(), {}),
          ("avg_non_zero", pr.AvgNonZeroReducer(), {}),
          ("threshold", pr.ThresholdReducer(low=0.5, high=1.2),
           dict(low=0.5, high=1.2)),
          ("class_weighted", pr.ClassWeightedReducer(torch.tensor(_W)),
           dict(weights=_W))]


def _eager_vg(fn, x, labels, **kw):
  """Value and gradient without jit (cheap on tiny batches)."""
  return jax.value_and_grad(lambda x: fn(x, jnp.asarray(labels), **kw))(
      jnp.asarray(x, jnp.float32))


def test_reductions_equal_pml_reducers_on_pairs_triplets_and_anchors():
  """Contrastive (pair terms, each set reduced on its own), triplet
  (``mining="all"``: triplet terms) and Circle (anchor terms) under every
  PML reducer: value and gradient, one program."""
  pytest.importorskip("pytorch_metric_learning")
  from pytorch_metric_learning import losses as pl
  from circle_jax import losses
  from tests.losses import pml_checks
  x = pml_checks.batch(3)
  reducers = _pml_reducers()
  ours = (losses.contrastive_loss, losses.triplet_margin_loss,
          functools.partial(losses.circle_loss, gamma=2.0))

  cases = [(fn, engine.Reduction(name, **kw), theirs)
           for name, reducer, kw in reducers
           for fn, theirs in zip(ours, (
               pl.ContrastiveLoss(pos_margin=0.0, neg_margin=0.5,
                                  reducer=reducer),
               pl.TripletMarginLoss(margin=0.2, reducer=reducer),
               pl.CircleLoss(gamma=2.0, reducer=reducer)))
           # PML's class weights of Circle's [B, 1] terms: the next test.
           if not (name == "class_weighted" and isinstance(
               theirs, pl.CircleLoss))]
  run = jax.jit(lambda x: [jax.value_and_grad(
      lambda x, fn=fn, r=r: fn(x, jnp.asarray(_Y), reduction=r))(x)
                           for fn, r, _ in cases])
  for got, (_, _, theirs) in zip(run(jnp.asarray(x, jnp.float32)), cases):
    pml_checks.close(got, pml_checks.pml_vg(theirs, x, _Y))


def test_class_weighted_anchor_terms_follow_pml_on_flat_terms():
  """PML's Circle and MultiSimilarity give ``[B, 1]`` terms, which its
  ClassWeightedReducer broadcasts against the ``[B]`` weights into a
  ``[B, B]`` outer product (mean(l) * mean(w[y])); ours weighs each anchor's
  term by its class's weight, as the reducer means to."""
  pytest.importorskip("pytorch_metric_learning")
  import torch
  from pytorch_metric_learning import losses as pl, reducers as pr
  from circle_jax import losses
  from tests.losses import pml_checks
  x = pml_checks.batch(4)
  terms = pl.CircleLoss(reducer=pr.DoNothingReducer())(
      torch.tensor(x), torch.tensor(_Y))["loss"]["losses"].detach().numpy()
  want = np.mean(terms[:, 0] * np.asarray(_W)[_Y])
  got = losses.circle_loss(
      jnp.asarray(x, jnp.float32), jnp.asarray(_Y),
      reduction=engine.Reduction("class_weighted", weights=_W))
  np.testing.assert_allclose(float(got), want, rtol=2e-5)
  none = losses.circle_loss(jnp.asarray(x, jnp.float32),
                            jnp.asarray(_Y), reduction="none")
  np.testing.assert_allclose(np.asarray(none), terms[:, 0], rtol=2e-5)


def test_none_divisor_and_sum_of_pair_terms():
  from circle_jax import losses
  x = jnp.asarray(np.random.default_rng(5).normal(size=(8, 4)), jnp.float32)
  y = jnp.array([0, 0, 1, 1, 2, 2, 3, 3])
  terms = losses.contrastive_loss(x, y, reduction="none")
  assert terms.shape == (8, 8)
  assert float(jnp.trace(terms)) == 0.0  # a sample is not its own pair
  total = losses.contrastive_loss(x, y, reduction="sum")
  np.testing.assert_allclose(float(total), float(jnp.sum(terms)), rtol=1e-6)
  for divisor, want in ((4.0, float(total) / 4), (0.0, 0.0)):
    got = losses.contrastive_loss(
        x, y, reduction=engine.Reduction("divisor", divisor=divisor))
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
  assert losses.circle_loss(x, y, reduction="none").shape == (8,)
  assert losses.triplet_margin_loss(x, y, reduction="none").shape == (8, 8, 8)


def test_reduction_refusals_name_the_problem():
  from circle_jax import losses
  x = jnp.ones((4, 3))
  y = jnp.array([0, 0, 1, 1])
  cases = [
      (losses.contrastive_loss, dict(reduction="sum", block_size=2),
       "needs the dense engine"),
      (losses.histogram_loss, dict(reduction="sum"), "only its own"),
      (losses.lifted_structure_loss, dict(reduction="sum", block_size=2),
       "needs the dense engine"),
      (losses.intra_pair_variance_loss, dict(reduction="sum", block_size=2),
       "only the dense engine"),
      (losses.circle_loss, dict(reduction="median"), "must be one of"),
  ]
  for fn, kw, match in cases:
    with pytest.raises(ValueError, match=match):
      fn(x, y, **kw)
  with pytest.raises(ValueError, match="needs `low` or `high`"):
    engine.Reduction("threshold")


def test_reductions_on_eight_devices_equal_one_device():
  """A pair reduction and an anchor reduction of the global batch (the
  anchors' on the device ring, in tiles): the value and the gradient equal
  the single-device dense ones."""
  from circle_jax import losses
  from tests.losses import engine_checks

  def fn(x, y, **kw):
    ring = dict(collective="ring", block_size=2) if kw else {}
    return (losses.contrastive_loss(
        x, y, reduction=engine.Reduction("threshold", low=0.2, high=1.0),
        **kw)
            + losses.circle_loss(
                x, y, reduction=engine.Reduction("class_weighted",
                                                 weights=_W), **ring, **kw))
  x = jnp.asarray(np.random.default_rng(6).normal(size=(16, 4)), jnp.float32)
  y = jnp.asarray(_Y)
  engine_checks.close(engine_checks.sharded_vg(fn, x, y),
                      _eager_vg(fn, x, y))


def test_per_anchor_and_multiple_reducers_equal_pml():
  """PML's PerAnchorReducer and MultipleReducers on contrastive's pair
  terms (and PerAnchorReducer on Circle's anchor terms): value and
  gradient, one program; triplets and a 'none' inside are refused."""
  pytest.importorskip("pytorch_metric_learning")
  from pytorch_metric_learning import losses as pl, reducers as pr
  from circle_jax import losses
  from tests.losses import pml_checks
  x = pml_checks.batch(7)
  contrastive = functools.partial(pl.ContrastiveLoss, pos_margin=0.0,
                                  neg_margin=0.5)
  cases = [
      (losses.contrastive_loss, engine.PerAnchorReducer(),
       contrastive(reducer=pr.PerAnchorReducer())),
      (losses.contrastive_loss, engine.PerAnchorReducer(
          engine.Reduction("threshold", low=0.05)),
       contrastive(reducer=pr.PerAnchorReducer(
           pr.ThresholdReducer(low=0.05)))),
      (losses.contrastive_loss, engine.MultipleReducers(
          {"pos_loss": engine.Reduction("sum")},
          default_reducer=engine.Reduction("avg_non_zero")),
       contrastive(reducer=pr.MultipleReducers(
           {"pos_loss": pr.SumReducer()},
           default_reducer=pr.AvgNonZeroReducer()))),
      (functools.partial(losses.circle_loss, gamma=2.0),
       engine.PerAnchorReducer(engine.Reduction(
           "class_weighted", weights=_W)),
       None),
  ]
  run = jax.jit(lambda x: [jax.value_and_grad(
      lambda x, fn=fn, r=r: fn(x, jnp.asarray(_Y), reduction=r))(x)
                           for fn, r, _ in cases])
  got = run(jnp.asarray(x, jnp.float32))
  for g, (_, _, theirs) in zip(got[:3], cases):
    pml_checks.close(g, pml_checks.pml_vg(theirs, x, _Y))
  # Anchor terms go to the inner reducer unchanged.
  plain = losses.circle_loss(
      jnp.asarray(x, jnp.float32), jnp.asarray(_Y), gamma=2.0,
      reduction=engine.Reduction("class_weighted", weights=_W))
  np.testing.assert_allclose(float(got[3][0]), float(plain), rtol=1e-6)
  with pytest.raises(ValueError, match="not triplets"):
    losses.triplet_margin_loss(jnp.asarray(x), jnp.asarray(_Y),
                               reduction=engine.PerAnchorReducer())
  with pytest.raises(ValueError, match="other than 'none'"):
    engine.MultipleReducers({"pos_loss": engine.Reduction("none")})
  with pytest.raises(ValueError, match="sub-loss names"):
    engine.MultipleReducers({0: engine.Reduction()})


@pytest.mark.slow  # CI, not the fast tier (CONTRIBUTING.md)
def test_every_reduced_loss_on_eight_devices_equals_one_device():
  """The losses that took the option last (issue 40: pair terms of
  two-stage rules, of dense losses, anchor terms of ranking losses), a
  kind each, in one program: on 8 devices (all-gathered columns) each
  value, a weighted sum's gradient and the ``"none"`` terms of a
  two-stage rule (each device's ``[M, N]`` rows) equal the single-device
  ones."""
  from jax.sharding import PartitionSpec as P
  from circle_jax import losses
  from tests.losses import engine_checks
  r = engine.Reduction
  cases = (
      (losses.lifted_structure_loss, r("threshold", low=0.5, high=20.0)),
      (losses.n_pair_loss, r("sum")),
      (functools.partial(losses.margin_loss, beta=jnp.float32(1.1)),
       r("avg_non_zero")),
      (losses.nt_xent_loss, r("class_weighted", weights=_W)),
      (functools.partial(losses.pairwise_ce_loss, geometry="cosine"),
       r("mean")),
      (losses.smooth_ap_loss, r("threshold", low=0.05, high=0.9)),
      (losses.fastap_loss, r("class_weighted", weights=_W)),
      (losses.angular_loss, r("divisor", divisor=7.0)),
      (losses.intra_pair_variance_loss, r("avg_non_zero")),
      (losses.tuplet_margin_loss, r("class_weighted", weights=_W)),
      (losses.threshold_consistent_margin_loss, r("sum")),
      (losses.pnp_loss, r("mean")))
  weights = jnp.linspace(1.0, 2.0, len(cases))

  def run(x, y, **kw):
    def values(x):
      return jnp.stack([f(x, y, reduction=red, **kw) for f, red in cases])
    v, pull = jax.vjp(values, x)
    return (v, pull(weights)[0],
            losses.lifted_structure_loss(x, y, reduction="none", **kw))

  x = jnp.asarray(np.random.default_rng(7).normal(size=(16, 4)), jnp.float32)
  y = jnp.asarray(_Y)
  want = jax.jit(run)(x, y)
  got = jax.jit(jax.shard_map(
      functools.partial(run, axis_name="d"), mesh=engine_checks.mesh(),
      in_specs=(P("d"), P("d")), out_specs=(P(), P("d"), P("d"))))(x, y)
  assert want[2].shape == (16, 16)
  assert float(jnp.min(want[0])) > 0.0  # every loss takes part
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                               atol=2e-5)
