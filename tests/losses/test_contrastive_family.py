"""SupCon, NT-Xent, Hyp-ViT's pairwise cross-entropy and the pairwise sigmoid
on every engine, in both geometries (cosine and the Poincaré ball):
naive float64 references (values and central-difference gradients),
check_grads, dense == blockwise == ring on 8 simulated devices, miner masks,
reference embeddings, empty positive sets and small temperatures.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.grad_check import check_grads

from circle_jax import losses
from tests.losses import engine_checks
from tests.losses.reference import loss_ref
from tests.losses.engine_checks import grad_ref
from tests.losses.engine_checks import with_references

# Slow (many compiled cases): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

# 16 samples, 2 per device; label 9 has no positive, label 0 has 4 views.
LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 4, 9, 0], np.int32)
B = len(LABELS)


def family_batch(seed=0, d=5):
  return np.random.default_rng(seed).normal(size=(B, d)).astype(np.float32)


# ----------------------------------------------------------------------------
# Float64 references, written naively.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# The losses and their cases.
# ----------------------------------------------------------------------------

FNS = {"supcon": losses.supcon_loss, "nt_xent": losses.nt_xent_loss,
       "pairwise_ce": losses.pairwise_ce_loss,
       "pairwise_sigmoid": losses.pairwise_sigmoid_loss}
POINCARE = dict(geometry="poincare", c=0.5, r=2.0)
CASES = {
    "supcon": dict(tau=0.5),
    "supcon_poincare": dict(tau=0.5, **POINCARE),
    "nt_xent": dict(tau=0.5),
    "nt_xent_poincare": dict(tau=0.5, **POINCARE),
    "pairwise_ce": dict(tau=0.5),            # Poincaré by default
    "pairwise_ce_cosine": dict(tau=0.5, geometry="cosine"),
    "pairwise_sigmoid": dict(t=4.0, b=-1.0),
    "pairwise_sigmoid_poincare": dict(t=1.0, b=-2.0, **POINCARE),
}


def _split(case):
  name = next(n for n in sorted(FNS, key=len, reverse=True)
              if case.startswith(n))
  return name, FNS[name], CASES[case]


def geometry_kw(kw):
  """The test cases' ``geometry`` / ``c`` / ``r`` as the loss's ``geometry``
  option (a Poincare object, or a name)."""
  kw = dict(kw)
  c, r = kw.pop("c", None), kw.pop("r", None)
  if kw.get("geometry") == "poincare" and (c, r) != (None, None):
    kw["geometry"] = losses.Poincare(c=0.1 if c is None else c,
                                     r=2.3 if r is None else r)
  return kw


def vg(fn, x, labels, **kw):
  return engine_checks.vg(fn, x, labels, **geometry_kw(kw))


def sharded_vg(fn, x, labels, *masks, **kw):
  return engine_checks.sharded_vg(fn, x, labels, *masks, **geometry_kw(kw))


close_to = engine_checks.close


@pytest.mark.parametrize("case", sorted(CASES))
def test_value_and_gradient_equal_the_float64_reference(case):
  name, fn, hyper = _split(case)
  x = family_batch()
  value, grad = vg(fn, x, jnp.asarray(LABELS), **hyper)
  want = loss_ref(name, x, LABELS, hyper)
  assert want > 0
  np.testing.assert_allclose(float(value), want, rtol=2e-5)
  want_grad = grad_ref(lambda v: loss_ref(name, v, LABELS, hyper), x)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-3,
                             atol=2e-4 * np.abs(want_grad).max())


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_blockwise_ring_equal_on_eight_devices(case):
  assert jax.device_count() == 8
  _, fn, hyper = _split(case)
  x, labels = family_batch(seed=1), jnp.asarray(LABELS)
  dense = vg(fn, x, labels, **hyper)
  close_to(vg(fn, x, labels, block_size=3, **hyper), dense)
  close_to(sharded_vg(fn, x, labels, collective="ring", block_size=1,
                     **hyper), dense)
  close_to(sharded_vg(fn, x, labels, block_size=3, **hyper), dense)


@pytest.mark.parametrize("case", ["supcon", "nt_xent_poincare",
                                  "pairwise_ce", "pairwise_sigmoid"])
def test_check_grads_dense_and_blockwise(case):
  _, fn, hyper = _split(case)
  x, labels = jnp.asarray(family_batch(seed=3)), jnp.asarray(LABELS)
  hyper = geometry_kw(hyper)
  for block_size in (None, 4):
    f = jax.jit(lambda x, bs=block_size: fn(x, labels, block_size=bs,
                                            **hyper))
    check_grads(f, (x,), order=1, modes=("rev",), eps=1e-3, atol=2e-3,
                rtol=2e-3)


@pytest.mark.parametrize("case", sorted(CASES))
def test_miner_masks_on_every_engine(case):
  name, fn, hyper = _split(case)
  rng = np.random.default_rng(5)
  pm, nm = (rng.random((B, B)) < 0.7 for _ in range(2))
  x, labels = family_batch(seed=2), jnp.asarray(LABELS)
  masks = dict(pos_mask=jnp.asarray(pm), neg_mask=jnp.asarray(nm))
  dense = vg(fn, x, labels, **masks, **hyper)
  np.testing.assert_allclose(
      float(dense[0]),
      loss_ref(name, x, LABELS, hyper, pos_mask=pm, neg_mask=nm), rtol=2e-5)
  close_to(vg(fn, x, labels, block_size=5, **masks, **hyper), dense)
  close_to(sharded_vg(fn, x, labels, masks["pos_mask"], masks["neg_mask"],
                     collective="ring", block_size=1, **hyper), dense)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_embeddings_on_every_engine(case):
  name, fn, hyper = _split(case)
  rng = np.random.default_rng(7)
  mem = rng.normal(size=(16, 5)).astype(np.float32)
  mem_labels = rng.integers(0, 6, 16).astype(np.int32)
  x, labels = family_batch(seed=4), jnp.asarray(LABELS)

  want, *others = with_references(fn, x, labels, mem, mem_labels,
                                  **geometry_kw(hyper))
  np.testing.assert_allclose(
      float(want[0]),
      loss_ref(name, x, LABELS, hyper, cols=mem, col_y=mem_labels),
      rtol=2e-5)
  for got in others:
    for k in (0, 1):
      close_to((got[0], got[1][k]), (want[0], want[1][k]))


@pytest.mark.parametrize("name", ["supcon", "nt_xent", "pairwise_ce"])
def test_no_positive_gives_zero_loss_and_zero_gradient(name):
  fn = FNS[name]
  labels = jnp.arange(B, dtype=jnp.int32)
  x = family_batch()
  for got in (vg(fn, x, labels), vg(fn, x, labels, block_size=3),
              sharded_vg(fn, x, labels, collective="ring", block_size=3)):
    assert float(got[0]) == 0.0
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)


@pytest.mark.parametrize("name", ["supcon", "nt_xent"])
def test_an_anchor_without_positives_adds_nothing(name):
  """Label 9's anchor only moves through the other anchors' denominators:
  masking its row out of every pair leaves the loss unchanged."""
  fn = FNS[name]
  x, labels = family_batch(), jnp.asarray(LABELS)
  row = np.ones((B, B), bool)
  row[14] = False
  np.testing.assert_allclose(
      float(fn(x, labels)),
      float(fn(x, labels, pos_mask=jnp.asarray(row),
               neg_mask=jnp.asarray(row))), rtol=1e-6)


@pytest.mark.parametrize("tau", [1e-2, 1e-3])
@pytest.mark.parametrize("name", ["supcon", "nt_xent", "pairwise_ce"])
def test_small_temperatures_stay_finite_and_exact_under_jit(name, tau):
  fn = FNS[name]
  x, labels = family_batch(seed=6), jnp.asarray(LABELS)
  dense = vg(fn, x, labels, tau=tau)
  assert np.isfinite(float(dense[0]))
  assert np.all(np.isfinite(np.asarray(dense[1])))
  np.testing.assert_allclose(float(dense[0]),
                             loss_ref(name, x, LABELS, dict(tau=tau)),
                             rtol=1e-4)
  blockwise = vg(fn, x, labels, tau=tau, block_size=4)
  np.testing.assert_allclose(float(blockwise[0]), float(dense[0]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(blockwise[1]), np.asarray(dense[1]),
                             rtol=1e-3, atol=1e-3 * np.abs(dense[1]).max())



@pytest.mark.parametrize("name", sorted(FNS))
def test_registered_with_paper_defaults_and_ranges(name):
  entry = losses.get_loss(name)
  assert entry.fn is FNS[name] and entry.kind == "pair"
  assert entry.execution_options == ("block_size", "collective")
  assert {"c", "r"} <= set(entry.field_ranges())
  defaults = dict(entry.defaults)
  assert entry.geometry == ("poincare" if name == "pairwise_ce"
                            else "cosine")
  assert entry.geometry_defaults() == {
      "geometry": entry.geometry, "c": 0.1, "r": 2.3, "p": 2.0, "power": 1.0,
      "normalize_embeddings": True}
  with pytest.raises(ValueError, match="`c`"):
    losses.validate_hyper(name, c=-1.0)
  x, labels = jnp.asarray(family_batch()), jnp.asarray(LABELS)
  np.testing.assert_allclose(
      float(entry.apply(x, labels)),
      loss_ref(name, family_batch(), LABELS, defaults), rtol=2e-5)
