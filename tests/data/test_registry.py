"""Dataset names, their metadata, and load_split's argument checks."""

import pytest

from circle_jax import data
from circle_jax.data import builders

NAMES = ("cub200", "cars196", "sop", "inshop", "omniglot", "omniglot_small",
         "digits")


def test_every_name_has_a_builder_and_consistent_sizes():
  assert tuple(data.DATASETS) == NAMES
  for name in NAMES:
    spec = data.get_dataset_info(name)
    builder = builders.BUILDERS[name]
    assert builder.name == name
    assert tuple(builder.SPLITS) == spec.splits
    assert dict(builder.EXPECTED_SIZES) == dict(spec.num_images)
    p = spec.get_preprocess(train=False)
    assert p.channels == spec.channels and not p.train
    assert spec.get_preprocess(train=True, image_size=32).image_size == 32
    assert spec.ks_name == name and spec.ks[0] == 1


def test_table_of_the_issue():
  info = {n: data.get_dataset_info(n) for n in NAMES}
  assert [(info[n].num_train_classes, info[n].num_test_classes) for n in NAMES
          ] == [(100, 100), (98, 98), (11318, 11316), (3997, 3985), (964, 659),
                (136, 106), (5, 5)]
  assert info["inshop"].eval_splits == ("query", "gallery")
  assert info["sop"].ks == (1, 10, 100, 1000)
  assert info["inshop"].ks == (1, 10, 20, 30, 40)
  assert info["omniglot"].channels == 1 and info["cub200"].channels == 3
  assert info["cub200"].eval_preprocess_name == "bninception"
  assert not info["digits"].needs_files


def test_ks_agree_with_evaluation_defaults():
  evaluation = pytest.importorskip("circle_jax.evaluation")
  default_ks = getattr(evaluation, "default_ks", None)
  if default_ks is None:
    pytest.skip("circle_jax.evaluation.default_ks not there yet")
  for name in NAMES:
    assert tuple(default_ks(data.get_dataset_info(name).ks_name)) == (
        data.get_dataset_info(name).ks)


def test_unknown_names_and_splits(tmp_path):
  with pytest.raises(ValueError, match="cub200, cars196, sop, inshop"):
    data.get_dataset_info("cub")
  with pytest.raises(ValueError, match="Unknown dataset"):
    data.load_split("imagenet", "train", data_dir=tmp_path)
  with pytest.raises(ValueError, match="train, query, gallery"):
    data.load_split("inshop", "test", data_dir=tmp_path)
