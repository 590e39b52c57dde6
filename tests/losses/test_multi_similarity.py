"""Tests of the Multi-Similarity loss and its pair mining (Wang et al., 2019)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax.losses import (
    multi_similarity_loss,
    multi_similarity_loss_from_similarity,
    multi_similarity_weights,
)
from tests.losses import reference as ref
from tests.losses.reference import mined_sets, ref_ms, ref_ms_weights


# ----------------------------------------------------------------------------
# Float64 references, one anchor at a time, in the official code's style.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# Data and compiled functions.
# ----------------------------------------------------------------------------

LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 4, 2], np.int32)

# Compiled once per input shape (and `mining`); hyperparameters are traced.
MS = jax.jit(multi_similarity_loss, static_argnames=("mining",))
MS_S = jax.jit(multi_similarity_loss_from_similarity,
               static_argnames=("mining",))
MS_S_GRAD = jax.jit(jax.grad(multi_similarity_loss_from_similarity),
                    static_argnames=("mining",))
MS_VG = jax.jit(jax.value_and_grad(multi_similarity_loss),
                static_argnames=("mining",))
MS_WEIGHTS = jax.jit(multi_similarity_weights, static_argnames=("mining",))


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  # A small dimension so that similarities spread over [-1, 1] and mining
  # keeps some pairs and drops others.
  x = rng.normal(size=(12, 3)).astype(np.float32)
  return x, LABELS


# ----------------------------------------------------------------------------
# Values.
# ----------------------------------------------------------------------------


def test_hand_computed_without_mining_effect():
  # labels [0, 0, 1]; anchors 0 and 1 see S_p = S_n = base = 0.5 (mining keeps
  # both: 0.5 + 0.1 > 0.5 and 0.5 - 0.1 < 0.5); anchor 2 has no positive and
  # contributes 0 but counts in B = 3:
  # L = 2 * (log(2) / 2 + log(2) / 50) / 3.
  s = np.full((3, 3), 0.5, np.float32)
  got = MS_S(s, np.array([0, 0, 1]), alpha=2.0, beta=50.0)
  assert got.dtype == jnp.float32 and got.shape == ()
  np.testing.assert_allclose(float(got),
                             2 * (np.log(2) / 2 + np.log(2) / 50) / 3,
                             rtol=1e-6)


def test_hand_computed_mining():
  # Anchor 0 (label 0): positives 1, 2 with S = 0.9, 0.3; negatives 3, 4 with
  # S = 0.1, 0.35. min positive 0.3: keep negatives with S + 0.1 > 0.3, i.e.
  # only 0.35. max negative 0.35: keep positives with S - 0.1 < 0.35, i.e.
  # only 0.3. The other anchors are switched off by pos_mask; B = 5.
  s = np.zeros((5, 5), np.float32)
  s[0, 1:] = [0.9, 0.3, 0.1, 0.35]
  labels = np.array([0, 0, 0, 1, 1])
  pos_mask = np.zeros((5, 5), bool)
  pos_mask[0] = True
  want = (np.log1p(np.exp(-2.0 * (0.3 - 0.5))) / 2.0 +
          np.log1p(np.exp(40.0 * (0.35 - 0.5))) / 40.0) / 5
  got = MS_S(s, labels, beta=40.0, pos_mask=pos_mask)
  np.testing.assert_allclose(float(got), want, rtol=1e-6)
  # Without mining all four pairs count.
  want = (np.log(1 + np.exp(-2.0 * 0.4) + np.exp(2.0 * 0.2)) / 2.0 +
          np.log(1 + np.exp(-40.0 * 0.4) + np.exp(-40.0 * 0.15)) / 40.0) / 5
  got = MS_S(s, labels, beta=40.0, pos_mask=pos_mask, mining=False)
  np.testing.assert_allclose(float(got), want, rtol=1e-6)
  # The dropped pairs get no gradient; the kept ones do.
  g = np.asarray(MS_S_GRAD(s, labels, beta=40.0, pos_mask=pos_mask))
  assert g[0, 1] == 0.0 and g[0, 3] == 0.0
  assert g[0, 2] < 0.0 < g[0, 4]


@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize(
    "hyper",
    [
        dict(),  # the defaults: alpha 2, beta 50, base 0.5, eps 0.1
        dict(alpha=2.0, beta=40.0, base=0.5, epsilon=0.1),  # official code
        dict(alpha=1.0, beta=10.0, base=0.2, epsilon=0.3),
    ],
)
def test_matches_float64_reference(batch, hyper, mining):
  x, labels = batch
  s = ref.cos(x)
  got = MS(x, labels, mining=mining, **hyper)
  want = ref_ms(s, labels, mining=mining, **hyper)
  np.testing.assert_allclose(float(got), want, rtol=2e-5, atol=1e-6)
  # Mining does remove pairs in this batch (so the two modes differ).
  kept = sum(len(a) + len(b) for a, b in (
      mined_sets(s, labels, i, hyper.get("epsilon", 0.1))
      for i in range(12)))
  unmined = sum(len(a) + len(b) for a, b in (
      mined_sets(s, labels, i, 0.1, mining=False) for i in range(12)))
  assert 0 < kept < unmined


def test_miner_masks_are_intersected_with_labels(batch):
  x, labels = batch
  rng = np.random.default_rng(1)
  pos_mask = rng.random((12, 12)) < 0.7
  neg_mask = rng.random((12, 12)) < 0.7
  got = MS(x, labels, pos_mask=pos_mask, neg_mask=neg_mask)
  want = ref_ms(ref.cos(x), labels, pos_mask=pos_mask, neg_mask=neg_mask)
  np.testing.assert_allclose(float(got), want, rtol=2e-5)
  assert abs(float(got) - float(MS(x, labels))) > 1e-4


def test_similarity_form_equals_embedding_form(batch):
  x, labels = batch
  s = ref.cos(x).astype(np.float32)
  np.testing.assert_allclose(float(MS_S(s, labels)), float(MS(x, labels)),
                             rtol=1e-5)


def test_weights_helper_matches_closed_form(batch):
  x, labels = batch
  s = ref.cos(x)
  for mining in (True, False):
    got = MS_WEIGHTS(s.astype(np.float32), labels, beta=40.0, mining=mining)
    want = ref_ms_weights(s, labels, beta=40.0, mining=mining)
    for a, b in zip(got, want):
      assert a.dtype == jnp.float32 and a.shape == (12, 12)
      np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------------------
# Gradients.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mining", [True, False])
def test_check_grads(batch, mining):
  x, labels = batch
  # Mining decisions are piecewise constant: away from a threshold the
  # finite differences see the same mined sets as autodiff.
  f = lambda x: multi_similarity_loss(x, labels, alpha=2.0, beta=10.0,
                                      mining=mining)
  check_grads(f, (x,), order=1, modes=("rev",), eps=1e-3, atol=2e-3,
              rtol=2e-3)


def test_mining_decisions_carry_no_gradient():
  """A positive just inside the mining threshold: its gradient is the loss
  gradient of the mined set only; the thresholds (min/max) pass none."""
  labels = np.array([0, 0, 0, 1, 1])
  s = np.zeros((5, 5), np.float32)
  s[0, 1:] = [0.6, 0.3, 0.25, 0.55]  # min pos 0.3 sets the negative threshold
  pos_mask = np.zeros((5, 5), bool)
  pos_mask[0] = True
  g = np.asarray(MS_S_GRAD(s, labels, pos_mask=pos_mask))
  # Both negatives are mined (0.25 + 0.1 > 0.3); both positives too
  # (0.6 - 0.1 < 0.55). The gradient at S_02 (the min positive) is only its
  # own positive-term derivative, not the derivative of the threshold.
  e = np.exp(-2.0 * (np.array([0.6, 0.3]) - 0.5))
  np.testing.assert_allclose(g[0, 2], -e[1] / (1 + e.sum()) / 5, rtol=1e-5)


# ----------------------------------------------------------------------------
# jit, vmap, retracing and devices.
# ----------------------------------------------------------------------------


def test_jit_vmap_and_no_retracing(batch):
  x, labels = batch

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x, labels):
    return multi_similarity_loss(x, labels)

  want = ref_ms(ref.cos(x), labels)
  np.testing.assert_allclose(float(f(x, labels)), want, rtol=2e-5)
  f(2 * x - 1, (labels + 3) % 5)  # same shapes: no new trace
  with pytest.raises(AssertionError):
    f(x[:6], labels[:6])
  xs = np.stack([x, x[::-1], x + 0.5])
  ys = np.stack([labels, labels[::-1], np.roll(labels, 1)])
  got = jax.jit(jax.vmap(multi_similarity_loss))(xs, ys)
  want = [ref_ms(ref.cos(a), b) for a, b in zip(xs, ys)]
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5)


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_global_batch_equals_single_device(mode):
  n = jax.device_count()
  assert n == 8
  rng = np.random.default_rng(2)
  x = rng.normal(size=(16, 4)).astype(np.float32)
  labels = np.array([0, 1, 2, 3, 4, 5, 6, 7] * 2, np.int32)
  labels[-1] = 9
  pos_mask = rng.random((16, 16)) < 0.8
  loss = functools.partial(multi_similarity_loss, beta=10.0)
  ref_v, ref_g = jax.jit(jax.value_and_grad(
      lambda x: loss(x, labels, pos_mask=pos_mask)))(x)
  f = jax.value_and_grad(
      lambda x, y, m: loss(x, y, axis_name="d", pos_mask=m))
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, g = jax.jit(jax.shard_map(
        f, mesh=mesh, in_specs=(P("d"), P("d"), P("d")),
        out_specs=(P(), P("d"))))(x, labels, pos_mask)
  else:
    v, g = jax.pmap(f, axis_name="d")(
        x.reshape(n, 2, -1), labels.reshape(n, 2), pos_mask.reshape(n, 2, -1))
    v, g = v[0], g.reshape(x.shape)
  np.testing.assert_allclose(float(v), float(ref_v), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(g), np.asarray(ref_g), atol=1e-6)
  assert np.abs(np.asarray(ref_g)).max() > 1e-3


# ----------------------------------------------------------------------------
# Numerics and degenerate batches.
# ----------------------------------------------------------------------------


def _finite(x, labels, **hyper):
  v, g = MS_VG(x, labels, **hyper)
  assert v.dtype == jnp.float32 and v.shape == ()
  assert np.isfinite(float(v))
  assert g.dtype == x.dtype
  assert np.all(np.isfinite(np.asarray(g, np.float32)))
  return float(v), np.asarray(g, np.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("beta", [50.0, 200.0])
def test_large_scales_are_finite(batch, dtype, beta):
  x, labels = batch
  v, _ = _finite(jnp.asarray(x, dtype), labels, beta=beta, alpha=32.0)
  assert v > 0


@pytest.mark.parametrize("mining", [True, False])
@pytest.mark.parametrize("labels", [np.zeros(12, np.int32),
                                    np.arange(12, dtype=np.int32)],
                         ids=["one_class", "all_distinct"])
def test_no_positives_or_no_negatives_give_zero_loss_and_gradient(
    batch, labels, mining):
  x, _ = batch
  for dtype in (jnp.float32, jnp.bfloat16):
    v, g = _finite(jnp.asarray(x, dtype), labels, mining=mining)
    assert v == 0.0
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("case", ["zero", "identical", "huge", "one"])
def test_degenerate_embeddings_are_finite(batch, case):
  x, labels = batch
  unit = x / np.linalg.norm(x, axis=1, keepdims=True)
  if case == "zero":
    x = np.zeros_like(x)
  elif case == "identical":
    x = np.tile(x[:1], (12, 1))
  elif case == "huge":
    x = x * np.float32(1e18)
  elif case == "one":
    x, labels = x[:1], labels[:1]
  v, _ = _finite(x, labels)
  if case == "huge":
    np.testing.assert_allclose(v, _finite(unit, labels)[0], rtol=1e-5)
  elif case == "one":
    assert v == 0.0
  else:  # all similarities 0 (or 1): every pair is mined, a finite loss
    want = ref_ms(ref.cos(x), labels)
    np.testing.assert_allclose(v, want, rtol=1e-5)
    assert v > 0


# ----------------------------------------------------------------------------
# Bad inputs.
# ----------------------------------------------------------------------------


def test_bad_inputs_name_the_argument():
  x = np.ones((4, 3), np.float32)
  y = np.array([0, 0, 1, 1])
  f = multi_similarity_loss
  with pytest.raises(ValueError, match="embeddings"):
    f(x[0], y)
  with pytest.raises(TypeError, match="embeddings"):
    f(x.astype(np.int32), y)
  with pytest.raises(ValueError, match="labels"):
    f(x, y[:3])
  with pytest.raises(ValueError, match="labels"):
    f(x, y[:, None])
  with pytest.raises(TypeError, match="labels"):
    f(x, y.astype(np.float32))
  with pytest.raises(ValueError, match="alpha"):
    f(x, y, alpha=0.0)
  with pytest.raises(ValueError, match="beta"):
    f(x, y, beta=-1.0)
  with pytest.raises(ValueError, match="epsilon"):
    f(x, y, epsilon=-0.1)
  with pytest.raises(ValueError, match="neg_mask"):
    f(x, y, neg_mask=np.ones((3, 4), bool))
  for g in (multi_similarity_loss_from_similarity, multi_similarity_weights):
    with pytest.raises(ValueError, match="similarity"):
      g(np.ones((4, 3), np.float32), y)
    with pytest.raises(TypeError, match="labels"):
      g(np.ones((4, 4), np.float32), y.astype(np.float32))
