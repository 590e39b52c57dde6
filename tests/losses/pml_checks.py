"""Shared checks of the losses ported from pytorch-metric-learning 2.9 (PML):
PML's float64 value and gradients, ours on every engine, random batches.

PML is a test-only dependency: a test module that uses these imports it
with ``pytest.importorskip``.
"""

import functools

import jax.numpy as jnp
import numpy as np

from tests.losses import engine_checks

# 16 samples (2 on each of the 8 simulated devices): 5 classes of 3 and a
# singleton, so one anchor has no positive.
LABELS = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5])


def batch(seed=0, n=16, d=8):
  """A random float64 ``[n, d]`` batch."""
  return np.random.default_rng(seed).normal(size=(n, d))


def pml_vg(loss, x, labels, ref=None, ref_labels=None, indices_tuple=None):
  """PML's float64 value and gradients: ``(value, dx)`` or, with ``ref``,
  ``(value, (dx, dref))``."""
  import torch
  xt = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
  yt = torch.tensor(np.asarray(labels), dtype=torch.int64)
  kw = {}
  if ref is not None:
    rt = torch.tensor(np.asarray(ref, np.float64), requires_grad=True)
    kw = {"ref_emb": rt,
          "ref_labels": torch.tensor(np.asarray(ref_labels),
                                     dtype=torch.int64)}
  value = loss(xt, yt, indices_tuple, **kw)
  if value.requires_grad:
    value.backward()
  dx = (xt.grad if xt.grad is not None else torch.zeros_like(xt)).numpy()
  if ref is None:
    return float(value.detach()), dx
  dr = (rt.grad if rt.grad is not None else torch.zeros_like(rt)).numpy()
  return float(value.detach()), (dx, dr)


def vg(fn, x, labels, **kw):
  """Our jitted value and gradient in ``x`` (float32 compute)."""
  return engine_checks.vg(fn, jnp.asarray(x, jnp.float32),
                          jnp.asarray(labels), **kw)


def close(got, want, rtol=2e-5, grad_atol=5e-5):
  """:func:`engine_checks.close` for ``(value, gradient)`` pairs whose
  gradient may be a tuple of arrays."""
  gg, gw = got[1], want[1]
  if not isinstance(gw, tuple):
    gg, gw = (gg,), (gw,)
  for a, b in zip(gg, gw, strict=True):
    engine_checks.close((got[0], a), (want[0], b), rtol=rtol,
                        grad_atol=grad_atol)


def engines(fn, x, labels, **hyper):
  """``{engine: (value, dx)}``: dense, blockwise (block 3), and on 8 devices
  with all-gathered columns and on the ring (blockwise inside)."""
  x, labels = jnp.asarray(x, jnp.float32), jnp.asarray(labels)
  return {
      "dense": engine_checks.vg(fn, x, labels, **hyper),
      "blockwise": engine_checks.vg(fn, x, labels, block_size=3, **hyper),
      "all_gather": engine_checks.sharded_vg(fn, x, labels, **hyper),
      "ring": engine_checks.sharded_vg(fn, x, labels, collective="ring",
                                       block_size=3, **hyper),
  }


def masked(fn, x, labels, pos_mask, neg_mask, **hyper):
  """``(dense, blockwise, 8 devices on the ring)`` with miner masks."""
  x, labels = jnp.asarray(x, jnp.float32), jnp.asarray(labels)
  pm, nm = jnp.asarray(pos_mask), jnp.asarray(neg_mask)
  run = functools.partial(engine_checks.vg, fn, x, labels, pos_mask=pm,
                          neg_mask=nm, **hyper)
  return (run(), run(block_size=3),
          engine_checks.sharded_vg(fn, x, labels, pm, nm, collective="ring",
                                   block_size=3, **hyper))


def with_references(fn, x, labels, mem, mem_labels, **hyper):
  """:func:`engine_checks.with_references` on float32 inputs."""
  return engine_checks.with_references(
      fn, jnp.asarray(x, jnp.float32), jnp.asarray(labels),
      jnp.asarray(mem, jnp.float32), jnp.asarray(mem_labels), **hyper)


def sharded_dense(fn, x, labels, **hyper):
  """A dense-only loss on 8 devices with all-gathered columns."""
  return engine_checks.sharded_vg(fn, jnp.asarray(x, jnp.float32),
                                  jnp.asarray(labels), **hyper)


def pairs_of(pos_mask, neg_mask):
  """PML's ``indices_tuple`` ``(a1, p, a2, n)`` of two boolean masks."""
  import torch
  a1, p = np.nonzero(pos_mask)
  a2, n = np.nonzero(neg_mask)
  return tuple(torch.tensor(v, dtype=torch.int64) for v in (a1, p, a2, n))


def zero_everywhere(fn, x, labels, **hyper):
  """Asserts value 0 and gradient 0 on every engine."""
  for name, (value, grad) in engines(fn, x, labels, **hyper).items():
    assert float(value) == 0.0, name
    np.testing.assert_array_equal(np.asarray(grad), 0.0, err_msg=name)



def ball_distances(x, ball):
  """Float64 Poincaré distances of ``x`` on ``ball`` (Hyp-ViT's Möbius
  formula, as tests/losses/engine/test_geometry.py)."""
  from tests.losses.reference import mobius_distance_ref
  from tests.losses.reference import poincare_ref
  z = poincare_ref(np.asarray(x, np.float32), ball.c, ball.r)
  d = mobius_distance_ref(z, z, ball.c)
  np.fill_diagonal(d, 0.0)
  return d


# The `reduction` option (circle_jax.losses.engine.reductions) against PML's
# reducers on the same elements.

def _pml_dense_terms(loss_dict, shape):
  """PML's ``DoNothingReducer`` output laid out as ours: a term at its
  anchor (``"element"``) or its ``(anchor, candidate)`` (pairs)."""
  out = np.zeros(shape)
  for info in loss_dict.values():
    losses = np.asarray(info["losses"].detach(), np.float64).reshape(-1)
    idx = info["indices"]
    if info["reduction_type"] == "element":
      out[np.asarray(idx)] += losses
    else:
      out[np.asarray(idx[0]), np.asarray(idx[1])] += losses
  return out


def threshold_bounds(terms):
  """``(low, high)`` near the quartiles of the non-zero ``terms``, each
  halfway across the widest gap between neighbouring terms within an
  eighth of the terms of its quartile, so that float32 rounding keeps every
  term on its side (two terms 1e-7 apart once straddled a bound on one CPU
  and not on another)."""
  t = np.unique(np.asarray(terms, np.float64)[np.asarray(terms) > 0])
  half = max(len(t) // 8, 1)

  def split(q):
    lo, hi = max(q - half, 0), min(q + half, len(t) - 1)
    k = lo + int(np.argmax(np.diff(t[lo:hi + 1])))
    return (t[k] + t[k + 1]) / 2

  return split(len(t) // 4), split((3 * len(t)) // 4 - 1)


def _flat_class_weighted():
  from pytorch_metric_learning import reducers as pr

  class FlatClassWeighted(pr.ClassWeightedReducer):
    def element_reduction_helper(self, losses, indices, labels):
      return super().element_reduction_helper(losses.reshape(-1), indices,
                                              labels)
  return FlatClassWeighted


def reductions_equal_pml(ours, make_pml, x, labels, rtol=2e-5,
                         grad_atol=5e-5, tangent=False,
                         grad_kinds=("class_weighted",)):
  """``ours(x, labels, reduction=r)`` equals PML's ``make_pml(reducer)``
  for every PML reducer but ``DivisorReducer`` (whose divisor a PML loss
  supplies), in one compiled program: the values, and the gradients of
  ``grad_kinds`` (by default the one that weighs each term; the others'
  flow through the same terms); and with
  ``"none"`` our terms are PML's ``DoNothingReducer`` terms at their
  indices, 0 elsewhere. ``"threshold"``'s bounds are the quartiles of the
  non-zero terms; ``"class_weighted"``'s weights a ramp over the classes,
  against PML's reducer on flattened terms (its ``[K, 1]`` terms meet the
  ``[K]`` weights in an outer product: the PML bug of docs/reductions.md).
  ``tangent``: ``x`` has unit rows and PML's gradient is compared
  projected onto the sphere's tangent space (a loss of normalised
  embeddings that PML differentiates as if they were not)."""
  import jax
  import torch
  from pytorch_metric_learning import reducers as pr
  from circle_jax.losses import engine
  xt = torch.tensor(np.asarray(x, np.float64))
  yt = torch.tensor(np.asarray(labels), dtype=torch.int64)
  want = make_pml(pr.DoNothingReducer())(xt, yt)
  low, high = threshold_bounds(np.concatenate([
      np.asarray(v["losses"].detach()).reshape(-1) for v in want.values()]))
  weights = tuple(np.linspace(0.5, 2.0, int(np.max(labels)) + 1))
  pml = (pr.MeanReducer(), pr.SumReducer(), pr.AvgNonZeroReducer(),
         pr.ThresholdReducer(low=low, high=high),
         _flat_class_weighted()(torch.tensor(weights)))
  reductions = (engine.Reduction("mean"), engine.Reduction("sum"),
                engine.Reduction("avg_non_zero"),
                engine.Reduction("threshold", low=low, high=high),
                engine.Reduction("class_weighted", weights=weights))
  y = jnp.asarray(labels)

  @jax.jit
  def run(x):
    return ours(x, y, reduction="none"), [
        (jax.value_and_grad if r.kind in grad_kinds else
         lambda f: lambda x: (f(x), None))(
             lambda x, r=r: ours(x, y, reduction=r))(x)
        for r in reductions]
  terms, got = run(jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(
      np.asarray(terms), _pml_dense_terms(want, terms.shape), rtol=rtol,
      atol=rtol)
  for (value, grad), reducer, r in zip(got, pml, reductions):
    want_value, want_grad = pml_vg(make_pml(reducer), x, labels)
    if grad is None:
      np.testing.assert_allclose(float(value), want_value, rtol=rtol,
                                 atol=1e-6, err_msg=r.kind)
      continue
    if tangent:
      want_grad = want_grad - np.sum(want_grad * x, 1, keepdims=True) * x
    close((value, grad), (want_value, want_grad), rtol=rtol,
          grad_atol=grad_atol)


def reductions_equal_reference(ours, sets, x, labels, rtol=2e-5,
                               sets_of=None):
  """``ours(x, labels, reduction=r)`` equals :func:`reference.reduce_ref`
  of the float64 terms ``sets`` for every kind (``"none"`` the terms), in
  one compiled program. With ``sets_of`` (``x -> sets``, the reference's
  terms of any batch) the ``"class_weighted"`` gradient is also compared
  with the reference's central differences."""
  import jax
  from circle_jax.losses import engine
  from tests.losses import reference
  ref_terms = reference.reduce_ref(sets, labels, "none")
  low, high = threshold_bounds(ref_terms)
  kw = dict(low=low, high=high, divisor=3.0,
            weights=tuple(np.linspace(0.5, 2.0, int(np.max(labels)) + 1)))
  kinds = {"mean": {}, "sum": {}, "avg_non_zero": {},
           "threshold": dict(low=low, high=high),
           "class_weighted": dict(weights=kw["weights"]),
           "divisor": dict(divisor=3.0)}
  y = jnp.asarray(labels)
  weighted = engine.Reduction("class_weighted", weights=kw["weights"])
  run = jax.jit(lambda x: [ours(x, y, reduction="none")] + [
      ours(x, y, reduction=engine.Reduction(k, **a))
      for k, a in kinds.items()] + [jax.grad(
          lambda x: ours(x, y, reduction=weighted))(x) if sets_of else 0])
  got = run(jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(np.asarray(got[0]), ref_terms, rtol=rtol,
                             atol=rtol)
  for value, kind in zip(got[1:-1], kinds):
    np.testing.assert_allclose(
        float(value), reference.reduce_ref(sets, labels, kind, **kw),
        rtol=rtol, atol=1e-6, err_msg=kind)
  if sets_of:
    want = engine_checks.grad_ref(lambda x: reference.reduce_ref(
        sets_of(x), labels, "class_weighted", weights=kw["weights"]), x)
    np.testing.assert_allclose(np.asarray(got[-1]), want, atol=1e-4)
