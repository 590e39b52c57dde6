"""Tests of the PNP loss (circle_jax/losses/pnp.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.grad_check import check_grads

from circle_jax import losses
from circle_jax.losses import pnp
from tests.losses import engine_checks

# Slow (value and gradient against PML on every engine, 8 simulated devices):
# not in the fast tier (CONTRIBUTING.md); CI runs it.
pytestmark = pytest.mark.slow

_RNG = np.random.default_rng(4)
_B, _D = 16, 4
_X = _RNG.normal(size=(_B, _D))
_Y = _RNG.integers(0, 4, _B).astype(np.int32)
_FN = losses.pnp_loss


def _f(r, variant, b=2.0, alpha=1.0):
  return {"O": r, "Ds": np.log1p(r), "Dq": (1 + r) ** -alpha,
          "Iu": (1 + r) * np.log1p(r),
          "Ib": (b * r - np.log1p(b * r)) / b ** 2}[variant]


def _loops(x, y, ref=None, ref_y=None, pos=None, neg=None, b=2.0, alpha=1.0,
           anneal=0.01, variant="O", sim=None):
  """The loss written as loops, float64: the anchor is its own positive
  (``sim``: a given square similarity matrix instead of the cosines)."""
  x = np.asarray(x, np.float64)
  same = ref is None
  ref, ref_y = (x, y) if same else (np.asarray(ref, np.float64), ref_y)
  unit = lambda v: v / np.linalg.norm(v)
  total = 0.0
  for i in range(len(x)):
    s = ([unit(x[i]) @ unit(r) for r in ref] if sim is None
         else list(sim[i]))
    negs = [k for k in range(len(ref)) if y[i] != ref_y[k]
            and (neg is None or neg[i, k])]
    ranked = [s[j] for j in range(len(ref)) if y[i] == ref_y[j]
              and not (same and i == j) and (pos is None or pos[i, j])]
    ranked.append(unit(x[i]) @ unit(x[i]) if sim is None else sim[i, i])
    terms = []
    for t in ranked:
      r = sum(1 / (1 + np.exp(-np.clip((s[k] - t) / anneal, -50, 50)))
              for k in negs)
      terms.append(_f(r, variant, b, alpha))
    total += np.mean(terms)
  loss = total / len(x)
  return 1 - loss if variant == "Dq" else loss


_HYPER = [{"variant": v} for v in pnp.VARIANTS] + [
    {"variant": "Ib", "b": 0.5, "anneal": 0.3},
    {"variant": "Dq", "alpha": 2.0, "anneal": 0.3},
    {"variant": "O", "anneal": 0.1}]


@pytest.mark.parametrize("hyper", _HYPER, ids=str)
def test_equals_pytorch_metric_learning_on_every_engine(hyper):
  torch = pytest.importorskip("torch")
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  xt = torch.tensor(_X, requires_grad=True)
  v = pml.PNPLoss(**hyper)(xt, torch.tensor(_Y, dtype=torch.int64))
  v.backward()
  want = (v.item(), xt.grad.numpy())
  np.testing.assert_allclose(want[0], _loops(_X, _Y, **hyper), rtol=1e-10)
  x = jnp.asarray(_X, jnp.float32)
  for kw in ({}, {"block_size": 3}):
    engine_checks.close(engine_checks.vg(_FN, x, _Y, **hyper, **kw), want,
                        rtol=2e-6, grad_atol=2e-6)
  engine_checks.close(engine_checks.sharded_vg(_FN, x, _Y, block_size=3,
                                               **hyper), want,
                      rtol=2e-6, grad_atol=2e-6)


def test_miner_masks_and_references_equal_the_loops():
  rng = np.random.default_rng(8)
  hyper = {"variant": "Ds", "anneal": 0.2}
  same = _Y[:, None] == _Y[None, :]
  pos = same & (rng.random((_B, _B)) < 0.6)
  neg = ~same & (rng.random((_B, _B)) < 0.5)
  x = jnp.asarray(_X, jnp.float32)
  f = lambda a: _loops(a, _Y, pos=pos, neg=neg, **hyper)
  want = (f(_X), engine_checks.grad_ref(f, _X))
  engine_checks.close(engine_checks.vg(_FN, x, _Y, pos_mask=pos,
                                       neg_mask=neg, **hyper), want,
                      rtol=2e-6, grad_atol=1e-5)
  engine_checks.close(engine_checks.sharded_vg(_FN, x, _Y, pos, neg,
                                               block_size=3, **hyper), want,
                      rtol=2e-6, grad_atol=1e-5)
  mem = rng.normal(size=(24, _D)).astype(np.float32)
  mem_y = rng.integers(0, 4, 24).astype(np.int32)
  f = lambda a: _loops(a, _Y, mem, mem_y, **hyper)
  want = (f(_X), engine_checks.grad_ref(f, _X))
  run = jax.jit(jax.value_and_grad(lambda a: _FN(
      a, _Y, ref=losses.Candidates(mem, mem_y), block_size=5, **hyper)))
  engine_checks.close(run(x), want, rtol=2e-6, grad_atol=1e-5)


def test_the_ring_is_refused_in_one_line():
  with pytest.raises(ValueError, match="no device-ring form"):
    engine_checks.sharded_vg(_FN, jnp.asarray(_X, jnp.float32), _Y,
                             collective="ring")


def test_hand_computed():
  # Anchor 0 at angle 0, positive at 90 deg, negative at 45 deg; anneal 1,
  # variant O.  Anchor 0: R(pos) = sigmoid(cos45 - 0), R(self) =
  # sigmoid(cos45 - 1).  Anchor 1 (the positive): negative at cos45 too:
  # the same.  Anchor 2 (the negative): its negatives are 0 and 1 (cos45
  # each), its only positive is itself: 2 sigmoid(cos45 - 1).
  t = np.deg2rad([0.0, 90.0, 45.0])
  x = jnp.asarray(np.stack([np.cos(t), np.sin(t)], 1), jnp.float32)
  sig = lambda z: 1 / (1 + np.exp(-z))
  c = np.cos(np.deg2rad(45.0))
  a0 = (sig(c) + sig(c - 1)) / 2
  want = (2 * a0 + 2 * sig(c - 1)) / 3
  np.testing.assert_allclose(_FN(x, jnp.array([0, 0, 1]), anneal=1.0), want,
                             rtol=1e-6)


@pytest.mark.parametrize("variant", pnp.VARIANTS)
def test_no_negatives_give_zero_loss_and_zero_gradient(variant):
  x = jnp.asarray(_X, jnp.float32)
  v, g = engine_checks.vg(_FN, x, jnp.zeros(_B, jnp.int32), variant=variant)
  assert abs(float(v)) < 1e-7 and not np.any(np.asarray(g))


def test_check_grads():
  check_grads(lambda a: _FN(a, _Y, variant="Iu", anneal=0.5),
              (jnp.asarray(_X, jnp.float32),), order=1, modes=["rev"],
              eps=1e-3, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bad, match", [
    ({"variant": "Q"}, r"^`variant` must be one of"),
    ({"anneal": 0.0}, "anneal"), ({"b": -1.0}, "b"),
    ({"alpha": 0.0}, "alpha")], ids=str)
def test_bad_hyperparameters_raise_one_line(bad, match):
  with pytest.raises(ValueError, match=match):
    _FN(jnp.asarray(_X, jnp.float32), _Y, **bad)


def test_registry_entry():
  entry = losses.get_loss("pnp")
  assert entry.fn is _FN and entry.kind == "pair" and entry.supports_ref
  assert dict(entry.defaults) == {"b": 2.0, "alpha": 1.0, "anneal": 0.01,
                                  "variant": "O"}


def test_poincare_geometry_equals_the_loops():
  """``geometry=Poincare``: the similarity is minus the ball's distance
  (tests/losses/engine/test_geometry.py's float64 reference), the
  anchor's own similarity 0."""
  from tests.losses.engine import test_geometry as tg  # noqa: PLC0415
  x = tg._x()  # noqa: SLF001
  hyper = {"variant": "Ds", "anneal": 0.5}
  want = _loops(x, tg.LABELS, sim=-tg._distance_ref(x), **hyper)  # noqa: SLF001
  for kw in ({}, {"block_size": 3}):
    got = _FN(jnp.asarray(x), tg.LABELS, geometry=tg.BALL, **hyper, **kw)
    np.testing.assert_allclose(got, want, rtol=2e-5)


def test_reductions_of_its_anchor_terms_equal_the_loops():
  """``reduction`` on every anchor (its mean over its positives, itself
  among them; PML's PNP is already reduced, so its reducers do nothing and
  the loops are the reference): an anchor's term is ``B`` times the loss
  with only its row's negatives (``f(0) = 0`` for the others)."""
  from tests.losses import pml_checks
  x, y = _X[:10], _Y[:10]
  terms = np.array([
      10 * _loops(x, y, neg=np.repeat(np.arange(10)[:, None] == i, 10, 1),
                  variant="Ds",
                  anneal=0.1) for i in range(10)])
  pml_checks.reductions_equal_reference(
      lambda x, y, **kw: _FN(x, y, variant="Ds", anneal=0.1, **kw),
      ((terms, np.ones(10, bool)),), x, y)
