"""Tests of the Threshold-Consistent Margin loss (circle_jax/losses/tcm.py)."""

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

_RNG = np.random.default_rng(3)
_B, _D = 16, 4
_X = _RNG.normal(size=(_B, _D))
_Y = _RNG.integers(0, 4, _B).astype(np.int32)
_FN = losses.threshold_consistent_margin_loss
# PML's defaults, then other weights and margins.
_HYPER = [{}, {"lambda_plus": 0.5, "lambda_minus": 2.0, "margin_plus": 0.3,
               "margin_minus": 0.1},
          {"margin_plus": 1.0, "margin_minus": -0.2}]


def _loops(x, y, ref=None, ref_y=None, pos=None, neg=None, lambda_plus=1.0,
           lambda_minus=1.0, margin_plus=0.9, margin_minus=0.5, sim=None):
  """The loss written as loops over the ordered pairs, float64 (``sim``: a
  given similarity matrix instead of the cosines)."""
  x = np.asarray(x, np.float64)
  same = ref is None
  ref, ref_y = (x, y) if same else (np.asarray(ref, np.float64), ref_y)
  sp = sn = 0.0
  cp = cn = 0
  for i in range(len(x)):
    for j in range(len(ref)):
      if same and i == j:
        continue
      s = (x[i] @ ref[j] / np.linalg.norm(x[i]) / np.linalg.norm(ref[j])
           if sim is None else sim[i, j])
      if y[i] == ref_y[j] and (pos is None or pos[i, j]) and s <= margin_plus:
        sp, cp = sp + margin_plus - s, cp + 1
      if y[i] != ref_y[j] and (neg is None or neg[i, j]) and s >= margin_minus:
        sn, cn = sn + s - margin_minus, cn + 1
  return (lambda_plus * (sp / cp if cp else 0.0)
          + lambda_minus * (sn / cn if cn else 0.0))


def _pml(hyper, indices_tuple=None):
  torch = pytest.importorskip("torch")
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  xt = torch.tensor(_X, requires_grad=True)
  v = pml.ThresholdConsistentMarginLoss(**hyper)(
      xt, torch.tensor(_Y, dtype=torch.int64), indices_tuple)
  v.backward()
  return v.item(), xt.grad.numpy()


@pytest.mark.parametrize("hyper", _HYPER, ids=str)
def test_equals_pytorch_metric_learning_on_every_engine(hyper):
  want = _pml(hyper)
  np.testing.assert_allclose(want[0], _loops(_X, _Y, **hyper), rtol=1e-10)
  x = jnp.asarray(_X, jnp.float32)
  for kw in ({}, {"block_size": 3}):
    engine_checks.close(engine_checks.vg(_FN, x, _Y, **hyper, **kw), want,
                        rtol=2e-6, grad_atol=2e-6)
  for collective in ("all_gather", "ring"):
    engine_checks.close(engine_checks.sharded_vg(
        _FN, x, _Y, collective=collective, block_size=3, **hyper), want,
                        rtol=2e-6, grad_atol=2e-6)


def test_miner_masks_equal_pytorch_metric_learning_indices_tuple():
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(8)
  same = _Y[:, None] == _Y[None, :]
  pos = same & ~np.eye(_B, dtype=bool) & (rng.random((_B, _B)) < 0.6)
  neg = ~same & (rng.random((_B, _B)) < 0.4)
  a1, p = np.nonzero(pos)
  a2, n = np.nonzero(neg)
  want = _pml({}, tuple(torch.tensor(v) for v in (a1, p, a2, n)))
  np.testing.assert_allclose(want[0], _loops(_X, _Y, pos=pos, neg=neg),
                             rtol=1e-10)
  x = jnp.asarray(_X, jnp.float32)
  got = engine_checks.vg(_FN, x, _Y, pos_mask=pos, neg_mask=neg)
  engine_checks.close(got, want, rtol=2e-6, grad_atol=2e-6)
  got = engine_checks.sharded_vg(_FN, x, _Y, pos, neg, collective="ring",
                                 block_size=3)
  engine_checks.close(got, want, rtol=2e-6, grad_atol=2e-6)


def test_reference_embeddings_on_every_engine():
  """With a memory the pairs are (anchor, reference) (PML 2.9 pairs the
  anchors with its own embeddings there: not checked against it)."""
  rng = np.random.default_rng(9)
  mem = rng.normal(size=(24, _D)).astype(np.float32)
  mem_y = rng.integers(0, 4, 24).astype(np.int32)
  x = jnp.asarray(_X, jnp.float32)
  want = _loops(_X, _Y, mem, mem_y, margin_plus=0.5, margin_minus=0.0)
  f = lambda a: _loops(a, _Y, mem, mem_y, margin_plus=0.5, margin_minus=0.0)
  want_g = engine_checks.grad_ref(f, _X)
  runs = engine_checks.with_references(_FN, x, _Y, mem, mem_y,
                                       margin_plus=0.5, margin_minus=0.0)
  for v, (gx, _) in runs:
    engine_checks.close((v, gx), (want, want_g), rtol=2e-6, grad_atol=1e-4)


def test_hand_computed():
  # Unit vectors at angles 0, 60, 90 degrees; labels [0, 0, 1].
  # Positives (0,1), (1,0): s = 0.5 <= 0.9: mean 0.4.
  # Negatives (0,2), (2,0): s = 0 < 0.5; (1,2), (2,1): s = cos 30 ~ 0.866
  # >= 0.5: mean 0.366.
  t = np.deg2rad([0.0, 60.0, 90.0])
  x = jnp.asarray(np.stack([np.cos(t), np.sin(t)], 1), jnp.float32)
  want = 0.4 + (np.cos(np.deg2rad(30.0)) - 0.5)
  np.testing.assert_allclose(_FN(x, jnp.array([0, 0, 1])), want, rtol=1e-6)


def test_empty_sets_give_zero_loss_and_zero_gradient():
  x = jnp.asarray(_X, jnp.float32)
  # No positives (all labels distinct) and no negative above m_- = 1.
  v, g = engine_checks.vg(_FN, x, jnp.arange(_B), margin_minus=1.0)
  assert float(v) == 0.0 and not np.any(np.asarray(g))
  # Empty miner masks.
  none = np.zeros((_B, _B), bool)
  v, g = engine_checks.vg(_FN, x, _Y, pos_mask=none, neg_mask=none)
  assert float(v) == 0.0 and not np.any(np.asarray(g))


def test_check_grads():
  check_grads(lambda a: _FN(a, _Y, margin_plus=0.3, margin_minus=0.1),
              (jnp.asarray(_X, jnp.float32),), order=1, modes=["rev"],
              eps=1e-3, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bad", [{"margin_plus": 1.5},
                                 {"margin_minus": -2.0},
                                 {"lambda_plus": -1.0}], ids=str)
def test_bad_hyperparameters_raise_one_line(bad):
  name = next(iter(bad))
  with pytest.raises(ValueError, match=name):
    _FN(jnp.asarray(_X, jnp.float32), _Y, **bad)


def test_registry_entry():
  entry = losses.get_loss("threshold_consistent_margin")
  assert entry.fn is _FN and entry.kind == "pair" and entry.supports_ref
  assert dict(entry.defaults) == {"lambda_plus": 1.0, "lambda_minus": 1.0,
                                  "margin_plus": 0.9, "margin_minus": 0.5}
  assert jax.numpy.isfinite(entry.apply(jnp.asarray(_X, jnp.float32), _Y))


def test_poincare_geometry_equals_the_loops_on_every_engine():
  """``geometry=Poincare``: the similarity is minus the ball's distance
  (tests/losses/engine/test_geometry.py's float64 reference)."""
  from tests.losses.engine import test_geometry as tg  # noqa: PLC0415
  x = tg._x()  # noqa: SLF001
  hyper = {"margin_plus": -0.5, "margin_minus": -1.0}
  want = _loops(x, tg.LABELS, sim=-tg._distance_ref(x), **hyper)  # noqa: SLF001
  for kw in ({}, {"block_size": 3}):
    got = _FN(jnp.asarray(x), tg.LABELS, geometry=tg.BALL, **hyper, **kw)
    np.testing.assert_allclose(got, want, rtol=2e-5)
  assert want > 0


def test_reductions_equal_the_loops_on_its_pairs():
  """``reduction`` on TCM's pairs, each set reduced on its own (a pair on
  the right side of its margin has term 0); PML's TCM is already reduced,
  so its reducers do nothing and the loops are the reference."""
  from tests.losses import reference
  x, y = pml_checks.batch(6, n=12), np.array([0, 1, 2, 3] * 3)
  hyper = dict(lambda_plus=0.5, lambda_minus=2.0, margin_plus=0.3,
               margin_minus=0.1)
  pml_checks.reductions_equal_reference(
      lambda x, y, **kw: _FN(x, y, **hyper, **kw),
      reference.tcm_terms_ref(x, y, **hyper), x, y,
      sets_of=lambda x: reference.tcm_terms_ref(x, y, **hyper))
