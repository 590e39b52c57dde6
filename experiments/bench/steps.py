"""The trainer's one-device train step, built for a benchmark.

:func:`resnet_step`: ``circle_jax.train.step.make_train_step`` of a ResNet
(128-d embedding, Circle loss, Adam) from the base config, its state
abstract (shapes only, for memory analysis) or concrete (to time it). Used
by ``experiments.bench.gradcache_memory`` and ``experiments.bench.bf16``.
The package is imported inside the function, so that a script's ``--help``
does not load JAX.
"""

from __future__ import annotations


def resnet_step(model_name: str = "resnet50", *, dtype: str = "float32",
                image_size: int = 224, freeze_bn: bool = True,
                concrete: bool = False):
  """``(make_step(chunk) -> jitted step, state)``: the trainer's one-device
  step of ``model_name`` (128-d embedding, Circle loss, Adam). The state is
  abstract (shapes only) unless ``concrete``."""
  import jax  # pylint: disable=import-outside-toplevel

  from circle_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from circle_jax import losses as losses_lib  # pylint: disable=import-outside-toplevel
  from circle_jax import parallel  # pylint: disable=import-outside-toplevel
  from circle_jax import config_facts  # pylint: disable=import-outside-toplevel
  from circle_jax.train import run as run_lib  # pylint: disable=import-outside-toplevel
  from circle_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel

  config = config_lib.base_config()
  config.model.name = model_name
  config.model.embedding_dim = 128
  config.model.freeze_bn = freeze_bn
  config.model.dtype = dtype
  config.parallelism = "none"
  model = run_lib.build_model(config)
  init = lambda: run_lib.init_state(  # noqa: E731
      config, model, None, (image_size, image_size, 3))[0]
  state = init() if concrete else jax.eval_shape(init)
  loss_fn = step_lib.make_loss_fn(losses_lib.get_loss(config.loss.name),
                                  config_facts.loss_hyper(config))
  key = jax.random.PRNGKey(0)

  def make_step(chunk: int = 0):
    return step_lib.make_train_step(loss_fn, base_key=key,
                                    placement=parallel.from_config(config),
                                    embed_chunk_size=chunk)
  return make_step, state
