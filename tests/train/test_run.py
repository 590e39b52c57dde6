"""Tests of circle_jax/train/run.py: the parts of a run built from its config.

The rotated and mirrored classes of ``load_sources`` are tested in
tests/data/test_rotations.py, BatchNorm's device axis in tests/test_parallel.py.
"""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import data as data_lib
from circle_jax import parallel
from circle_jax.models import vit_weights
from circle_jax.train import config_checks
from circle_jax.train import run as run_lib
from tests.data import fixtures
from tests.train import helpers
from tests.train import test_vit_train

_RECORDS = [{"label": c} for c in (0, 0, 0, 1, 1, 1, 2, 2, 2, 2)]


def test_default_data_dir_reads_tfds_data_dir(monkeypatch, tmp_path):
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
  assert run_lib.default_data_dir() == str(tmp_path)
  monkeypatch.delenv("TFDS_DATA_DIR")
  monkeypatch.setenv("HOME", str(tmp_path))
  assert run_lib.default_data_dir() == str(tmp_path / "tensorflow_datasets")


def test_make_sampler_follows_batch_sampler():
  c = helpers.digits_config(**{"batch.classes_per_batch": 3,
                               "batch.images_per_class": 2, "seed": 5})
  pk = run_lib.make_sampler(c, _RECORDS)
  assert isinstance(pk, data_lib.PKSampler)
  assert (pk.P, pk.K, pk.batch_size, pk.seed) == (3, 2, 6, 5)
  batch = pk.indices(0).reshape(3, 2)
  labels = np.asarray([r["label"] for r in _RECORDS])[batch]
  assert sorted(labels[:, 0]) == [0, 1, 2]  # P classes, K images of each
  assert (labels == labels[:, :1]).all()
  c.batch.sampler = "views"
  views = run_lib.make_sampler(c, _RECORDS)
  assert isinstance(views, data_lib.ViewSampler)
  assert (views.N, views.V, views.num_examples) == (3, 2, 10)
  c.batch.sampler, c.batch.size = "random", 4
  rnd = run_lib.make_sampler(c, _RECORDS)
  assert isinstance(rnd, data_lib.RandomSampler)
  assert (rnd.batch_size, rnd.num_examples, rnd.seed) == (4, 10, 5)


def test_hierarchical_sampler_draws_from_the_alphabets():
  # omniglot_small's 136 train classes in 5 alphabets, two records each.
  records = [{"label": c} for c in np.repeat(np.arange(136), 2)]
  c = helpers.omniglot_small_config(**{
      "batch.sampler": "hierarchical", "batch.classes_per_batch": 6,
      "batch.images_per_class": 2, "batch.super_classes_per_batch": 3,
      "seed": 2})
  s = run_lib.make_sampler(c, records)
  assert isinstance(s, data_lib.HierarchicalSampler)
  assert (s.batch_size, s.S, s.K, s.C, s.seed) == (12, 3, 2, 2, 2)
  alphabet = np.repeat(np.arange(5), data_lib.DATASETS[
      "omniglot_small"].train_superclasses)
  labels = np.repeat(np.arange(136), 2)[s.indices(7)].reshape(3, 2, 2)
  np.testing.assert_array_equal(alphabet[labels], np.broadcast_to(
      s.super_tuple(7)[:, None, None], (3, 2, 2)))
  # A partial copy (fewer classes than the alphabets declare) is refused.
  with pytest.raises(config_checks.ConfigError, match="not the 136 of its "
                     "declared super-classes"):
    run_lib.make_sampler(c, records[:200])


def test_hierarchical_sampler_reads_sops_super_labels():
  """SOP's records carry their super-class (``super_label``): the sampler
  reads them (issue 40 item 9); the config check lets SOP through."""
  records = [{"label": c, "super_label": 1 + c % 3}
             for c in np.repeat(np.arange(12), 2)]
  c = helpers.override(helpers.digits_config(), **{
      "dataset.name": "sop", "batch.sampler": "hierarchical",
      "batch.classes_per_batch": 4, "batch.images_per_class": 2})
  s = run_lib.make_sampler(c, records)
  batch = np.asarray([records[i]["super_label"] for i in s.indices(3)])
  np.testing.assert_array_equal(batch.reshape(2, 4), np.broadcast_to(
      s.super_tuple(3)[:, None], (2, 4)))
  assert data_lib.get_dataset_info("sop").super_labels
  assert not data_lib.get_dataset_info("cub200").super_labels


def test_build_model_reads_the_model_section():
  c = helpers.digits_config(**{"model.embedding_dim": 6,
                               "model.dtype": "bfloat16"})
  model = run_lib.build_model(c, parallel.SingleDevice())
  assert model.embedding_dim == 6 and model.backbone.dtype == jnp.bfloat16
  assert model.normalize and model.backbone.bn_axis_name is None
  c.loss.geometry = "poincare"
  assert not run_lib.build_model(c, parallel.SingleDevice()).normalize


def _init(c):
  info = data_lib.get_dataset_info("digits")
  model = run_lib.build_model(c, parallel.SingleDevice())
  return run_lib.init_state(c, model, info, (16, 16, 1))


def test_init_state_of_a_pair_loss():
  c = helpers.digits_config(**{"optim.learning_rate": 0.25})
  state, entry, hyper, key = _init(c)
  assert entry.name == "circle" and int(state.step) == 0
  assert state.params["loss"] == {} and state.xbm is None
  # (and the regularizers' fields, at their defaults: none)
  assert hyper == {"gamma": 80.0, "margin": 0.4, "geometry": "cosine",
                   "c": 0.1, "r": 2.3, "p": 2.0, "power": 1.0,
                   "normalize_embeddings": True, "embedding_regularizer": "",
                   "embedding_reg_weight": 1.0, "reg_p": 2.0,
                   "reg_power": 1.0}
  assert state.batch_stats  # conv4's BatchNorm statistics
  # The step key is the third of the seed's split; the same seed, the same
  # parameters.
  np.testing.assert_array_equal(
      key, jax.random.split(jax.random.PRNGKey(c.seed), 3)[2])
  again, *_ = _init(c)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(again.params)):
    np.testing.assert_array_equal(a, b)


def test_init_state_gives_a_proxy_loss_one_row_per_class():
  c = helpers.digits_config(**{"dataset.validation_fraction": 0.4})
  c.loss = helpers.config_lib.loss_config("proxy_anchor")
  state, entry, hyper, _ = _init(c)
  # digits trains on 5 classes, 2 held out for validation: 3 proxies.
  assert entry.param_name == "proxies"
  assert state.params["loss"]["proxies"].shape == (3, c.model.embedding_dim)
  assert "num_classes" not in hyper
  c.loss.shard_classes = True
  _, _, hyper, _ = _init(c)
  assert hyper["num_classes"] == 3


def test_pretrained_weights_of_a_model_without_a_reader_are_refused():
  c = helpers.digits_config(**{"model.pretrained": "/some/weights.h5"})
  with pytest.raises(config_checks.ConfigError,
                     match="no pretrained weights for 'conv4'"):
    _init(c)


def test_load_sources_holds_out_whole_classes(tmp_path):
  c = helpers.digits_config(**{"dataset.data_dir": str(tmp_path),
                               "dataset.validation_fraction": 0.4})
  info = data_lib.get_dataset_info("digits")
  train, validation = run_lib.load_sources(c, info)
  full = run_lib.load_split(c, info, info.train_split)
  train_labels = data_lib.split_labels(train)
  val_labels = data_lib.split_labels(validation)
  assert len(train) + len(validation) == len(full)
  # Labels renumbered from 0 on each side: 3 kept classes, 2 held out.
  assert set(train_labels) == {0, 1, 2} and set(val_labels) == {0, 1}
  c.dataset.validation_fraction = 0.0
  train, validation = run_lib.load_sources(c, info)
  assert validation is None and len(train) == len(full)


@pytest.mark.slow
def test_rgb_vit_weights_start_a_grayscale_run(tmp_path):
  """digits is grayscale and every ViT checkpoint is RGB: the patch
  projection is summed over its channels (timm's adapt_input_conv)."""
  c = test_vit_train.vit_config(str(tmp_path / "tfds"))
  module = run_lib.build_model(c).backbone
  rgb = module.init(jax.random.PRNGKey(1), np.zeros((1, 28, 28, 3)),
                    train=False)["params"]
  sd = {}
  for path, value in flax.traverse_util.flatten_dict(rgb).items():
    key, perm = vit_weights._timm_name(path)  # pylint: disable=protected-access
    value = np.asarray(value)
    if perm is not None:
      value = value.transpose(np.argsort(perm))
    sd[key] = np.ascontiguousarray(value)
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  save_file(sd, str(tmp_path / "w.safetensors"))
  c.model.pretrained = str(tmp_path / "w.safetensors")
  info = data_lib.get_dataset_info("digits")
  state, *_ = run_lib.init_state(c, run_lib.build_model(c), info,
                                 (28, 28, 1))
  kernel = state.params["model"]["backbone"]["patch_embed"]["kernel"]
  assert kernel.shape == (4, 4, 1, 32)
  np.testing.assert_allclose(
      kernel, np.asarray(rgb["patch_embed"]["kernel"]).sum(2, keepdims=True),
      rtol=1e-6)
  np.testing.assert_array_equal(
      state.params["model"]["backbone"]["pos_embed"], rgb["pos_embed"])


def test_a_partial_copy_too_small_for_the_hold_out_is_one_line(tmp_path):
  """A two-class copy of CUB with the paper configs' 20 % hold-out: the
  classes the copy really has are checked once it is read (the spec's 100
  passed the config check), in one line naming the numbers and fields."""
  m = tmp_path / "m"
  fixtures.write_tree(fixtures.cub_files({1: 2, 2: 2, 101: 2, 102: 2}), m)
  c = helpers.digits_config(**{
      "dataset.name": "cub200", "dataset.manual_dir": str(m),
      "dataset.data_dir": str(tmp_path / "d"),
      "dataset.validation_fraction": 0.2, "batch.classes_per_batch": 2})
  config_checks.check_config(c, device_count=1, process_count=1)
  with pytest.raises(config_checks.ConfigError) as e:
    run_lib.load_sources(c, data_lib.get_dataset_info("cub200"))
  assert str(e.value) == (
      "config.dataset.validation_fraction: 0.2 holds out 2 of the 2 train "
      f"classes of 'cub200' (as read from manual_dir '{m}') and leaves 0 to "
      "train on; both sides need at least 2 classes: set "
      "dataset.validation_fraction=0 (no hold-out).")
  c.dataset.validation_fraction = 0.0
  train, validation = run_lib.load_sources(c, data_lib.get_dataset_info("cub200"))
  assert len(train) == 4 and validation is None


def test_init_state_gives_each_more_loss_its_class_matrix():
  """config.more_losses (issue 40, PML's MultipleLosses): a term with a
  class matrix gets its own rows under params['loss']['more_losses']."""
  from circle_jax import config as config_lib
  c = helpers.digits_config()
  c.more_losses.cls = config_lib.more_loss("normface", weight=0.5)
  c.more_losses.pairs = config_lib.more_loss("contrastive")
  state, *_ = _init(c)
  rows = state.params["loss"]["more_losses"]
  assert set(rows) == {"cls"}
  assert rows["cls"]["class_weights"].shape == (5, c.model.embedding_dim)
