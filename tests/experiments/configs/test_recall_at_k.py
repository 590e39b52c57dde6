"""The RS@k configs (experiments/configs/recall_at_k.py): the official code's
recipe values, the docstring and results-table rows, the loss through
GradCache (the paper's chunked recompute of large batches), and two training
steps of the recipe with SiMix and GradCache on the embedded digits with a
tiny ViT."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import config as config_lib
from circle_jax import losses
from circle_jax.train import config_checks
from circle_jax.train import gradcache
from circle_jax.train import loop
from experiments.configs import recall_at_k
from tests.experiments.configs import recipe_checks
from tests.experiments.configs.test_paper_configs import TABLES
from tests.experiments.configs.test_paper_configs import _words  # pylint: disable=protected-access
from tests.train import helpers

# main.py: (model, classes per batch, bs_base, optimiser, lr, epochs,
# first milestone, --mixup as the README suggests) per setting.
EXPECTED = {
    "cars196": ("resnet50", 98, 98, "adam", 1e-4, 170, 80, True),
    "cars196_vitb16": ("vit_b16", 98, 98, "adamw", 1e-5, 50, 20, True),
    "sop": ("resnet50", 1000, 200, "adam", 2e-4, 55, 25, False),
    "sop_vitb16": ("vit_b16", 1000, 100, "adamw", 5e-5, 55, 25, False),
}
TRAIN_IMAGES = {"cars196": 8054, "sop": 59551}


def test_configs_have_the_official_code_recipe():
  for setting, want in EXPECTED.items():
    model, classes, chunk, opt, lr, epochs, first, simix = want
    c = recall_at_k.get_config(setting)
    c.dataset.manual_dir = "/data"
    config_checks.check_config(c, device_count=1, process_count=1)
    dataset = setting.split("_")[0]
    assert (c.dataset.name, c.model.name, c.model.embedding_dim) == (
        dataset, model, 512)
    assert c.model.freeze_bn == (model == "resnet50")
    assert (c.batch.sampler, c.batch.classes_per_batch,
            c.batch.images_per_class, c.batch.embed_chunk_size) == (
                "pk", classes, 4, chunk)
    o = c.optim
    assert (o.name, o.learning_rate, o.weight_decay, o.schedule,
            o.decay_factor) == (opt, lr, 4e-4, "step", 0.3)
    per_epoch = TRAIN_IMAGES[dataset] // (classes * 4)
    assert c.num_train_steps == epochs * per_epoch
    assert o.decay_every_steps == first * per_epoch
    assert (c.dataset.validation_fraction, c.best_metric) == (0.0, "")
    recipe_checks.assert_loss_recipe(c.loss, {
        "name": "recall_at_k", "k": (1, 2, 4, 8, 16), "tau1": 0.01,
        "tau2": 1.0, "rank_counts_query": False, "simix": simix,
        "samples_per_class": 4, "block_size": None, "collective": None})


def test_docstring_and_table_give_the_command_and_number():
  table = TABLES.read_text().splitlines()
  for setting in recall_at_k.DATASETS:
    command = recall_at_k.launch_command(setting)
    assert _words(command) in _words(recall_at_k.__doc__)
    rows = [line for line in table if f"`{command}`" in line]
    assert len(rows) == 1
    r1 = recall_at_k.PUBLISHED[setting]["recall@1"]
    assert f"R@1: {r1:.1f}" in rows[0] and f"{r1:.1f}" in recall_at_k.__doc__
    assert "not on this machine" in rows[0]
  with pytest.raises(ValueError, match=re.escape("recall_at_k.py")):
    recall_at_k.get_config("cub200")


def test_the_loss_with_simix_through_gradcache_equals_the_whole_batch():
  # GradCache embeds in chunks and pulls dL/dE back chunk by chunk: with
  # RS@k + SiMix (one key for both) the gradient is the unchunked one.
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(16, 5)), jnp.float32)
  labels = jnp.asarray(np.repeat(np.arange(4), 4), jnp.int32)
  params = jnp.asarray(rng.normal(size=(5, 6)), jnp.float32)
  key = jax.random.PRNGKey(2)

  def embed(p, stats, x):
    return jnp.tanh(x @ p), stats

  def loss(p, chunk):
    fn = gradcache.chunked(embed, chunk) if chunk else embed
    e, _ = fn(p, {}, images)
    return losses.recall_at_k_loss(e, labels, simix=True, key=key,
                                   block_size=8)

  (whole, g_whole), (chunks, g_chunks) = jax.jit(lambda p: (
      jax.value_and_grad(loss)(p, 0), jax.value_and_grad(loss)(p, 4)))(params)
  np.testing.assert_allclose(float(chunks), float(whole), rtol=1e-6)
  # The rank's sigmoid at tau1 = 0.01 scales float32 rounding by 100: the two
  # summation orders differ by up to 2e-7 on a 2-core AMD EPYC (at most
  # 1e-7 on the Xeon where atol was set), against a gradient of 0.05.
  np.testing.assert_allclose(np.asarray(g_chunks), np.asarray(g_whole),
                             rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(g_whole)).max() > 0


@pytest.mark.slow
def test_two_steps_of_the_recipe_with_simix_and_gradcache_on_digits(
    tmp_path):
  # The cars196_vitb16 recipe's loss (SiMix on), optimiser, sampler and
  # GradCache, on the embedded digits with a tiny ViT (patch 4, depth 1).
  recipe = recall_at_k.get_config("cars196_vitb16")
  c = helpers.digits_config(**{"dataset.num_threads": 2})
  c.loss = recipe.loss
  c.optim = recipe.optim
  c.batch.classes_per_batch = 2
  c.batch.images_per_class = recipe.batch.images_per_class
  c.batch.embed_chunk_size = 4
  c.dataset.preprocess.image_size = 28
  c.model.name = "vit_ti16"
  c.model.embedding_dim = 8
  c.model.kwargs = config_lib.Config()
  for k, v in dict(family="augreg", image_size=28, patch_size=4, depth=1,
                   width=16, num_heads=2, pool="cls").items():
    setattr(c.model.kwargs, k, v)
  c = helpers.override(c, num_train_steps=2, eval_every_steps=0,
                       checkpoint_every_steps=0, eval_at_init=False,
                       eval_clustering=False, best_metric="",
                       parallelism="none", async_checkpoints=False)
  c.optim.decay_every_steps = 1
  result = loop.train_and_evaluate(c, str(tmp_path / "run"))
  assert result["step"] == 2
  assert np.isfinite(result["result"]["test"]["map@r"])
