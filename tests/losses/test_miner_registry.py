"""circle_jax.losses.miner_registry: every miner by name, its defaults and
its bound form's one-line errors."""

import pytest

from circle_jax import losses
from circle_jax.losses import miner_registry as mr
from tests.losses import pml_checks

Y = pml_checks.LABELS


def test_registry_and_bad_inputs():
  assert set(mr.MINERS) >= {"angular", "batch_easy_hard", "hdc",
                            "triplet_margin", "uniform_histogram",
                            "multi_similarity", "distance_weighted"}
  assert losses.MINERS is mr.MINERS
  assert mr.MINERS["hdc"].defaults == {"filter_percentage": 0.5}
  assert mr.MINERS["angular"].takes_ref is False
  assert mr.MINERS["hdc"].takes_ref is True
  x = pml_checks.batch(0)
  cases = [
      (lambda: mr.get_miner("nope"), "unknown miner"),
      (lambda: mr.MINERS["hdc"].bind(margin=0.1), "no hyperparameter"),
      (lambda: mr.MINERS["uniform_histogram"].bind()(x, Y), "PRNG key"),
  ]
  for fn, match in cases:
    with pytest.raises(ValueError, match=match) as info:
      fn()
    assert "\n" not in str(info.value), match
