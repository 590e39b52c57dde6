"""Tests of the input checks (circle_jax/losses/checks.py): the trace-time
shape and dtype checks and the host-side label check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from circle_jax.losses import validate_labels
from circle_jax.losses import checks
from tests.losses.engine import cases


def test_valid_labels_pass_and_come_back_as_numpy():
  out = validate_labels(jnp.array([0, 3, 2, 3]), 4)
  assert isinstance(out, np.ndarray)
  np.testing.assert_array_equal(out, [0, 3, 2, 3])
  labels = np.arange(12, dtype=np.int64).reshape(3, 4)  # [devices, batch]
  np.testing.assert_array_equal(validate_labels(labels, 12), labels)
  assert validate_labels(np.array([], np.int32), 1).shape == (0,)
  np.testing.assert_array_equal(validate_labels(np.uint8([1]), np.int64(2)),
                                [1])


def test_out_of_range_labels_are_named_with_positions():
  with pytest.raises(ValueError) as info:
    validate_labels(np.array([0, 5, 1, -1, 4, 3]), 4)
  msg = str(info.value)
  assert "[0, 4)" in msg and "3 out-of-range" in msg
  assert "values [-1, 4, 5]" in msg and "positions [1, 3, 4]" in msg
  # The edge: num_classes itself is out of range, num_classes - 1 is not.
  with pytest.raises(ValueError, match=r"values \[3\]"):
    validate_labels(np.array([2, 3]), 3)
  with pytest.raises(ValueError, match=r"positions \[\(1, 0\)\]"):
    validate_labels(np.array([[0, 1], [9, 1]]), 2)


def test_long_reports_are_truncated():
  with pytest.raises(ValueError, match=r"found 30 .*\(and 20 more\)"):
    validate_labels(np.arange(30) + 100, 10)


def test_bad_arguments():
  with pytest.raises(TypeError, match="labels.*float"):
    validate_labels(np.array([0.0, 1.0]), 2)
  with pytest.raises(TypeError, match="labels.*bool"):
    validate_labels(np.array([True, False]), 2)
  with pytest.raises(TypeError, match="num_classes"):
    validate_labels(np.array([0, 1]), 2.0)
  with pytest.raises(TypeError, match="num_classes"):
    validate_labels(np.array([0, 1]), True)
  with pytest.raises(ValueError, match="num_classes"):
    validate_labels(np.array([0]), 0)


def test_traced_labels_are_refused_with_a_hint():
  with pytest.raises(TypeError, match="outside jit"):
    jax.jit(lambda l: validate_labels(l, 3))(jnp.array([0, 1]))


def test_input_checks_name_the_argument():
  with pytest.raises(ValueError, match="embeddings"):
    checks.check_embeddings(jnp.ones((3,)))
  with pytest.raises(TypeError, match="embeddings"):
    checks.check_embeddings(jnp.ones((3, 2), jnp.int32))
  with pytest.raises(TypeError, match="labels"):
    checks.check_labels(jnp.ones((3,)), 3)
  with pytest.raises(ValueError, match="length 2"):
    checks.check_labels(jnp.ones((2,), jnp.int32), 3)
  with pytest.raises(ValueError, match="dimension 5"):
    checks.check_class_vectors(jnp.ones((4, 5)), 3)


def test_class_matrix_losses_refuse_multi_hot_labels_in_one_line():
  """Multi-hot labels are for the pair losses: every proxy and classifier
  loss (and the margin loss's per-class beta) names why it refuses them."""
  from circle_jax import losses
  x = jnp.ones((4, 3))
  sets = np.array([[1, 0], [1, 1], [0, 1], [0, 0]], bool)
  calls = {name: (lambda e=e: e.apply(
      x, sets, e.init_params(jax.random.PRNGKey(0), 2, 3)))
           for name, e in losses.LOSSES.items() if e.kind != "pair"}
  calls["margin"] = lambda: losses.margin_loss(x, sets, jnp.ones(2),
                                               key=None)
  for name, call in calls.items():
    with pytest.raises(ValueError, match="multi-hot .* one class id per "
                                         "sample") as info:
      call()
    assert "\n" not in str(info.value), name


@pytest.mark.slow
def test_bad_inputs_of_the_pair_baselines_raise_clear_errors():
  x, y = cases.pair_batch(19, b=4)
  with pytest.raises(ValueError, match="mining"):
    losses.triplet_margin_loss(x, y, mining="hardest")
  with pytest.raises(ValueError, match="margin"):
    losses.triplet_margin_loss(x, y, margin=-1.0)
  with pytest.raises(ValueError, match="embeddings"):
    losses.contrastive_loss(x[0], y)
  with pytest.raises(TypeError, match="labels"):
    losses.lifted_structure_loss(x, y.astype(np.float32))
  with pytest.raises(ValueError, match="pos_mask"):
    losses.n_pair_loss(x, y, pos_mask=np.ones((4, 3), bool))
  with pytest.raises(ValueError, match="beta"):
    losses.margin_loss(x, y, np.ones((2, 2), np.float32))
  with pytest.raises(TypeError, match="beta"):
    losses.margin_loss(x, y, np.ones((4,), np.int32))
  with pytest.raises(ValueError, match="pair_weights"):
    losses.margin_loss(x, y, 1.2, pair_weights=np.ones((4, 5)))
  with pytest.raises(ValueError, match="square"):
    losses.contrastive_loss_from_distance(np.ones((4, 3)), y)
