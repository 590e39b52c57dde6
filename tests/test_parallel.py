"""Each placement round-trips trees and batches, and all three embed alike.

The train steps of the three placements are compared in
``tests/train/test_step.py``.
"""

import chex
import jax
import numpy as np
import pytest

from circle_jax import config_facts
from circle_jax import config as config_lib
from circle_jax import data as data_lib
from circle_jax import parallel
from circle_jax.evaluation import embedding as embedding_lib
from circle_jax.train import run as run_lib
from tests.train import helpers

MODES = parallel.MODES


def _tree():
  rng = np.random.default_rng(0)
  return {"w": rng.normal(size=(3, 4)).astype(np.float32),
          "b": {"x": np.arange(5, dtype=np.int32),
                "s": np.float32(2.5)}}


@pytest.mark.parametrize("mode", MODES)
def test_replicate_then_to_host_is_the_identity(mode):
  placement = parallel.get_placement(mode)
  assert placement.mode == mode
  host = _tree()
  placed = placement.replicate(host)
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(placed))
  back = placement.to_host(placed)
  chex.assert_trees_all_equal(back, host)
  chex.assert_trees_all_equal_shapes_and_dtypes(back, host)


def test_each_mode_places_replicas_on_its_devices():
  assert jax.device_count() == 8
  host = _tree()
  one = parallel.SingleDevice().replicate(host)["w"]
  assert one.devices() == {jax.local_devices()[0]}
  sharded = parallel.ShardMap().replicate(host)["w"]
  assert len(sharded.devices()) == 8 and sharded.shape == (3, 4)
  assert sharded.sharding.is_fully_replicated
  stacked = parallel.Pmap().replicate(host)["w"]
  assert stacked.shape == (8, 3, 4)


@pytest.mark.parametrize("mode", MODES)
def test_shard_batch_splits_the_global_batch_in_order(mode):
  placement = parallel.get_placement(mode)
  batch = {"image": np.arange(16 * 2, dtype=np.float32).reshape(16, 2),
           "label": np.arange(16, dtype=np.int32)}
  placed = placement.shard_batch(batch)
  if mode == "pmap":
    assert placed["label"].shape == (8, 2)
    np.testing.assert_array_equal(placed["label"][3], [6, 7])
  elif mode == "shard_map":
    shards = placed["label"].addressable_shards
    assert len(shards) == 8
    np.testing.assert_array_equal(np.asarray(shards[3].data), [6, 7])
  # The eval path: a per-device function's outputs come back in order.
  embed = placement.embed_fn(lambda v, x: x * v)
  out = placement.gather(embed(placement.replicate(np.float32(2.0)),
                               placed["image"]))
  np.testing.assert_array_equal(out, 2 * batch["image"])
  assert out.dtype == np.float32


@pytest.mark.parametrize("mode", MODES)
def test_first_replica_of_step_metrics_is_one_scalar(mode):
  placement = parallel.get_placement(mode)

  def fn(state, batch, *, axis_name, psum_grads):
    del psum_grads
    total = batch.sum()
    if axis_name is not None:
      total = jax.lax.psum(total, axis_name)
    return state + 1, {"total": total}

  step = placement.wrap_step(fn, donate=False)
  state = placement.replicate(np.float32(0.0))
  state, metrics = step(state, placement.shard_batch(
      np.arange(16, dtype=np.float32)))
  got = jax.device_get(placement.first_replica(metrics))
  assert np.shape(got["total"]) == () and float(got["total"]) == 120.0
  assert float(placement.to_host(state)) == 1.0


def test_unknown_mode_names_the_valid_ones():
  with pytest.raises(ValueError, match=r"parallelism.*'ddp'.*shard_map"):
    parallel.get_placement("ddp")
  one = parallel.SingleDevice()
  assert parallel.get_placement(one) is one
  c = config_lib.base_config()
  c.parallelism = "pmap"
  assert isinstance(parallel.from_config(c), parallel.Pmap)


def test_sync_bn_axis_comes_from_the_placement():
  c = helpers.digits_config()
  assert c.model.sync_bn
  for mode in MODES:
    placement = parallel.get_placement(mode)
    model = run_lib.build_model(c, placement)
    assert model.backbone.bn_axis_name == placement.axis_name, mode
  assert parallel.SingleDevice().axis_name is None


@pytest.fixture(scope="module")
def digits_test_split(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  c = helpers.digits_config(**{"dataset.data_dir": data_dir})
  info = data_lib.get_dataset_info("digits")
  return c, info, run_lib.load_split(c, info, info.eval_splits[0])


def test_the_three_modes_embed_a_split_alike(digits_test_split):
  """A pmap run evaluates the pmap way, a one-device run on one device: the
  embeddings agree (to float32 rounding) and come back in record order."""
  c, info, source = digits_test_split
  preprocess = config_facts.eval_preprocess(c, info)
  images = np.zeros((1,) + tuple(preprocess.output_shape), np.float32)
  out = {}
  for mode in MODES:
    placement = parallel.get_placement(mode)
    model = run_lib.build_model(c, placement)
    variables = model.init(jax.random.PRNGKey(0), images, train=False)
    out[mode] = embedding_lib.embed_split(
        variables, embedding_lib.model_apply(model), source, preprocess,
        placement=placement,
        batch_size=64, num_threads=2)
  emb, labels = out["none"]
  assert emb.shape == (len(source), c.model.embedding_dim)
  np.testing.assert_array_equal(labels, data_lib.split_labels(source))
  for mode in ("shard_map", "pmap"):
    np.testing.assert_array_equal(out[mode][1], labels)
    np.testing.assert_allclose(out[mode][0], emb, atol=1e-5, rtol=1e-5)
  # Not trivially equal: the embeddings differ between images.
  assert np.abs(emb - emb[:1]).max() > 1e-2
