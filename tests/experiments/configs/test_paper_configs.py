"""The paper configs: one file per paper, ``get_config(dataset)`` each.

For every (paper config, dataset) pair: the recipe values that matter, two
training steps of ``train_and_evaluate`` on a tiny copy of the dataset in its
official layout, and clear errors without the data. The papers' datasets are
not on this machine; the published numbers and the launch commands are in the
configs' docstrings and in experiments/results/main_paper_tables.md (checked for
consistency here).

Test-only shrinking of the two-step runs: 64-pixel images, 2 x 2 batches,
eval batches of 8, one device (``parallelism='none'``), no periodic
evaluation and no clustering metrics; and, by default, a one-block, 8-channel conv4 backbone in place
of BN-Inception. One BN-Inception two-step run costs 90 s the first time and
25 s with a warm compilation cache on this shared 2-core CPU (tracing the
train step and initialising the model eagerly dominate), so the 15 pairs
cannot all run it in the default suite; ``CIRCLE_JAX_SLOW_TESTS=1`` runs them
with the config's own BN-Inception (the convention of
tests/train/test_models_step.py). Everything else is the config's: pooling,
frozen BN, loss and its hyperparameters, optimiser (groups, multipliers,
warm-up, schedule, clipping), sampler, preprocessing preset, the dataset
builder and the validation split (``validation_fraction = 0.2``).
"""

import json
import os
import pathlib
import re

import numpy as np
import pytest

from circle_jax import data
from circle_jax import config_facts
from circle_jax.train import config_checks
from circle_jax.train import loop
from experiments.configs import circle_loss
from experiments.configs import multi_similarity
from experiments.configs import proxy_anchor
from experiments.configs import ranked_list
from experiments.configs import ranked_proxy_anchor
from experiments.configs import recipes
from tests.data import fixtures
from tests.experiments.configs import recipe_checks

# Slow (whole jobs or benchmarks): not in the fast tier (CONTRIBUTING.md).
# The runs share one persistent compilation cache (tests/conftest.py).
pytestmark = [pytest.mark.slow,
              pytest.mark.usefixtures("module_compilation_cache")]

REPO = pathlib.Path(__file__).resolve().parents[3]
TABLES = REPO / "experiments/results/main_paper_tables.md"

CONFIGS = {
    "circle_loss.py": circle_loss,
    "multi_similarity.py": multi_similarity,
    "proxy_anchor.py": proxy_anchor,
    "ranked_list.py": ranked_list,
    "ranked_proxy_anchor.py": ranked_proxy_anchor,
}
PAIRS = [(f, d) for f, m in CONFIGS.items() for d in m.DATASETS]
PAIR_IDS = [f"{f[:-3]}:{d}" for f, d in PAIRS]

SLOW = pytest.mark.skipif(not os.environ.get("CIRCLE_JAX_SLOW_TESTS"),
                          reason="set CIRCLE_JAX_SLOW_TESTS=1")

# The files each builder names when they are missing.
EXPECTED_FILES = {
    "cub200": ["CUB_200_2011.tgz"],
    "cars196": ["car_ims.tgz", "cars_annos.mat"],
    "sop": ["Stanford_Online_Products.zip"],
    "inshop": ["list_eval_partition.txt", "img.zip"],
}

# Recipe values per config file (the loss section is compared whole; the
# pair losses' geometry fields at their cosine default, the proxy losses'
# class matrix whole).
_SPHERE = {"geometry": "cosine", "c": 0.1, "r": 2.3}
_WHOLE = {"shard_classes": False}  # no sample_rate: they do not sample
LOSSES = {
    "circle_loss.py": {"name": "circle", "gamma": 80.0, "margin": 0.4,
                       "block_size": None, "collective": None, **_SPHERE},
    "multi_similarity.py": {"name": "multi_similarity", "alpha": 2.0,
                            "beta": 40.0, "base": 0.5, "epsilon": 0.1,
                            "mining": True, "block_size": None,
                            "collective": None, **_SPHERE},
    "proxy_anchor.py": {"name": "proxy_anchor", "alpha": 32.0, "margin": 0.1,
                        **_WHOLE},
    "ranked_list.py": {"name": "ranked_list", "alpha": 1.2, "margin": 0.4,
                       "t_neg": 10.0, "t_pos": 0.0, "imbalance": 0.5,
                       "block_size": None, "collective": None, **_SPHERE},
    "ranked_proxy_anchor.py": {"name": "ranked_proxy_anchor", "alpha": 1.4,
                               "margin": 0.4, "t_neg": 20.0,
                               "distance": "euclidean", **_WHOLE},
}
RECIPE = {
    "circle_loss.py": "ms", "multi_similarity.py": "ms",
    "proxy_anchor.py": "pa", "ranked_proxy_anchor.py": "pa",
    "ranked_list.py": "rll",
}
TRAIN_IMAGES = {"cub200": 5864, "cars196": 8054, "sop": 59551,
                "inshop": 25882}


def _config(config_file, dataset):
  return CONFIGS[config_file].get_config(dataset)


# --------------------------------------------------------------------------
# 1. The configs: valid, with the recipe of the paper / official code.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("config_file, dataset", PAIRS, ids=PAIR_IDS)
def test_config_is_valid_with_the_paper_recipe(config_file, dataset):
  c = _config(config_file, dataset)
  c.dataset.manual_dir = "/data"
  config_checks.check_config(c, device_count=4, process_count=1)
  assert c.dataset.name == dataset
  assert c.model.name == "bn_inception" and c.model.embedding_dim == 512
  assert c.dataset.validation_fraction == 0.2
  assert c.best_metric == "recall@1" and c.best_mode == "max"
  recipe_checks.assert_loss_recipe(c.loss, LOSSES[config_file])
  o = c.optim
  recipe = RECIPE[config_file]
  if recipe == "ms":
    assert (c.model.pooling, c.model.freeze_bn) == ("max", True)
    assert (c.batch.sampler, c.batch.classes_per_batch,
            c.batch.images_per_class) == ("pk", 16, 5)
    assert (o.name, o.learning_rate, o.weight_decay) == ("adam", 3e-5, 5e-4)
    assert (o.schedule, o.decay_factor) == ("step", 0.1)
    assert o.decay_every_steps == int(0.4 * c.num_train_steps)
    assert c.dataset.preprocess.image_size == 227
    assert tuple(c.dataset.preprocess.scale) == (0.16, 1.0)
    # 3000 steps of 80 on CUB (the code's); as many epochs elsewhere.
    epochs = c.num_train_steps * 80 / TRAIN_IMAGES[dataset]
    assert abs(epochs - 3000 * 80 / 5864) < 0.5  # rounded to 100 steps
    if dataset == "cub200":
      assert (c.num_train_steps, o.decay_every_steps) == (3000, 1200)
      assert c.eval_every_steps == 200
  elif recipe == "pa":
    per_epoch = TRAIN_IMAGES[dataset] // 180
    assert (c.model.pooling, c.model.freeze_bn) == ("avg+max", True)
    assert (c.batch.sampler, c.batch.size) == ("random", 180)
    assert (o.name, o.learning_rate, o.weight_decay) == ("adamw", 1e-4, 1e-4)
    assert o.lr_multipliers.to_dict() == {"backbone": 1.0, "head": 1.0,
                                          "loss": 100.0}
    assert o.freeze_backbone_steps == per_epoch  # 1 warm-up epoch
    assert (o.schedule, o.decay_factor) == ("step", 0.5)
    assert o.decay_every_steps == 10 * per_epoch
    assert o.grad_clip_value == 10.0
    assert c.num_train_steps == 60 * per_epoch
    assert c.eval_every_steps == per_epoch
    assert c.dataset.preprocess.image_size == 224
    assert tuple(c.dataset.preprocess.scale) == (0.08, 1.0)
    # One proxy per kept train class (20 % held out for validation).
    info = data.get_dataset_info(dataset)
    held = data.num_holdout_classes(info.num_train_classes, 0.2)
    assert config_facts.num_classes(c, info) == info.num_train_classes - held
  else:
    assert (c.model.pooling, c.model.freeze_bn) == ("avg", False)
    assert (c.batch.sampler, c.batch.classes_per_batch,
            c.batch.images_per_class) == ("pk", 20, 3)
    assert (o.name, o.momentum, o.learning_rate, o.weight_decay) == (
        "sgd", 0.9, 1e-3, 2e-5)
    assert o.lr_multipliers.head == 100.0
    assert (o.schedule, o.decay_factor) == ("step", 0.5)
    assert o.decay_every_steps == int(0.2 * c.num_train_steps)
    assert c.dataset.preprocess.image_size == 227
    if dataset == "cub200":
      assert (c.num_train_steps, o.decay_every_steps) == (10000, 2000)


@pytest.mark.parametrize("config_file", CONFIGS)
def test_default_dataset_and_unknown_dataset(config_file):
  module = CONFIGS[config_file]
  assert module.get_config().dataset.name == "cub200"
  with pytest.raises(ValueError, match=re.escape(config_file) + ".*"
                     + ", ".join(module.DATASETS)):
    module.get_config("mnist")


def _words(text):
  return " ".join(text.replace("\\\n", " ").split())


@pytest.mark.parametrize("config_file, dataset", PAIRS, ids=PAIR_IDS)
def test_docstring_and_results_table_give_the_command_and_numbers(
    config_file, dataset):
  module = CONFIGS[config_file]
  command = recipes.launch_command(config_file, dataset)
  assert "--config.dataset.manual_dir=" in command
  assert "--config.model.pretrained=" in command
  assert _words(command) in _words(module.__doc__)
  rows = [line for line in TABLES.read_text().splitlines()
          if f"`{command}`" in line]
  assert len(rows) == 1, (config_file, dataset)
  published = module.PUBLISHED.get(dataset)
  if published is None:  # RPAL: no published numbers, no published column.
    assert "no published paper" in rows[0]
  else:
    cells = " / ".join(f"{v:.1f}" for v in published.values())
    assert cells in rows[0]
    assert f"{published['recall@1']:.1f}" in module.__doc__
  assert "not on this machine" in rows[0]


# --------------------------------------------------------------------------
# 2. Two training steps on a tiny copy of each dataset.
# --------------------------------------------------------------------------


def _write_tiny(dataset, root):
  """Four train classes of 3 images, two test classes (official layout)."""
  if dataset == "cub200":
    fixtures.write_tree(fixtures.cub_files(
        {1: 3, 2: 3, 3: 3, 4: 3, 101: 2, 102: 2}), root)
  elif dataset == "cars196":
    ids = [1, 2, 3, 4] * 3 + [99, 100] * 2
    fixtures.write_tree({f"car_ims/{i + 1:06d}.jpg": fixtures.encode("JPEG", i)
                         for i in range(len(ids))}, root)
    (root / "cars_annos.mat").write_bytes(fixtures.cars_annos(ids))
  elif dataset == "sop":
    lists, rels = fixtures.sop_lists([3, 3, 3, 3], [2, 2])
    images = {f"Stanford_Online_Products/{r}": fixtures.encode("JPEG", i)
              for i, r in enumerate(rels)}
    fixtures.write_tree({**lists, **images}, root)
  else:
    rows = fixtures.inshop_rows([3, 3, 3, 3], None, [1, 1], [1, 1])
    fixtures.write_tree({p: fixtures.encode("JPEG", i)
                         for i, (p, _, _) in enumerate(rows)}, root)
    (root / "list_eval_partition.txt").write_bytes(
        fixtures.inshop_partition(rows))
  return root


@pytest.fixture(scope="module")
def tiny_datasets(tmp_path_factory):
  """dataset -> (manual_dir, data_dir), each built once for the module."""
  root = tmp_path_factory.mktemp("paper_datasets")
  out = {}
  for dataset in EXPECTED_FILES:
    manual = _write_tiny(dataset, root / dataset / "manual")
    data.load_split(dataset, "train", data_dir=root / dataset / "prepared",
                    manual_dir=manual)
    out[dataset] = (str(manual), str(root / dataset / "prepared"))
  return out


def _shrink(c, manual_dir, data_dir, *, backbone):
  """Test-only: what is too slow on CPU (see the module docstring)."""
  c.dataset.manual_dir = manual_dir
  c.dataset.data_dir = data_dir
  c.dataset.num_workers = 0
  c.dataset.num_threads = 2
  c.dataset.preprocess.image_size = 64  # BN-Inception's smallest (x 32)
  c.dataset.preprocess.resize_size = 72
  if c.batch.sampler == "pk":
    c.batch.classes_per_batch = 2
    c.batch.images_per_class = 2
  else:
    c.batch.size = 4
  c.batch.eval_batch_size = 8
  if backbone == "conv4":
    c.model.name = "conv4"
    c.model.kwargs.width = 8
    c.model.kwargs.num_blocks = 1
  c.parallelism = "none"
  c.num_train_steps = 2
  c.eval_every_steps = 0
  c.checkpoint_every_steps = 0
  c.log_every_steps = 1
  c.eval_at_init = False
  c.eval_clustering = False
  c.async_checkpoints = False
  return c


@pytest.mark.parametrize("backbone", [
    "conv4", pytest.param("config", marks=SLOW)])
@pytest.mark.parametrize("config_file, dataset", PAIRS, ids=PAIR_IDS)
def test_two_training_steps_on_a_tiny_copy(config_file, dataset, backbone,
                                           tiny_datasets, tmp_path):
  c = _shrink(_config(config_file, dataset), *tiny_datasets[dataset],
              backbone=backbone)
  result = loop.train_and_evaluate(c, str(tmp_path / "run"))
  assert result["step"] == 2
  # Model selection on held-out train classes: 2 of the 4 tiny classes.
  assert result["result"]["selection"] == "validation"
  assert result["validation"]["num_classes"] == 2
  test = result["result"]["test"]
  assert 0.0 <= test["recall@1"] <= 1.0 and np.isfinite(test["map@r"])
  saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
  assert saved["config"]["loss"]["name"] == c.loss.name
  assert saved["config"]["model"]["pooling"] == c.model.pooling


# --------------------------------------------------------------------------
# 3. Without the data: clear errors.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("config_file, dataset", PAIRS, ids=PAIR_IDS)
def test_without_the_data_the_errors_name_what_is_missing(config_file, dataset,
                                                          tmp_path):
  c = _config(config_file, dataset)
  c.parallelism = "none"
  with pytest.raises(config_checks.ConfigError,
                     match=r"config\.dataset\.manual_dir"):
    loop.train_and_evaluate(c, str(tmp_path / "no_manual_dir"))
  (tmp_path / "empty").mkdir()
  c.dataset.manual_dir = str(tmp_path / "empty")
  c.dataset.data_dir = str(tmp_path / "prepared")
  with pytest.raises(data.MissingDatasetFilesError) as e:
    loop.train_and_evaluate(c, str(tmp_path / "empty_manual_dir"))
  message = str(e.value)
  assert f"'{dataset}'" in message and str(tmp_path / "empty") in message
  for name in EXPECTED_FILES[dataset]:
    assert name in message
