"""A recipe config's loss section, checked against what the recipe sets."""

from circle_jax import config as config_lib


def assert_loss_recipe(section, expected: dict) -> None:
  """The fields ``expected`` names have its values, and every other field of
  the loss section (the options every loss has: reduction, regularizers,
  the geometry's fields...) it holds is at the loss's default
  (:func:`circle_jax.config.loss_config`; for a ``config.more_losses``
  term, :func:`circle_jax.config.more_loss`, with its own miner)."""
  got = dict(section)
  assert {k: got.get(k, "<missing>") for k in expected} == expected
  defaults = dict(config_lib.more_loss(expected["name"]) if "weight" in got
                  else config_lib.loss_config(expected["name"]))
  rest = {k: v for k, v in got.items() if k not in expected}
  assert rest == {k: defaults.get(k, "<not a field>") for k in rest}


def tiny_vit(c, embedding_dim: int):
  """A shrunk recipe's ViT made tiny for a two-step CPU run (one block of
  width 32 at 64 pixels, float32), with ``embedding_dim``."""
  c.model.kwargs.depth = 1
  c.model.kwargs.width = 32
  c.model.kwargs.num_heads = 2
  c.model.kwargs.image_size = 64
  c.model.dtype = "float32"
  c.model.embedding_dim = embedding_dim
  return c
