"""A recipe config's loss section, checked against what the recipe sets."""

from circle_jax import config as config_lib


def assert_loss_recipe(section, expected: dict) -> None:
  """The fields ``expected`` names have its values, and every other field of
  the loss section (the options every loss has: reduction, regularizers,
  the geometry's fields...) it holds is at the loss's default
  (:func:`circle_jax.config.loss_config`)."""
  got = dict(section)
  assert {k: got.get(k, "<missing>") for k in expected} == expected
  defaults = dict(config_lib.loss_config(expected["name"]))
  rest = {k: v for k, v in got.items() if k not in expected}
  assert rest == {k: defaults.get(k, "<not a field>") for k in rest}
