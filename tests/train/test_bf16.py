"""bfloat16 end to end: the digits job learns with ``model.dtype='bfloat16'``,
and the loss sees float32 embeddings and computes in float32.

``tests/losses/test_bf16.py`` checks the losses on bfloat16 inputs at the
papers' scales; ``tests/train/test_models_step.py`` the models' dtypes. Here:
the trainer with a bfloat16 backbone.
"""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses as losses_lib
from circle_jax.train import loop
from circle_jax.train import run as run_lib
from circle_jax.train import state as state_lib
from circle_jax.train import step as step_lib
from tests.train import helpers

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

BF16 = {"model.dtype": "bfloat16", "parallelism": "none"}


def test_digits_job_learns_in_bfloat16(tmp_path):
  """150 steps of the digits job (experiments/configs/digits.py) with a
  bfloat16 backbone: the run ends (a non-finite loss would stop it with an
  error) and test Recall@1 rises clearly above its value at init (float32:
  0.41 -> 0.61, docs/training.md)."""
  config = helpers.digits_config(**BF16, **{
      "dataset.data_dir": str(tmp_path / "tfds"), "eval_clustering": False,
      "eval_every_steps": 0, "checkpoint_every_steps": 0})
  result = loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert result["config"]["model"]["dtype"] == "bfloat16"
  init, final = result["init"]["recall@1"], result["final"]["recall@1"]
  assert final > init + 0.1, (init, final)
  assert np.isfinite(final)


@pytest.fixture(scope="module")
def bf16_step():
  """The digits config's model in bfloat16, its state, the Circle loss."""
  config = helpers.digits_config(**BF16)
  model = run_lib.build_model(config)
  # info=None: Circle has no loss parameters, so no class count is needed.
  state, entry, hyper, key = run_lib.init_state(config, model, None, (8, 8, 1))
  return model, state, entry, hyper, key


def test_the_loss_receives_float32_embeddings_and_returns_float32(bf16_step):
  model, state, entry, hyper, key = bf16_step
  batch = {"image": jax.ShapeDtypeStruct((40, 8, 8, 1), jnp.float32),
           "label": jax.ShapeDtypeStruct((40,), jnp.int32)}
  seen = {}
  inner = step_lib.make_loss_fn(entry, hyper)

  def watched(embeddings, *args, **kw):
    seen["embeddings"] = embeddings.dtype
    out = inner.fn(embeddings, *args, **kw)
    seen["loss"] = out.dtype
    return out

  loss_fn = dataclasses.replace(inner, fn=watched)

  jax.eval_shape(lambda s, b: step_lib.train_step(
      s, b, loss_fn=loss_fn, base_key=key), state, batch)
  assert seen == {"embeddings": jnp.float32, "loss": jnp.float32}
  # The backbone does compute in bfloat16 (otherwise this proves nothing).
  features = jax.eval_shape(lambda v, x: model.apply(
      v, x, train=True, method=model.features, mutable=["batch_stats"])[0],
      state_lib.model_variables(state), batch["image"])
  assert features.dtype == jnp.bfloat16


def test_bfloat16_embeddings_give_the_float32_loss(bf16_step):
  """The trainer's loss on the bf16 model's embeddings rounded to bfloat16 is
  float32 and equals the loss of those rounded values in float32 (the loss
  upcasts), and the loss of the unrounded embeddings within the input
  rounding (1e-2 |L| + 1e-4, the tolerance of tests/losses/test_bf16.py)."""
  model, state, entry, hyper, key = bf16_step
  batch = helpers.fake_batch(jax.random.PRNGKey(0), batch_size=40,
                             num_classes=5, size=8)
  embeddings, _ = jax.jit(lambda v, x: model.apply(
      v, x, train=True, mutable=["batch_stats"]))(
          state_lib.model_variables(state), batch["image"])
  assert embeddings.dtype == jnp.float32
  # (the regularizers' fields are the step's, not the loss's)
  hyper = {k: v for k, v in hyper.items()
           if k not in losses_lib.regularizers.FIELDS}
  loss = jax.jit(lambda e: losses_lib.get_loss("circle").apply(
      e, batch["label"], None, key=key, **hyper))
  rounded = embeddings.astype(jnp.bfloat16)
  got = loss(rounded)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, loss(rounded.astype(jnp.float32)),
                             rtol=1e-6)
  want = float(loss(embeddings))
  assert abs(float(got) - want) <= 1e-2 * abs(want) + 1e-4
  assert abs(want) > 1e-2  # a loss of ~0 would make the check trivial
