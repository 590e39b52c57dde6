"""Tests of General Pair Weighting (pair weights by autodiff)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.losses import (
    circle_loss_from_similarity,
    multi_similarity_loss_from_similarity,
    multi_similarity_weights,
    pair_weights,
)
from tests.losses import reference as ref
from tests.losses.reference import ref_ms_weights

LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 4, 2], np.int32)

# pair_weights is jit-able once the loss function is closed over.
MS_WEIGHTS = jax.jit(
    functools.partial(pair_weights, multi_similarity_loss_from_similarity),
    static_argnames=("mining",))
MS_CLOSED = jax.jit(multi_similarity_weights, static_argnames=("mining",))
CIRCLE_WEIGHTS = jax.jit(
    functools.partial(pair_weights, circle_loss_from_similarity))
CIRCLE_GRAD = jax.jit(jax.grad(circle_loss_from_similarity))


@pytest.fixture(scope="module")
def similarity():
  x = np.random.default_rng(0).normal(size=(12, 3))
  return ref.cos(x)


def test_hand_computed_linear_loss():
  # L = sum_ij C_ij S_ij has dL/dS = C: the weights are |C| on the pairs.
  labels = np.array([0, 0, 1])
  c = np.array([[9.0, -2.0, 3.0], [4.0, 9.0, -5.0], [-6.0, 7.0, 9.0]],
               np.float32)
  loss_fn = lambda s, labels: jnp.sum(c * s)
  w_pos, w_neg = jax.jit(functools.partial(pair_weights, loss_fn))(
      np.zeros((3, 3), np.float32), labels)
  np.testing.assert_array_equal(np.asarray(w_pos),
                                [[0, 2, 0], [4, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(np.asarray(w_neg),
                                [[0, 0, 3], [0, 0, 5], [6, 7, 0]])


@pytest.mark.parametrize("mining", [True, False])
def test_ms_weights_equal_the_papers_closed_form(similarity, mining):
  """|dL/dS_ij| of the MS loss is w+_ij / B on positives, w-_ij / B on
  negatives, with the mined sets of the paper."""
  s, labels = similarity, LABELS
  b = len(labels)
  w_pos, w_neg = MS_WEIGHTS(s.astype(np.float32), labels, beta=40.0,
                            mining=mining)
  assert w_pos.dtype == jnp.float32 and w_pos.shape == (b, b)
  want_pos, want_neg = ref_ms_weights(s, labels, beta=40.0, mining=mining)
  np.testing.assert_allclose(np.asarray(w_pos) * b, want_pos, rtol=1e-4,
                             atol=1e-7)
  np.testing.assert_allclose(np.asarray(w_neg) * b, want_neg, rtol=1e-4,
                             atol=1e-7)
  # The exported closed form agrees, and some pairs are (un)mined.
  closed_pos, closed_neg = MS_CLOSED(
      s.astype(np.float32), labels, beta=40.0, mining=mining)
  np.testing.assert_allclose(np.asarray(w_pos), np.asarray(closed_pos) / b,
                             rtol=1e-4, atol=1e-8)
  np.testing.assert_allclose(np.asarray(w_neg), np.asarray(closed_neg) / b,
                             rtol=1e-4, atol=1e-8)
  assert np.count_nonzero(want_pos) > 0 and np.count_nonzero(want_neg) > 0


def test_mining_zeroes_the_weights_of_dropped_pairs(similarity):
  s, labels = similarity.astype(np.float32), LABELS
  mined = MS_WEIGHTS(s, labels, mining=True)
  unmined = MS_WEIGHTS(s, labels, mining=False)
  for m, u in zip(mined, unmined):
    m, u = np.asarray(m), np.asarray(u)
    assert np.all((m > 0) <= (u > 0))  # mining only removes pairs
    assert np.count_nonzero(m) < np.count_nonzero(u)


def test_signs_and_miner_masks(similarity):
  """Positives are pulled and negatives pushed; masked pairs weigh 0."""
  s, labels = similarity.astype(np.float32), LABELS
  g = np.asarray(CIRCLE_GRAD(s, labels))
  w_pos, w_neg = CIRCLE_WEIGHTS(s, labels)
  w_pos, w_neg = np.asarray(w_pos), np.asarray(w_neg)
  np.testing.assert_array_equal(w_pos, np.where(w_pos > 0, -g, 0.0))
  np.testing.assert_array_equal(w_neg, np.where(w_neg > 0, g, 0.0))
  assert np.all(np.diag(w_pos) == 0) and np.all(np.diag(w_neg) == 0)
  keep = np.random.default_rng(1).random((12, 12)) < 0.5
  m_pos, m_neg = CIRCLE_WEIGHTS(s, labels, pos_mask=keep, neg_mask=keep)
  assert np.all(np.asarray(m_pos)[~keep] == 0)
  assert np.all(np.asarray(m_neg)[~keep] == 0)
  assert np.count_nonzero(np.asarray(m_neg)) > 0


def test_bad_inputs():
  s = np.zeros((4, 4), np.float32)
  y = np.array([0, 0, 1, 1])
  with pytest.raises(TypeError, match="loss_fn"):
    pair_weights("multi_similarity", s, y)
  with pytest.raises(ValueError, match="similarity"):
    pair_weights(multi_similarity_loss_from_similarity, s[:3], y)
  with pytest.raises(ValueError, match="labels"):
    pair_weights(multi_similarity_loss_from_similarity, s, y[:3])
  with pytest.raises(TypeError, match="labels"):
    pair_weights(multi_similarity_loss_from_similarity, s, y * 1.0)
