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
from jax.test_util import check_grads

from circle_jax import losses
from tests.losses import reference as ref
from tests.losses import engine_checks
from tests.losses.engine_checks import grad_ref
from tests.losses.engine_checks import with_references

# Slow (many compiled cases): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

# 16 samples, 2 per device; label 9 has no positive, label 0 has 4 views.
LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 4, 9, 0], np.int32)
B = len(LABELS)


def _x(seed=0, d=5):
  return np.random.default_rng(seed).normal(size=(B, d)).astype(np.float32)


# ----------------------------------------------------------------------------
# Float64 references, written naively.
# ----------------------------------------------------------------------------


def poincare_ref(x, c, r):
  """Clip, exponential map at 0 and hyptorch's projection, float64."""
  x = np.asarray(x, np.float64)
  n = np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-5)
  x = x * np.minimum(1.0, r / n)
  n = np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-5)
  z = np.tanh(np.sqrt(c) * n) * x / (np.sqrt(c) * n)
  n = np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-5)
  top = (1 - 1e-3) / np.sqrt(c)
  return np.where(n > top, z / n * top, z)


def mobius_distance_ref(a, b, c):
  """Hyp-ViT's form: 2/sqrt(c) artanh(sqrt(c) |(-a) (+)_c b|), float64."""
  x = -np.asarray(a, np.float64)[:, None, :]
  y = np.asarray(b, np.float64)[None, :, :]
  xy, x2, y2 = (x * y).sum(-1), (x * x).sum(-1), (y * y).sum(-1)
  num = (1 + 2 * c * xy + c * y2)[..., None] * x + (1 - c * x2)[..., None] * y
  add = num / (1 + 2 * c * xy + c * c * x2 * y2)[..., None]
  return 2 / np.sqrt(c) * np.arctanh(np.sqrt(c) * np.linalg.norm(add, axis=-1))


def similarity_ref(x, cols=None, geometry="cosine", c=0.1, r=2.3):
  cols = x if cols is None else cols
  if geometry == "cosine":
    return ref.cos(x, cols)
  return -mobius_distance_ref(poincare_ref(x, c, r), poincare_ref(cols, c, r),
                              c)


def masks_ref(y, col_y=None, pos_mask=None, neg_mask=None):
  """Same / other label, no self pair (when the columns are the batch)."""
  col_y = y if col_y is None else col_y
  same = y[:, None] == col_y[None, :]
  usable = np.ones_like(same)
  if col_y is y:
    np.fill_diagonal(usable, False)
  pos, neg = same & usable, ~same & usable
  if pos_mask is not None:
    pos, neg = pos & pos_mask, neg & neg_mask
  return pos, neg


def supcon_ref(s, pos, neg, tau, pair_mean=False):
  total, count = 0.0, 0
  for i in range(len(s)):
    p, a = np.flatnonzero(pos[i]), np.flatnonzero(pos[i] | neg[i])
    if not len(p):
      continue
    terms = [ref.logsumexp(s[i, a] / tau) - s[i, j] / tau for j in p]
    total += sum(terms) if pair_mean else np.mean(terms)
    count += len(p) if pair_mean else 1
  return total / max(count, 1)


def sigmoid_ref(s, pos, neg, t, b):
  total = 0.0
  for i in range(len(s)):
    total += sum(ref.softplus(-(t * s[i, j] + b)) for j in np.flatnonzero(pos[i]))
    total += sum(ref.softplus(t * s[i, j] + b) for j in np.flatnonzero(neg[i]))
  return total / len(s)


def loss_ref(name, x, y, hyper, cols=None, col_y=None, pos_mask=None,
             neg_mask=None):
  geo = {k: hyper[k] for k in ("geometry", "c", "r") if k in hyper}
  if name == "pairwise_ce":
    geo.setdefault("geometry", "poincare")
  s = similarity_ref(x, cols, **geo)
  pos, neg = masks_ref(y, col_y, pos_mask, neg_mask)
  if name == "pairwise_sigmoid":
    return sigmoid_ref(s, pos, neg, hyper.get("t", 10.0), hyper.get("b", -10.0))
  tau = hyper.get("tau", 0.2 if name == "pairwise_ce" else 0.1)
  return supcon_ref(s, pos, neg, tau, pair_mean=name != "supcon")


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
  x = _x()
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
  x, labels = _x(seed=1), jnp.asarray(LABELS)
  dense = vg(fn, x, labels, **hyper)
  close_to(vg(fn, x, labels, block_size=3, **hyper), dense)
  close_to(sharded_vg(fn, x, labels, collective="ring", block_size=1,
                     **hyper), dense)
  close_to(sharded_vg(fn, x, labels, block_size=3, **hyper), dense)


@pytest.mark.parametrize("case", ["supcon", "nt_xent_poincare",
                                  "pairwise_ce", "pairwise_sigmoid"])
def test_check_grads_dense_and_blockwise(case):
  _, fn, hyper = _split(case)
  x, labels = jnp.asarray(_x(seed=3)), jnp.asarray(LABELS)
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
  x, labels = _x(seed=2), jnp.asarray(LABELS)
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
  x, labels = _x(seed=4), jnp.asarray(LABELS)

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
  x = _x()
  for got in (vg(fn, x, labels), vg(fn, x, labels, block_size=3),
              sharded_vg(fn, x, labels, collective="ring", block_size=3)):
    assert float(got[0]) == 0.0
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)


@pytest.mark.parametrize("name", ["supcon", "nt_xent"])
def test_an_anchor_without_positives_adds_nothing(name):
  """Label 9's anchor only moves through the other anchors' denominators:
  masking its row out of every pair leaves the loss unchanged."""
  fn = FNS[name]
  x, labels = _x(), jnp.asarray(LABELS)
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
  x, labels = _x(seed=6), jnp.asarray(LABELS)
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


@pytest.mark.parametrize("t,b", [(1e4, -1e4), (1e-6, 1e4), (10.0, -10.0)])
def test_sigmoid_range_ends_stay_finite(t, b):
  x, labels = _x(seed=6), jnp.asarray(LABELS)
  for bs in (None, 4):
    value, grad = vg(losses.pairwise_sigmoid_loss, x, labels, t=t, b=b,
                      block_size=bs)
    assert np.isfinite(float(value)) and np.all(np.isfinite(grad))


# ----------------------------------------------------------------------------
# The Poincaré geometry.
# ----------------------------------------------------------------------------


def test_poincare_distance_equals_the_float64_mobius_form():
  g = losses.Poincare(c=0.7, r=3.0)
  x = _x(seed=8, d=6) * 2
  z = np.asarray(g.embed(jnp.asarray(x)), np.float64)
  np.testing.assert_allclose(z, poincare_ref(x, 0.7, 3.0), rtol=1e-5,
                             atol=1e-6)
  got = np.asarray(g.distance(jnp.asarray(z, jnp.float32),
                              jnp.asarray(z, jnp.float32)))
  want = mobius_distance_ref(z, z, 0.7)
  off = ~np.eye(B, dtype=bool)
  np.testing.assert_allclose(got[off], want[off], rtol=1e-4)
  # Self distances: the float32 cancellation of |x|^2 + |y|^2 - 2 x.y,
  # magnified near the boundary (hyperbolic.py's accuracy note).
  sq = (z * z).sum(1)
  bound = np.sqrt(2 * 1e-6 * sq / (1 - 0.7 * sq) ** 2)
  assert np.all(np.abs(np.diag(got)) <= np.maximum(bound, 1e-5))


@pytest.mark.parametrize("scale", [1e30])
def test_poincare_is_safe_at_the_boundary_under_jit(scale):
  """Norms driven to the ball's edge 1/sqrt(c) (no clipping, huge inputs):
  finite points, distances, losses and gradients, and the distances of the
  projected points equal the float64 Möbius form."""
  c, r = 1.0, 1e3
  g = losses.Poincare(c=c, r=r)
  x = _x(seed=9) * scale
  z = jax.jit(g.embed)(jnp.asarray(x))
  norms = np.linalg.norm(np.asarray(z, np.float64), axis=1)
  assert np.all(norms < 1 / np.sqrt(c)) and np.all(np.isfinite(norms))
  d = np.asarray(jax.jit(g.distance)(z, z))
  assert np.all(np.isfinite(d))
  off = ~np.eye(B, dtype=bool)
  want = mobius_distance_ref(np.asarray(z, np.float64),
                             np.asarray(z, np.float64), c)
  np.testing.assert_allclose(d[off], want[off], rtol=2e-3, atol=1e-2)
  for name, fn in FNS.items():
    for bs in (None, 4):
      value, grad = vg(fn, x, jnp.asarray(LABELS), geometry="poincare", c=c,
                        r=r, block_size=bs)
      assert np.isfinite(float(value)), name
      assert np.all(np.isfinite(np.asarray(grad))), name


def test_poincare_identical_points_have_a_finite_gradient():
  x = np.repeat(_x(seed=10)[:8], 2, axis=0)  # every point twice
  labels = jnp.asarray(np.repeat(np.arange(8), 2).astype(np.int32))
  for bs in (None, 4):
    value, grad = vg(losses.supcon_loss, x, labels, geometry="poincare",
                      block_size=bs)
    assert np.isfinite(float(value)) and np.all(np.isfinite(grad))


def test_unknown_geometry_and_bad_curvature_are_one_line_errors():
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  with pytest.raises(ValueError, match="geometry") as info:
    losses.supcon_loss(x, labels, geometry="sphere")
  assert "\n" not in str(info.value)
  with pytest.raises(ValueError, match="`c`"):
    losses.nt_xent_loss(x, labels, geometry=losses.Poincare(c=0.0))
  with pytest.raises(ValueError, match="`tau`"):
    losses.supcon_loss(x, labels, tau=1e-4)


@pytest.mark.parametrize("name", sorted(FNS))
def test_registered_with_paper_defaults_and_ranges(name):
  entry = losses.get_loss(name)
  assert entry.fn is FNS[name] and entry.kind == "pair"
  assert entry.execution_options == ("block_size", "collective")
  assert {"c", "r"} <= set(entry.field_ranges())
  defaults = dict(entry.defaults)
  assert entry.geometry == ("poincare" if name == "pairwise_ce"
                            else "cosine")
  assert entry.geometry_defaults() == {"geometry": entry.geometry, "c": 0.1,
                                       "r": 2.3}
  with pytest.raises(ValueError, match="`c`"):
    losses.validate_hyper(name, c=-1.0)
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  np.testing.assert_allclose(
      float(entry.apply(x, labels)),
      loss_ref(name, _x(), LABELS, defaults), rtol=2e-5)
