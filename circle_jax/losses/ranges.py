"""Documented hyperparameter ranges, and the one check against them.

Every range check of the losses goes through :func:`check_range`: a rule's
``ranges`` (checked when the rule is built), a loss's own scalar checks and
:func:`circle_jax.losses.validate_hyper` (what the config checker calls).
Traced values are not checked (they are unknown at trace time).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import numpy as np


class HyperRange(NamedTuple):
  """The documented range of a hyperparameter: an interval of the reals.

  Attributes:
    low, high: the bounds (``-inf`` / ``inf`` for none).
    low_inclusive, high_inclusive: whether the bounds belong to the range.
  """

  low: float
  high: float
  low_inclusive: bool = True
  high_inclusive: bool = True

  def contains(self, value) -> bool:
    above = value >= self.low if self.low_inclusive else value > self.low
    below = value <= self.high if self.high_inclusive else value < self.high
    return bool(above and below)

  def describe(self) -> str:
    """E.g. ``"[1e-06, 10000]"`` or ``"(0, inf)"``."""
    return (f"{'[' if self.low_inclusive else '('}{self.low:g}, "
            f"{self.high:g}{']' if self.high_inclusive else ')'}")

  def __str__(self) -> str:
    return self.describe()


# Scales and temperatures multiply a similarity (or a distance of unit
# vectors) inside an ``exp``. A recomputed similarity differs from the first
# by float32 rounding (about 1e-7 for D up to a few hundred), which the scale
# turns into a logit error: up to 1e4 it stays around 1e-3, so the softmax
# weights (and dense / blockwise, jit / eager results) agree to ~0.1%; at 1e8
# they can differ by 100%. Scales that divide a loss term (Multi-Similarity's
# 1 / alpha) are kept >= 1e-6.
SCALE_RANGE = HyperRange(1e-6, 1e4)
TEMPERATURE_RANGE = HyperRange(0.0, 1e4)  # 0: a plain mean
# Temperatures that divide a similarity inside a softmax (SupCon, NT-Xent):
# at 1e-3 a logit of a cosine is at most 1e3 and its rounding ~1e-4.
DIVIDING_TEMPERATURE_RANGE = HyperRange(1e-3, 1e4)
# Margins and thresholds compared with cosine similarities (in [-1, 1]) or
# added to them.
SIMILARITY_MARGIN_RANGE = HyperRange(-1.0, 1.0)
# Boundaries and margins of Euclidean distances of unit vectors (in [0, 2]).
DISTANCE_MARGIN_RANGE = HyperRange(0.0, 2.0)
NONNEGATIVE_RANGE = HyperRange(0.0, float("inf"), True, False)
POSITIVE_RANGE = HyperRange(0.0, float("inf"), False, False)
UNIT_INTERVAL = HyperRange(0.0, 1.0)


def _concrete_number(value):
  """``value`` as a float when it is a concrete real scalar, else None."""
  if isinstance(value, (bool, np.bool_)):
    return None
  if isinstance(value, (int, float, np.integer, np.floating)):
    return float(value)
  return None  # traced (or array) values are not checked


def check_range(value, name: str, valid: HyperRange, owner: str = "",
                why: str = ""):
  """Checks (when concrete) that a hyperparameter lies in its range.

  Args:
    value: the hyperparameter (Python / NumPy number; traced values pass).
    name: its name, for the message.
    valid: its documented range.
    owner: what it belongs to, for the message (e.g. ``"the Circle rule"``).
    why: an optional reason appended to the bound (e.g. ``" (a distance)"``).

  Raises:
    ValueError: naming the parameter, its range and the value (NaN is never
      in a range).
  """
  number = _concrete_number(value)
  if number is None or valid.contains(number):
    return
  where = f" of {owner}" if owner else ""
  if not owner and valid.high == float("inf") and not valid.high_inclusive:
    bound = f"{'>=' if valid.low_inclusive else '>'} {valid.low:g}{why}"
    raise ValueError(f"`{name}`{where} must be {bound}; got {value}.")
  raise ValueError(
      f"`{name}`{where} must be in {valid}{why}; got {value}. Outside this "
      "range the loss is not accurate in float32 (or not meaningful for "
      "cosine similarities / distances of unit vectors); see the "
      "loss's docstring.")


def check_ranges(values: Mapping[str, Any], ranges: Mapping[str, HyperRange],
                 owner: str = ""):
  """:func:`check_range` for every ``ranges`` entry present in ``values``."""
  for name, valid in ranges.items():
    if name in values:
      check_range(values[name], name, valid, owner)
