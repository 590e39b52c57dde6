"""The pair losses at the extremes of their documented hyperparameter ranges.

Every range-checked hyperparameter (the rules' ``ranges``, exposed by
:func:`circle_jax.losses.hyper_ranges`) is set to each bound of its range
(the others at their defaults), and the loss must be finite with a finite
gradient under ``jax.jit``, in the dense and the blockwise engine (a block
size that does not divide the batch), equal to its eager value and to a
float64 reference. A value outside the range raises a ValueError naming the
parameter and the range. Beyond the range (a traced hyperparameter escapes
the check) the losses stay finite: a shifted logit is never exponentiated
above 0.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from circle_jax import losses
from circle_jax.losses import circle as circle_mod
from circle_jax.losses import multi_similarity as ms_mod
from circle_jax.losses import contrastive as contrastive_mod
from circle_jax.losses import ranked_list as rll_mod
from tests.losses import reference as ref
from tests.losses.reference import (ref_circle_anchor, ref_pair_loss,
                                    ref_unified_anchor)
from tests.losses.reference import mined_sets
from tests.losses.reference import contrastive_ref
from tests.losses.reference import rll_reference

# Slow (many compiled cases): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

B, D, BLOCK = 16, 8, 5  # BLOCK does not divide B


def _batch():
  x = jax.random.normal(jax.random.PRNGKey(0), (B, D), jnp.float32)
  y = jnp.repeat(jnp.arange(4), 4)
  return x, y


def _ref_circle(x, y, **h):
  return ref_pair_loss(ref_circle_anchor, ref.cos(x), y, **h)


def _ref_unified(x, y, **h):
  return ref_pair_loss(ref_unified_anchor, ref.cos(x), y, **h)


def _ref_ms(x, y, *, alpha, beta, base, epsilon):
  # test_multi_similarity's ref_ms, with log(1 + sum exp) as a logaddexp of a
  # logsumexp so that float64 does not overflow at the largest scales.
  s = ref.cos(x)
  total = 0.0
  for i in range(len(y)):
    pos, neg = mined_sets(s, y, i, epsilon)
    if pos and neg:
      total += np.logaddexp(
          0.0, ref.logsumexp(-alpha * (s[i, pos] - base))) / alpha
      total += np.logaddexp(
          0.0, ref.logsumexp(beta * (s[i, neg] - base))) / beta
  return total / len(y)


def _ref_rll(x, y, **h):
  d = np.sqrt(np.maximum(2.0 - 2.0 * ref.cos(x), 0.0))
  return rll_reference(d, y, **h)[0]


def _ref_contrastive(x, y, **h):
  return contrastive_ref(x, y, **h)


# (loss function, its rule (ranges and defaults), float64 reference).
LOSSES = {
    "circle": (losses.circle_loss, circle_mod.Circle, _ref_circle),
    "unified": (losses.unified_loss, circle_mod.Unified, _ref_unified),
    "multi_similarity": (losses.multi_similarity_loss,
                         ms_mod.MultiSimilarity, _ref_ms),
    "ranked_list": (losses.ranked_list_loss, rll_mod.RankedList, _ref_rll),
    "contrastive": (losses.contrastive_loss, contrastive_mod.Contrastive,
                    _ref_contrastive),
}


def _defaults(rule):
  return {name: getattr(rule, name) for name in rule.ranges}


def _inside(valid, which):
  """The extreme allowed value at bound ``which`` of a range."""
  bound = valid.low if which == "low" else valid.high
  if math.isinf(bound):
    return math.copysign(1e30, bound)  # "every finite value"
  if which == "low" and not valid.low_inclusive:
    return bound + 1e-6
  if which == "high" and not valid.high_inclusive:
    return bound - 1e-6
  return bound


def _outside(valid, which):
  """A value just outside bound ``which`` (None where there is none)."""
  bound = valid.low if which == "low" else valid.high
  if math.isinf(bound):
    return None
  inclusive = valid.low_inclusive if which == "low" else valid.high_inclusive
  if not inclusive:
    return bound
  step = max(abs(bound) * 1e-3, 1e-3)
  return bound - step if which == "low" else bound + step


def _scale_names(rule):
  return [n for n, r in rule.ranges.items() if r.high == 1e4]


def _extreme_cases():
  cases = []
  for name, (_, rule, _) in LOSSES.items():
    for param in rule.ranges:
      for which in ("low", "high"):
        value = _inside(rule.ranges[param], which)
        cases.append(pytest.param(name, {param: value},
                                  id=f"{name}-{param}={value:g}"))
    scales = _scale_names(rule)
    if len(scales) > 1:  # every scale at once at its largest and smallest
      for which in ("low", "high"):
        hyper = {p: _inside(rule.ranges[p], which) for p in scales}
        cases.append(pytest.param(name, hyper,
                                  id=f"{name}-all-scales-{which}"))
  return cases


def _value_and_grad(fn, block_size, hyper):
  return lambda x, y: jax.value_and_grad(
      lambda e: fn(e, y, block_size=block_size, **hyper))(x)


def _assert_close_grads(got, want, what):
  # At scales up to 1e4 a recomputed similarity's float32 rounding moves the
  # softmax weights by ~0.1%: compare relative to the largest entry.
  scale = float(np.max(np.abs(want)))
  np.testing.assert_allclose(got, want, rtol=0, atol=3e-3 * scale + 1e-7,
                             err_msg=what)


@pytest.mark.parametrize("name,hyper", _extreme_cases())
def test_finite_and_consistent_at_the_range_extremes(name, hyper):
  fn, rule, reference = LOSSES[name]
  x, y = _batch()
  want = reference(np.asarray(x, np.float64), np.asarray(y),
                   **{**_defaults(rule), **hyper})
  assert np.isfinite(want)
  dense_eager = _value_and_grad(fn, None, hyper)(x, y)
  for block_size in (None, BLOCK):
    f = _value_and_grad(fn, block_size, hyper)
    eager = dense_eager if block_size is None else f(x, y)
    for mode, (value, grad) in (("jit", jax.jit(f)(x, y)), ("eager", eager)):
      what = f"{name} {hyper} block_size={block_size} {mode}"
      assert np.isfinite(value), what
      assert np.all(np.isfinite(grad)), what
      np.testing.assert_allclose(value, want, rtol=1e-3, atol=1e-5,
                                 err_msg=what)
      _assert_close_grads(grad, dense_eager[1], what)


def _out_of_range_cases():
  cases = []
  for name, (_, rule, _) in LOSSES.items():
    for param, valid in rule.ranges.items():
      for value in (_outside(valid, "low"), _outside(valid, "high"),
                    float("nan")):
        if value is not None:
          cases.append(pytest.param(name, param, value,
                                    id=f"{name}-{param}={value:g}"))
  return cases


@pytest.mark.parametrize("name,param,value", _out_of_range_cases())
def test_out_of_range_raises_naming_parameter_and_range(name, param, value):
  fn, rule, _ = LOSSES[name]
  x, y = _batch()
  message = f"`{param}`.* must be in {re.escape(str(rule.ranges[param]))}"
  with pytest.raises(ValueError, match=message):
    fn(x, y, **{param: value})


@pytest.mark.parametrize("name,hyper", [
    # Out of range now; measured on the code before the documented ranges
    # and the clamp: NaN / inf values or gradients, or jit != eager.
    ("ranked_list", dict(t_neg=1e10, t_pos=1e10)),
    ("multi_similarity", dict(alpha=1e10, beta=1e10)),
    ("multi_similarity", dict(base=1e10)),
    ("circle", dict(gamma=1e10)),
    ("unified", dict(gamma=1e10)),
])
def test_overflowing_values_are_out_of_range(name, hyper):
  fn, _, _ = LOSSES[name]
  x, y = _batch()
  with pytest.raises(ValueError, match="must be in"):
    fn(x, y, **hyper)


@pytest.mark.parametrize("name,params", [
    ("circle", ("gamma",)),
    ("unified", ("gamma",)),
    ("multi_similarity", ("alpha", "beta")),
    ("ranked_list", ("t_neg", "t_pos")),
])
@pytest.mark.parametrize("block_size", [None, BLOCK])
def test_traced_scale_beyond_the_range_stays_finite(name, params, block_size):
  # A traced hyperparameter is not range-checked; at 1e10 a recomputed
  # maximum differs from its logit by hundreds (ulp x scale). The losses are
  # not accurate there, but never inf or NaN.
  fn, _, _ = LOSSES[name]
  x, y = _batch()

  def loss(e, scale):
    return fn(e, y, block_size=block_size, **{p: scale for p in params})

  value, grad = jax.jit(jax.value_and_grad(loss))(x, jnp.float32(1e10))
  assert np.isfinite(value)
  assert np.all(np.isfinite(grad))


@pytest.mark.parametrize("fn,params,kwargs", [
    (losses.circle_loss_class_level, "class_weights", dict(gamma=1e4)),
    (losses.circle_loss_class_level, "class_weights", dict(gamma=1e-6)),
    (losses.ranked_proxy_anchor_loss, "proxies", dict(t_neg=1e4, alpha=2.0,
                                                      margin=2.0)),
])
def test_class_and_proxy_forms_finite_at_the_extremes(fn, params, kwargs):
  x, y = _batch()
  w = jax.random.normal(jax.random.PRNGKey(1), (4, D), jnp.float32)
  f = jax.value_and_grad(lambda e, w: fn(e, y, w, **kwargs), (0, 1))
  value, grads = jax.jit(f)(x, w)
  eager_value, eager_grads = f(x, w)
  assert np.isfinite(value)
  np.testing.assert_allclose(value, eager_value, rtol=1e-5)
  for g, e in zip(grads, eager_grads):
    assert np.all(np.isfinite(g))
    _assert_close_grads(g, e, str(kwargs))


# ----------------------------------------------------------------------------
# The ranges as the registry exposes them.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name,rule", [
    ("circle", circle_mod.Circle),
    ("circle_class_level", circle_mod.Circle),
    ("multi_similarity", ms_mod.MultiSimilarity),
    ("ranked_list", rll_mod.RankedList),
    ("contrastive", contrastive_mod.Contrastive),
])
def test_hyper_ranges_are_the_rules(name, rule):
  assert dict(losses.hyper_ranges(name)) == dict(rule.ranges)
  assert losses.get_loss(name).hyper_ranges == losses.hyper_ranges(name)


def test_ranked_proxy_anchor_ranges_are_ranked_lists_for_its_parameters():
  got = losses.hyper_ranges("ranked_proxy_anchor")
  assert set(got) == {"alpha", "margin", "t_neg"}
  for k, v in got.items():
    assert v == rll_mod.RankedList.ranges[k]


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_every_default_lies_in_its_range(name):
  entry = losses.get_loss(name)
  assert set(entry.hyper_ranges) <= set(entry.defaults)
  for param, valid in entry.hyper_ranges.items():
    assert valid.contains(entry.defaults[param]), (name, param)
  losses.validate_hyper(name, **entry.defaults)


def test_validate_hyper():
  losses.validate_hyper("circle", gamma=1e4, margin=-1.0, unknown=3)
  losses.validate_hyper("circle", gamma=jnp.float32(1e10))  # traced-like
  losses.validate_hyper("softmax", scale=1e30)  # no documented range
  with pytest.raises(ValueError, match=r"`beta` of loss 'multi_similarity' "
                     r"must be in \[1e-06, 10000\]; got 0"):
    losses.validate_hyper("multi_similarity", alpha=2.0, beta=0.0)
  with pytest.raises(ValueError, match=r"`alpha` .* must be in \(0, 2\]"):
    losses.validate_hyper("ranked_list", alpha=0)
  with pytest.raises(ValueError, match=r"`epsilon` .* \[0, inf\)"):
    losses.validate_hyper("multi_similarity", epsilon=np.float32(-0.1))
  with pytest.raises(ValueError, match="Unknown loss"):
    losses.hyper_ranges("no_such_loss")


def test_hyper_range_contains_and_describes():
  r = losses.HyperRange(0.0, 2.0, False, True)
  assert str(r) == "(0, 2]"
  assert not r.contains(0.0) and r.contains(1e-30) and r.contains(2.0)
  assert not r.contains(2.0000002) and not r.contains(float("nan"))
  assert str(losses.HyperRange(1e-6, 1e4)) == "[1e-06, 10000]"
  low, high, low_inclusive, high_inclusive = r
  assert (low, high, low_inclusive, high_inclusive) == (0.0, 2.0, False, True)


@pytest.mark.parametrize("name,hyper", [
    ("circle", dict(gamma=1e4, margin=1.0)),
    ("multi_similarity", dict(alpha=1e4, beta=1e4, base=-1.0)),
    ("ranked_list", dict(t_neg=1e4, t_pos=1e4, alpha=2.0)),
])
@pytest.mark.parametrize("block_size", [None, 3])
def test_global_batch_at_the_largest_scales(name, hyper, block_size):
  # 8 simulated devices, 2 anchors each, against the gathered batch.
  fn, _, _ = LOSSES[name]
  x, y = _batch()
  n = jax.device_count()
  assert n == 8
  want_v, want_g = jax.value_and_grad(lambda e: fn(e, y, **hyper))(x)
  f = jax.value_and_grad(lambda e, l: fn(e, l, axis_name="d",
                                         block_size=block_size, **hyper))
  mesh = Mesh(np.array(jax.devices()), ("d",))
  v, g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P("d")),
                               out_specs=(P(), P("d"))))(x, y)
  assert np.isfinite(v) and np.all(np.isfinite(g))
  assert np.max(np.abs(want_g)) > 1e-3
  np.testing.assert_allclose(v, want_v, rtol=1e-4)
  _assert_close_grads(g, want_g, f"{name} {hyper} {block_size}")
