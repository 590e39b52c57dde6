"""Tests of circle_jax/config_facts.py: the facts a config implies."""

import itertools

import ml_collections
import numpy as np
import pytest

from circle_jax import config as config_lib
from circle_jax import config_facts
from circle_jax import data as data_lib


def _config(**dataset):
  c = config_lib.base_config()
  for k, v in dataset.items():
    c.dataset[k] = v
  return c


def test_class_counts_of_digits_by_hand():
  info = data_lib.get_dataset_info("digits")  # 5 train classes
  c = _config()
  assert config_facts.class_copies(c) == 1
  assert config_facts.num_holdout_classes(c, info) == 0
  assert config_facts.data_classes(c, info) == 5
  assert config_facts.num_classes(c, info) == 5
  # round(0.4 * 5) = 2 held out; 4 rotations, twice with mirrors.
  c = _config(validation_fraction=0.4, rotations=4, mirror_classes=True)
  assert config_facts.class_copies(c) == 8
  assert config_facts.num_holdout_classes(c, info) == 2
  assert config_facts.data_classes(c, info) == (5 - 2) * 8
  assert config_facts.num_classes(c, info) == 24


def test_superclass_validation_holds_out_whole_superclasses():
  info = data_lib.get_dataset_info("omniglot_small")
  c = _config(name="omniglot_small", validation_fraction=0.2)
  assert config_facts.validation_superclasses(c, info) is None
  assert config_facts.num_holdout_classes(c, info) == round(0.2 * 136)
  c.dataset.validation_by = "superclass"
  sizes = config_facts.validation_superclasses(c, info)
  assert sizes == tuple(info.train_superclasses) and sum(sizes) == 136
  held = config_facts.num_holdout_classes(c, info)
  # A sum of whole superclasses, never a part of one.
  sums = {sum(s) for r in range(1, len(sizes))
          for s in itertools.combinations(sizes, r)}
  assert held in sums
  assert config_facts.data_classes(c, info) == 136 - held


def test_num_classes_is_the_configs_when_set():
  c = _config(num_classes=11)
  assert config_facts.num_classes(c, data_lib.get_dataset_info("digits")) == 11
  assert config_facts.num_classes(_config(), None) is None


def test_loss_hyper_drops_the_name_and_unset_options():
  c = config_lib.base_config()
  c.loss = config_lib.loss_config("circle", gamma=32.0, margin=0.25)
  hyper = config_facts.loss_hyper(c)
  assert "name" not in hyper
  assert hyper["gamma"] == 32.0 and hyper["margin"] == 0.25
  assert c.loss.block_size is None and "block_size" not in hyper
  c.loss.block_size = 16
  assert config_facts.loss_hyper(c)["block_size"] == 16


def test_the_ball_takes_raw_features_and_every_other_geometry_unit_ones():
  c = config_lib.base_config()
  assert c.loss.geometry == "cosine" and config_facts.head_normalizes(c)
  c.loss.geometry = "poincare"
  assert not config_facts.head_normalizes(c)
  # A PML distance normalises as its field says.
  c.loss.geometry = "lp"
  assert config_facts.head_normalizes(c)
  c.loss.normalize_embeddings = False
  assert not config_facts.head_normalizes(c)
  # A loss without a geometry field keeps the normalising head.
  c.loss = ml_collections.ConfigDict({"name": "softmax"})
  assert config_facts.head_normalizes(c)


@pytest.mark.parametrize("sampler, want", [("pk", 6 * 5), ("views", 6 * 5),
                                           ("random", 17)])
def test_global_batch_size_by_sampler(sampler, want):
  c = config_lib.base_config()
  c.batch.sampler = sampler
  c.batch.classes_per_batch, c.batch.images_per_class, c.batch.size = 6, 5, 17
  assert config_facts.global_batch_size(c) == want


def test_metric_names_in_order():
  assert config_facts.metric_names((1, 4), False) == [
      "recall@1", "recall@4", "precision@1", "r_precision", "map@r"]
  fewshot = ml_collections.ConfigDict({"ways": (5,), "shots": (1, 5)})
  assert config_facts.metric_names((1,), True, fewshot) == [
      "recall@1", "precision@1", "r_precision", "map@r", "nmi", "ami",
      "fewshot_5way_1shot", "fewshot_5way_1shot_ci95",
      "fewshot_5way_5shot", "fewshot_5way_5shot_ci95"]
  off = ml_collections.ConfigDict({"ways": (), "shots": (1,)})
  assert config_facts.metric_names((2,), False, off) == [
      "recall@2", "precision@1", "r_precision", "map@r"]


def test_train_label_superclasses_follow_the_holdout_and_the_copies():
  info = data_lib.DATASETS["omniglot_small"]       # alphabets 24, 22, 24, 40, 26
  c = config_lib.base_config()
  c.dataset.name = "omniglot_small"
  alphabet = np.repeat(np.arange(5), info.train_superclasses)
  np.testing.assert_array_equal(
      config_facts.train_label_superclasses(c, info), alphabet)
  c.dataset.validation_fraction, c.dataset.validation_by = 0.2, "superclass"
  c.dataset.rotations = 2
  held = data_lib.holdout_classes(136, 0.2, c.dataset.validation_seed,
                                  superclasses=info.train_superclasses)
  kept = np.setdiff1d(np.arange(136), held)
  got = config_facts.train_label_superclasses(c, info)
  np.testing.assert_array_equal(got, np.tile(alphabet[kept], 2))
  assert got.size == config_facts.data_classes(c, info)
  assert len(set(got)) == 4                         # one alphabet held out


def test_preprocessing_is_the_datasets_eval_and_train_preset():
  c = _config()
  c.dataset.preprocess.image_size = 20
  info = data_lib.get_dataset_info("digits")
  ev = config_facts.eval_preprocess(c, info)
  tr = config_facts.train_preprocess(c, info)
  assert not ev.train and tr.train
  assert tuple(ev.output_shape) == tuple(tr.output_shape) == (20, 20, 1)
