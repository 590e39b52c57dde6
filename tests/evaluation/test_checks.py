"""Specification of circle_jax.evaluation.checks (the shared input checks;
their messages through the metrics are in test_retrieval.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.evaluation import checks


def test_round_up():
  assert [checks.round_up(x, 8) for x in (1, 8, 9, 16)] == [8, 8, 16, 16]


def test_positive_int_and_ks():
  assert checks.check_positive_int(np.int64(3), "n") == 3
  with pytest.raises(TypeError, match="`n` must be an int"):
    checks.check_positive_int(True, "n")
  with pytest.raises(ValueError, match="`n` must be >= 1; got 0"):
    checks.check_positive_int(0, "n")
  assert checks.check_ks(5) == (5,)
  assert checks.check_ks([4, 1, 4]) == (1, 4)


def test_embeddings_and_labels_come_back_on_the_host():
  x = checks.check_embeddings(jnp.ones((3, 2), jnp.bfloat16), "x")
  assert isinstance(x, np.ndarray) and x.dtype == np.float32
  y = checks.check_labels(jnp.arange(3), 3, "y", "x")
  assert isinstance(y, np.ndarray) and list(y) == [0, 1, 2]


def test_devices_default_to_the_local_ones():
  assert checks.resolve_devices(None, None) == tuple(jax.local_devices())
