"""Tests of the Ranked List Loss (circle_jax/losses/ranked_list.py)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax.losses import (
    ranked_list_loss,
    ranked_list_loss_from_distance,
    ranked_list_loss_from_similarity,
)
from tests.losses import reference as ref
from tests.losses.reference import rll_reference

# Slow (every engine and mining case): not in the fast tier.
pytestmark = pytest.mark.slow

DEFAULTS = dict(alpha=1.2, margin=0.4, t_neg=10.0, t_pos=0.0, imbalance=0.5)


# ----------------------------------------------------------------------------
# Float64 references, written naively (one anchor, one pair at a time).
# ----------------------------------------------------------------------------


def euclidean64(x):
  """Float64 ||u_i - u_j|| of L2-normalised rows, as sqrt(2 - 2 cos).

  Equal to the direct difference norm for non-zero rows; a zero row has
  cosine 0 with everything, hence distance sqrt(2) (the losses' convention).
  """
  return np.sqrt(np.maximum(2.0 - 2.0 * ref.cos(x), 0.0))


@pytest.fixture(scope="module")
def batch():
  # Seed 42 keeps every distance >= 0.01 away from the boundaries alpha and
  # alpha - margin (checked in the check_grads tests), so float32 and float64
  # agree on the non-trivial sets and finite differences do not cross them.
  rng = np.random.default_rng(42)
  x = rng.normal(size=(12, 3)).astype(np.float32)
  labels = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3], np.int32)
  return x, labels


# ----------------------------------------------------------------------------
# Values.
# ----------------------------------------------------------------------------


def test_hand_computed_tiny_cases():
  # Anchor 0: positive d=1.0 (hinge 0.2), negative d=1.0 (0.2) -> 0.2.
  # Anchor 1: positive 0.2, its only negative d=1.5 is trivial -> 0.1.
  # Anchor 2: no positive, negatives 1.0 (0.2) and 1.5 (trivial) -> 0.1.
  d = jnp.array([[0.0, 1.0, 1.0], [1.0, 0.0, 1.5], [1.0, 1.5, 0.0]])
  got = ranked_list_loss_from_distance(d, jnp.array([0, 0, 1]))
  np.testing.assert_allclose(float(got), (0.2 + 0.1 + 0.1) / 3, rtol=1e-6)
  # All-distinct labels: anchor 0 sees negatives with hinges 0.2 and 0.1,
  # weighted by exp(10 * hinge) -> (0.2 e^2 + 0.1 e) / (e^2 + e).
  d = jnp.array([[0.0, 1.0, 1.1], [1.0, 0.0, 1.5], [1.1, 1.5, 0.0]])
  e = np.e
  l0 = (0.2 * e**2 + 0.1 * e) / (e**2 + e)
  got = ranked_list_loss_from_distance(d, jnp.array([0, 1, 2]))
  np.testing.assert_allclose(float(got), 0.5 * (l0 + 0.2 + 0.1) / 3,
                             rtol=1e-6)
  # Positive weighting T_p: hinges 0.3 and 0.1 of anchor 0 (labels all 0).
  d = jnp.array([[0.0, 1.1, 0.9], [1.1, 0.0, 0.5], [0.9, 0.5, 0.0]])
  got = ranked_list_loss_from_distance(d, jnp.zeros(3, jnp.int32), t_pos=5.0,
                                       imbalance=0.25)
  l0 = (0.3 * np.exp(1.5) + 0.1 * np.exp(0.5)) / (np.exp(1.5) + np.exp(0.5))
  want = 0.75 * (l0 + 0.3 + 0.1) / 3
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


@pytest.mark.parametrize("hyper", [
    {},
    dict(t_neg=0.0, t_pos=3.0, imbalance=0.3),
    dict(alpha=1.0, margin=0.1, t_neg=40.0),
])
def test_matches_float64_reference(batch, hyper):
  x, labels = batch
  h = {**DEFAULTS, **hyper}
  want, _ = rll_reference(euclidean64(x), labels, **h)
  got = ranked_list_loss(jnp.asarray(x), jnp.asarray(labels), **hyper)
  assert got.dtype == jnp.float32 and got.shape == ()
  assert want > 0.05  # the case exercises non-trivial pairs
  np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_miner_masks_are_intersected_with_labels(batch):
  x, labels = batch
  rng = np.random.default_rng(1)
  pos_mask = rng.random((12, 12)) < 0.6
  neg_mask = rng.random((12, 12)) < 0.6
  want, _ = rll_reference(euclidean64(x), labels, pos_mask=pos_mask,
                          neg_mask=neg_mask, **DEFAULTS)
  got = ranked_list_loss(jnp.asarray(x), jnp.asarray(labels),
                         pos_mask=pos_mask, neg_mask=neg_mask)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  unmasked = ranked_list_loss(jnp.asarray(x), jnp.asarray(labels))
  assert abs(float(unmasked) - want) > 1e-3  # the masks do change the loss


def test_matrix_forms_agree_with_the_wrapper(batch):
  x, labels = batch
  s = ref.cos(x)
  d = np.sqrt(np.maximum(2 - 2 * s, 0))
  wrapped = ranked_list_loss(jnp.asarray(x), jnp.asarray(labels))
  from_s = ranked_list_loss_from_similarity(jnp.asarray(s, jnp.float32),
                                            jnp.asarray(labels))
  from_d = ranked_list_loss_from_distance(jnp.asarray(d, jnp.float32),
                                          jnp.asarray(labels))
  np.testing.assert_allclose(float(from_s), float(wrapped), rtol=1e-5)
  np.testing.assert_allclose(float(from_d), float(wrapped), rtol=1e-5)


# ----------------------------------------------------------------------------
# Gradients.
# ----------------------------------------------------------------------------


def test_distance_gradient_is_the_papers_constant_weight_gradient(batch):
  """dL/dd_ij = (1-lambda) w+/sum w+ / B on P*, -lambda w-/sum w- / B on N*."""
  x, labels = batch
  d = euclidean64(x)
  hyper = dict(DEFAULTS, t_pos=2.0, imbalance=0.3)
  _, want = rll_reference(d, labels, **hyper)
  got = jax.grad(functools.partial(ranked_list_loss_from_distance, **hyper))(
      jnp.asarray(d, jnp.float32), jnp.asarray(labels))
  assert np.count_nonzero(want) > 20
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


def test_similarity_gradient_is_chain_rule_through_sqrt(batch):
  """GPW sees |dL/dS| = |dL/dd| / d, since d = sqrt(2 - 2 S)."""
  x, labels = batch
  s = ref.cos(x)
  d = np.sqrt(np.maximum(2 - 2 * s, 0))
  _, grad_d = rll_reference(d, labels, **DEFAULTS)
  np.fill_diagonal(d, 1.0)  # diagonal gradients are 0 in both
  got = jax.grad(ranked_list_loss_from_similarity)(
      jnp.asarray(s, jnp.float32), jnp.asarray(labels))
  np.testing.assert_allclose(np.asarray(got), -grad_d / d, atol=1e-5)


def test_check_grads_wrt_embeddings(batch):
  # With T = 0 the normalised weights are locally constant, so the autodiff
  # gradient is the gradient of the loss value and finite differences apply.
  x, labels = batch
  d = euclidean64(x) + 9 * np.eye(len(x))
  assert np.abs(d - 1.2).min() > 0.01 and np.abs(d - 0.8).min() > 0.01
  f = lambda x: ranked_list_loss(x, jnp.asarray(labels), t_neg=0.0)
  check_grads(f, (jnp.asarray(x),), order=1, modes=("rev",), eps=1e-3,
              atol=1e-2, rtol=1e-2)


# ----------------------------------------------------------------------------
# Transformations.
# ----------------------------------------------------------------------------


def test_jit_vmap_and_no_retracing(batch):
  x, labels = batch
  xs = jnp.stack([jnp.asarray(x), jnp.asarray(x)[::-1], 2 * jnp.asarray(x)])
  ls = jnp.stack([jnp.asarray(labels)] * 3)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def batched(xs, ls):
    return jax.vmap(ranked_list_loss)(xs, ls)

  got = batched(xs, ls)
  got2 = batched(xs + 0.0, ls)  # same shapes: no retrace (would raise)
  want = [rll_reference(euclidean64(np.asarray(xi)), labels, **DEFAULTS)[0]
          for xi in xs]
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(got2))


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_global_batch_equals_single_device(mode):
  n = jax.device_count()
  assert n == 8
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 5, size=16), jnp.int32)
  neg_mask = jnp.asarray(rng.random((16, 16)) < 0.7)
  hyper = dict(t_pos=1.0)

  def single(x):
    return ranked_list_loss(x, labels, neg_mask=neg_mask, **hyper)

  ref_v, ref_g = jax.value_and_grad(single)(x)
  assert float(ref_v) > 0.01

  def local(x, labels, neg_mask):
    return ranked_list_loss(x, labels, axis_name="d", neg_mask=neg_mask,
                            **hyper)

  f = jax.value_and_grad(local)
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("d"),) * 3,
                                 out_specs=(P(), P("d"))))(x, labels, neg_mask)
  else:
    v, g = jax.pmap(f, axis_name="d")(
        x.reshape(n, 2, 4), labels.reshape(n, 2), neg_mask.reshape(n, 2, 16))
    np.testing.assert_allclose(np.asarray(v), float(ref_v), rtol=1e-5)
    v, g = v[0], g.reshape(16, 4)
  np.testing.assert_allclose(float(v), float(ref_v), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(g), np.asarray(ref_g), atol=1e-6)


# ----------------------------------------------------------------------------
# Numerics and degenerate batches.
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=tuple(DEFAULTS))
def _value_and_grad(x, labels, **hyper):
  return jax.value_and_grad(lambda x: ranked_list_loss(x, labels, **hyper))(x)


def test_bfloat16_and_huge_temperatures_are_finite_and_correct(batch):
  x, labels = batch
  # A naive exp(T_n * hinge) overflows float32 for T_n = 1e4; the max-shifted
  # normalisation keeps the exact limit (the weighted mean -> the max hinge).
  v, g = _value_and_grad(jnp.asarray(x), jnp.asarray(labels), t_neg=1e4,
                         t_pos=1e4)
  want, _ = rll_reference(euclidean64(x), labels, **dict(DEFAULTS, t_neg=1e4,
                                                         t_pos=1e4))
  np.testing.assert_allclose(float(v), want, rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(g)))
  xb = jnp.asarray(x, jnp.bfloat16)
  v, g = _value_and_grad(xb, jnp.asarray(labels))
  want, _ = rll_reference(euclidean64(np.asarray(xb, np.float32)), labels,
                          **DEFAULTS)
  assert v.dtype == jnp.float32 and g.dtype == jnp.bfloat16
  np.testing.assert_allclose(float(v), want, rtol=1e-4)
  assert np.all(np.isfinite(np.asarray(g, np.float32)))


def test_zero_identical_and_huge_norm_embeddings(batch):
  x, labels = batch
  x = np.array(x)
  x[0] = 0.0       # zero vector: cosine 0, distance sqrt(2), to all
  x[4] = x[3]      # identical same-class pair: d = 0
  x[7] = x[1]      # identical different-class pair: d = 0
  x[9] *= 1e15     # huge norm: same direction
  v, g = _value_and_grad(jnp.asarray(x), jnp.asarray(labels))
  want, _ = rll_reference(euclidean64(x), labels, **DEFAULTS)
  # Identical pairs: float32 cos is 1 only to ~6e-8, so sqrt(2 - 2 cos) is
  # 0 only to ~3.5e-4 (the documented float32 limit of distances near 0);
  # through the hinges that moves the loss by up to ~1e-4 relative.
  np.testing.assert_allclose(float(v), want, rtol=1e-4)
  assert np.all(np.isfinite(np.asarray(g)))
  # Norms whose square overflows float32 must not produce NaN.
  x[9] *= 1e20
  v, g = _value_and_grad(jnp.asarray(x), jnp.asarray(labels))
  assert np.isfinite(float(v)) and np.all(np.isfinite(np.asarray(g)))


def test_empty_sets_give_zero_terms_and_zero_gradient():
  x = jnp.asarray(np.random.default_rng(3).normal(size=(6, 3)), jnp.float32)
  # A batch of one: no pairs at all.
  v, g = _value_and_grad(x[:1], jnp.array([7]))
  assert float(v) == 0.0 and np.all(np.asarray(g) == 0.0)
  # One class (no negatives): only the positive term, pinned to the reference.
  one = jnp.zeros(6, jnp.int32)
  v, g = _value_and_grad(x, one, imbalance=1.0)  # negative term only
  assert float(v) == 0.0 and np.all(np.asarray(g) == 0.0)
  v, _ = _value_and_grad(x, one)
  want, _ = rll_reference(euclidean64(np.asarray(x)), np.zeros(6), **DEFAULTS)
  np.testing.assert_allclose(float(v), want, rtol=1e-5)
  # All-distinct labels (no positives): the positive term is exactly 0.
  distinct = jnp.arange(6, dtype=jnp.int32)
  v, g = _value_and_grad(x, distinct, imbalance=0.0)
  assert float(v) == 0.0 and np.all(np.asarray(g) == 0.0)
  # Only trivial pairs: positives within alpha - m, negatives beyond alpha.
  far = jnp.array([[1.0, 0.0], [0.99, 0.1], [-1.0, 0.0], [-0.99, -0.1]])
  v, g = _value_and_grad(far, jnp.array([0, 0, 1, 1]))
  assert float(v) == 0.0 and np.all(np.asarray(g) == 0.0)


# ----------------------------------------------------------------------------
# Bad inputs.
# ----------------------------------------------------------------------------


def test_bad_inputs_raise_naming_the_argument():
  x = jnp.ones((4, 3))
  labels = jnp.array([0, 0, 1, 1])
  with pytest.raises(ValueError, match="embeddings"):
    ranked_list_loss(jnp.ones((4,)), labels)
  with pytest.raises(TypeError, match="embeddings"):
    ranked_list_loss(jnp.ones((4, 3), jnp.int32), labels)
  with pytest.raises(ValueError, match="labels"):
    ranked_list_loss(x, jnp.array([0, 1, 1]))
  with pytest.raises(ValueError, match="labels"):
    ranked_list_loss(x, labels[:, None])
  with pytest.raises(TypeError, match="labels"):
    ranked_list_loss(x, labels.astype(jnp.float32))
  with pytest.raises(ValueError, match="neg_mask"):
    ranked_list_loss(x, labels, neg_mask=jnp.ones((4, 3), bool))
  with pytest.raises(ValueError, match="distance"):
    ranked_list_loss_from_distance(jnp.ones((4, 3)), labels)
  with pytest.raises(ValueError, match="similarity"):
    ranked_list_loss_from_similarity(jnp.ones((4,)), labels)
  with pytest.raises(ValueError, match="imbalance"):
    ranked_list_loss(x, labels, imbalance=1.5)
  with pytest.raises(ValueError, match="margin"):
    ranked_list_loss(x, labels, margin=-0.1)
  with pytest.raises(ValueError, match="alpha"):
    ranked_list_loss(x, labels, alpha=0.0)
