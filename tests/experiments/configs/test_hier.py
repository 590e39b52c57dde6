"""The HIER recipe (hier.py): the official scripts' values, the docstring
and results-table rows, and two training steps on a tiny copy of CUB with a
tiny ViT (Proxy-Anchor + HIER through config.more_losses, HIER's proxies at
their own learning-rate multiplier)."""

import numpy as np
import pytest

from circle_jax.train import config_checks
from circle_jax.train import loop
from experiments.configs import hier
from experiments.configs import hyp_vit
from tests.experiments.configs import recipe_checks
from tests.experiments.configs.test_hyp_vit import _export_tiny_vit  # pylint: disable=protected-access
from tests.experiments.configs.test_paper_configs import TABLES
from tests.experiments.configs.test_paper_configs import _shrink  # pylint: disable=protected-access
from tests.experiments.configs.test_paper_configs import _words  # pylint: disable=protected-access
from tests.experiments.configs.test_paper_configs import tiny_datasets  # noqa: F401  pylint: disable=unused-import

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = [pytest.mark.slow,
              pytest.mark.usefixtures("module_compilation_cache")]

# scripts/ViT/hier_*.sh: (epochs, warm-up epochs, weight decay, fc lr
# scale) and train images // 180 steps per epoch.
EXPECTED = {"cub200": (100, 1, 1e-2, 1.0, 32),
            "cars196": (100, 1, 1e-2, 1.0, 44),
            "sop": (150, 5, 1e-4, 100.0, 330),
            "inshop": (150, 5, 1e-4, 100.0, 143)}


def test_configs_have_the_official_scripts_recipe():
  for dataset in hier.DATASETS:
    c = hier.get_config(dataset)
    c.dataset.manual_dir = "/data"
    config_checks.check_config(c, device_count=2, process_count=1)
    epochs, warmup, wd, head, per_epoch = EXPECTED[dataset]
    assert (c.model.name, c.model.embedding_dim, c.model.kwargs.pool,
            c.model.kwargs.frozen_patch_embed) == ("vit_s16", 384, "cls",
                                                   True)
    assert (c.batch.sampler, c.batch.classes_per_batch,
            c.batch.images_per_class) == ("pk", 90, 2)
    o = c.optim
    assert (o.name, o.learning_rate, o.weight_decay, o.eps, o.schedule,
            o.grad_clip_norm, o.grad_clip_value) == (
                "adamw", 1e-5, wd, 1e-4, "constant", 0.0, 10.0)
    assert dict(o.lr_multipliers) == {
        "backbone": 1.0, "head": head, "loss": 1e4,
        "loss/more_losses/hier": 50.0}
    assert o.freeze_backbone_steps == warmup * per_epoch
    assert c.num_train_steps == epochs * per_epoch
    recipe_checks.assert_loss_recipe(c.loss, {"name": "proxy_anchor",
                                              "margin": 0.1, "alpha": 32.0})
    term = dict(c.more_losses.hier)
    assert (term["name"], term["weight"]) == ("hier", 0.5)
    recipe_checks.assert_loss_recipe(c.more_losses.hier, {
        "name": "hier", "weight": 0.5, "num_proxies": 512, "c": 0.1,
        "r": 2.3, "topk": 20, "delta": 0.1, "tau": 0.1,
        "triplets_per_anchor": 50})


def test_docstring_and_table_give_the_command_and_number():
  for dataset in hier.DATASETS:
    command = hyp_vit.launch_command("hier.py", dataset)
    assert _words(command) in _words(hier.__doc__)
    rows = [line for line in TABLES.read_text().splitlines()
            if f"`{command}`" in line]
    assert len(rows) == 1
    r1 = hier.PUBLISHED[dataset]["recall@1"]
    assert f"R@1: {r1:.1f}" in rows[0] and f"{r1:.1f}" in hier.__doc__
    assert "| 384 |" in rows[0] and "not on this machine" in rows[0]


def test_two_training_steps_with_hier(tiny_datasets, tmp_path):  # noqa: F811
  c = _shrink(hier.get_config("cub200"), *tiny_datasets["cub200"],
              backbone="config")
  c.model.kwargs.depth = 1
  c.model.kwargs.width = 32
  c.model.kwargs.num_heads = 2
  c.model.kwargs.image_size = 64
  c.model.dtype = "float32"
  c.model.embedding_dim = 8
  c.more_losses.hier.num_proxies = 16
  c.more_losses.hier.topk = 3
  c.more_losses.hier.triplets_per_anchor = 4
  c.optim.freeze_backbone_steps = 0
  _export_tiny_vit(tmp_path / "vit.npz", c)
  c.model.pretrained = str(tmp_path / "vit.npz")
  c.checkpoint_every_steps = 2
  result = loop.train_and_evaluate(c, str(tmp_path / "run"))
  assert result["step"] == 2
  assert np.isfinite(result["result"]["test"]["map@r"])
  from circle_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  ckpts = ckpt_lib.Checkpoints(str(tmp_path / "run" / "checkpoints"))
  state = ckpts.restore()[0]
  ckpts.close()
  proxies = np.asarray(
      state["params"]["loss"]["more_losses"]["hier"]["proxies"])
  assert proxies.shape == (16, 8) and np.all(np.isfinite(proxies))
