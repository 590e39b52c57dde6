"""Tests of the documented hyperparameter ranges and their one check
(circle_jax/losses/ranges.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.losses import ranges


def test_a_range_holds_its_ends_as_declared():
  closed = ranges.HyperRange(-1.0, 1.0)
  assert closed.contains(-1.0) and closed.contains(1.0)
  assert not closed.contains(1.0 + 1e-9) and not closed.contains(np.nan)
  positive = ranges.POSITIVE_RANGE
  assert not positive.contains(0.0) and positive.contains(1e-30)
  assert str(closed) == "[-1, 1]" and str(positive) == "(0, inf)"


def test_check_range_names_the_parameter_its_owner_and_the_range():
  ranges.check_range(0.5, "margin", ranges.SIMILARITY_MARGIN_RANGE)
  with pytest.raises(ValueError, match=r"`margin` of the Circle rule must be "
                                       r"in \[-1, 1\]; got 2.0") as err:
    ranges.check_range(2.0, "margin", ranges.SIMILARITY_MARGIN_RANGE,
                       owner="the Circle rule")
  assert "\n" not in str(err.value)
  with pytest.raises(ValueError, match=r"`scale` must be > 0; got 0.0"):
    ranges.check_range(0.0, "scale", ranges.POSITIVE_RANGE)
  with pytest.raises(ValueError, match="`tau`"):
    ranges.check_ranges({"tau": -1.0, "other": 5.0},
                        {"tau": ranges.TEMPERATURE_RANGE})


def test_traced_values_are_not_checked():
  """Under ``jit`` a hyperparameter may be traced: it passes (unknown)."""
  checked = jax.jit(lambda v: ranges.check_range(
      v, "margin", ranges.SIMILARITY_MARGIN_RANGE) or v)
  assert float(checked(jnp.float32(5.0))) == 5.0
