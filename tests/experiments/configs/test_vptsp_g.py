"""The VPTSP-G config (vptsp_g.py): the official code's values, the docstring
and results-table rows, and two training steps on a tiny copy of CUB with a
tiny prompted BitFit ViT from an exported timm-named checkpoint, whose frozen
weights do not move. The tiny-copy helpers are test_paper_configs.py's."""

import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import models
from circle_jax.models import vit_prompts
from circle_jax.models import vit_weights
from circle_jax.train import config_checks
from circle_jax.train import loop
from experiments.configs import vptsp_g
from tests.experiments.configs import recipe_checks
from tests.experiments.configs.test_paper_configs import TABLES
from tests.experiments.configs.test_paper_configs import _shrink  # pylint: disable=protected-access
from tests.experiments.configs.test_paper_configs import _words  # pylint: disable=protected-access
from tests.experiments.configs.test_paper_configs import tiny_datasets  # noqa: F401  pylint: disable=unused-import

pytestmark = pytest.mark.usefixtures("module_compilation_cache")

# dataset -> (optimiser, lr, weight decay, proxy multiplier, classes x per
# class, steps, prompts, prompt blocks, step): config/<dataset>_small.yaml.
EXPECTED = {
    "cub200": ("sgd", 5e-3, 1e-6, 20.0, (32, 2), 91 * 15, 10, 12, 0),
    "cars196": ("adamw", 5e-4, 0.0, 20.0, (32, 2), 125 * 50, 80, 11, 2),
    "sop": ("adamw", 1e-4, 1e-4, 500.0, (32, 1), 1860 * 120, 90, 12, 0),
    "inshop": ("adamw", 1e-4, 1e-7, 500.0, (32, 1), 808 * 80, 90, 12, 0),
}


def test_configs_have_the_official_code_recipe():
  for dataset in vptsp_g.DATASETS:
    c = vptsp_g.get_config(dataset)
    c.dataset.manual_dir = "/data"
    config_checks.check_config(c, device_count=2, process_count=1)
    opt, lr, wd, mult, (classes, per), steps, n, depth, step = (
        EXPECTED[dataset])
    k = c.model.kwargs
    assert (c.model.name, c.model.embedding_dim, k.family, k.pool) == (
        "vit_s16", 384, "augreg", "cls")
    assert (k.num_prompts, k.prompt_depth, k.prompt_step, k.head_norm,
            k.tune) == (n, depth, step, True, "bitfit")
    o = c.optim
    assert (o.name, o.learning_rate, o.weight_decay, o.schedule) == (
        opt, lr, wd, "cosine")
    assert o.lr_multipliers["loss"] == pytest.approx(mult)
    assert (c.batch.classes_per_batch, c.batch.images_per_class) == (
        classes, per)
    assert c.num_train_steps == steps
    sem = vptsp_g.SEMANTIC[dataset]
    recipe_checks.assert_loss_recipe(c.loss, {
        "name": "vptsp_proxy_anchor", "margin": 0.1, "alpha": 32.0,
        "proxy_bias_ratio": sem["proxy_bias_ratio"]})
    s = c.semantic_proxies
    assert (s.num_prompts, s.prompt_depth, s.prompt_step, s.dropout,
            s.gru) == (sem["num_prompts"], sem["prompt_depth"],
                       sem["prompt_step"], sem["dropout"], "gru_relu")
    assert o.lr_multipliers["loss/semantic"] == 1.0
  # CosineAnnealingLR(T_max=50) stopped after CUB's 15 epochs: 79.4 %.
  assert vptsp_g.final_fraction("cub200") == pytest.approx(0.7939, abs=1e-4)
  assert vptsp_g.final_fraction("sop") == pytest.approx(0.5)
  with pytest.raises(ValueError, match=re.escape("vptsp_g.py")):
    vptsp_g.get_config("mnist")


def test_docstring_and_table_give_the_command_weights_and_number():
  for dataset in vptsp_g.DATASETS:
    command = vptsp_g.launch_command(dataset)
    assert _words(command) in _words(vptsp_g.__doc__)
    rows = [line for line in TABLES.read_text().splitlines()
            if f"`{command}`" in line]
    assert len(rows) == 1
    r1 = vptsp_g.PUBLISHED[dataset]["recall@1"]
    assert f"R@1: {r1:.1f}" in rows[0] and f"{r1:.1f}" in vptsp_g.__doc__
    assert vptsp_g.TIMM_MODEL in rows[0] and "the semantic proxies" in rows[0]
  assert (f"create_model('{vptsp_g.TIMM_MODEL}', pretrained=True"
          in vptsp_g.__doc__)


@pytest.mark.slow
def test_two_training_steps_keep_the_frozen_weights(tiny_datasets,  # noqa: F811
                                                     tmp_path):
  c = _shrink(vptsp_g.get_config("cub200"), *tiny_datasets["cub200"],
              backbone="config")
  k = c.model.kwargs
  k.depth, k.width, k.num_heads, k.image_size = 2, 32, 2, 64
  k.num_prompts, k.prompt_depth, k.prompt_step = 3, 2, 1
  c.semantic_proxies.prompt_depth = 2
  c.model.dtype = "float32"
  backbone = models.get_model(c.model.name, embedding_dim=8,
                              **dict(k)).backbone
  flat = flax.traverse_util.flatten_dict(backbone.init(
      jax.random.PRNGKey(3), jnp.zeros((1, 64, 64, 3)), train=False)[
          "params"])
  sd = {}
  for p, v in flat.items():
    if p[0] in vit_prompts.ADDED:
      continue  # no checkpoint has them
    key, perm = vit_weights._timm_name(p)  # pylint: disable=protected-access
    v = np.asarray(v) + 0.01
    sd[key] = v.transpose(np.argsort(perm)) if perm else v
  np.savez(tmp_path / "vit.npz", **sd)
  c.model.pretrained = str(tmp_path / "vit.npz")
  c.checkpoint_every_steps = 2
  result = loop.train_and_evaluate(c, str(tmp_path / "run"))
  assert result["step"] == 2 and np.isfinite(
      result["result"]["test"]["map@r"])
  from circle_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  ckpts = ckpt_lib.Checkpoints(str(tmp_path / "run" / "checkpoints"))
  state = ckpts.restore()[0]
  ckpts.close()
  trunk = state["params"]["model"]["backbone"]
  qkv = sd["blocks.1.attn.qkv.weight"].T
  np.testing.assert_array_equal(trunk["blocks_1"]["attn"]["qkv"]["kernel"],
                                qkv)  # frozen: no step, no decay
  assert np.any(trunk["blocks_1"]["attn"]["qkv"]["bias"]
                != sd["blocks.1.attn.qkv.bias"])  # BitFit trains it
  # VPTSP-G's semantic branch ran: its memory (unit rows) and its class
  # prompts are in the checkpoint.
  memory = np.asarray(state["loss_state"])
  np.testing.assert_allclose(np.linalg.norm(memory, axis=-1), 1.0,
                             rtol=1e-5)
  assert state["params"]["loss"]["semantic"]["prompts_0"].shape[1:] == (3, 32)
