"""The cross-batch memory (circle_jax/train/xbm.py) in the train step.

The step-level tests use a small pair loss with the loss API's reference
value (``ref``, a ``circle_jax.losses.Candidates``; written here with
``ops``, independent of the registry's losses); the trainer-level tests run the digits job with a registry loss.
"""

import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from circle_jax import config as config_lib
from circle_jax import losses as losses_lib
from circle_jax import ops
from circle_jax import parallel
from circle_jax.losses.engine import reductions
from circle_jax.train import config_checks
from circle_jax.train import loop
from circle_jax.train import optim
from circle_jax.train import state as state_lib
from circle_jax.train import step as step_lib
from circle_jax.train import xbm as xbm_lib
from tests import test_config
from tests.conftest import REPO_ROOT
from tests.train import helpers

# Slow (runs per placement, resumes): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

BATCH = 16  # helpers.fake_batch: 16 images of 4 classes; 2 rows per device
DIM = 4


def _ref_pair_loss(embeddings, labels, params=None, *, axis_name=None,
                   scale=8.0, ref=None):
  """helpers' toy pair loss, against references when given (the API's
  semantics: anchors x all references, invalid rows and equal ids out)."""
  if ref is None:
    return helpers.PAIR.fn(embeddings, labels, params, axis_name=axis_name,
                           scale=scale)
  refs = ops.gather_global(ref.embeddings, axis_name)
  ref_labels = ops.gather_global(ref.labels, axis_name)
  ref_valid = ops.gather_global(ref.valid, axis_name)
  ref_ids = ops.gather_global(ref.ids, axis_name)
  ids = ref.anchor_ids
  s = ops.cosine_similarity(embeddings, refs)
  other = (ids[:, None] != ref_ids[None, :]) & ref_valid[None, :]
  same = labels[:, None] == ref_labels[None, :]
  pos, neg = same & other, ~same & other
  per = (ops.log1p_sum_exp(scale * s, neg)
         + ops.log1p_sum_exp(-scale * s, pos))
  return reductions.mean_over_valid(per, pos.any(1), axis_name)


REF_PAIR = helpers.Entry("toy_ref_pair", _ref_pair_loss)
MODEL = helpers.TinyNet(use_bn=False, embedding_dim=DIM)


def _batch(t):
  return jax.tree.map(np.asarray, helpers.fake_batch(jax.random.PRNGKey(t)))


def _initial(size, *, start_step=0, weight=1.0, tx=None, dtype="float32"):
  memory = None
  if size:
    memory = xbm_lib.init_memory(size, DIM, dtype=dtype, start_step=start_step,
                                 weight=weight)
  return helpers.initial_state(
      MODEL, tx or optax.sgd(0.5), jnp.zeros((2, 6, 6, 1)),
      key=jax.random.PRNGKey(0), memory=memory)


def _run(mode, steps, size, **kw):
  """Host trees of the state before each step and after the last, and the
  step losses."""
  placement = parallel.get_placement(mode)
  state = _initial(size, **kw)
  step = step_lib.make_train_step(step_lib.make_loss_fn(REF_PAIR),
                                  placement=placement,
                                  base_key=jax.random.PRNGKey(3))
  host = parallel.SingleDevice().to_host(state_lib.state_to_tree(state))
  state = state_lib.state_from_tree(
      state, placement.replicate(host, sharded=xbm_lib.is_sharded))
  trees, losses = [host], []
  for t in range(steps):
    state, metrics = step(state, placement.shard_batch(_batch(t)))
    metrics = jax.device_get(placement.first_replica(metrics))
    assert bool(metrics["finite"])
    losses.append(float(metrics["loss"]))
    trees.append(placement.to_host(state_lib.state_to_tree(state),
                                   sharded=xbm_lib.is_sharded))
  return trees, losses


def _embed(tree, t):
  """Step ``t``'s batch embedded with the parameters it was taken with."""
  return np.asarray(MODEL.apply(state_lib.model_variables(tree),
                                _batch(t)["image"], train=True))


def _expected_memory(trees, size, devices, start_step=0):
  """The FIFO recomputed from the batches: per device shard, the newest
  ``size / devices`` rows of its batch slices, written in order."""
  rows, b = size // devices, BATCH // devices
  emb = np.zeros((devices, rows, DIM), np.float32)
  lab = np.full((devices, rows), -1, np.int32)
  pos = 0
  for t in range(start_step, len(trees) - 1):
    e = _embed(trees[t], t).reshape(devices, b, DIM)
    y = _batch(t)["label"].reshape(devices, b)
    emb[:, pos:pos + b], lab[:, pos:pos + b] = e, y
    pos = (pos + b) % rows
  return emb.reshape(size, DIM), lab.reshape(size)


@pytest.fixture(scope="module")
def shard_map_run():
  return _run("shard_map", 5, 2 * BATCH)


def test_memory_holds_the_last_batches_in_fifo_order_per_shard(shard_map_run):
  trees, _ = shard_map_run
  for t in (1, 2, 3, 5):  # filling, full, then wrapped around twice
    memory = trees[t]["xbm"]
    emb, lab = _expected_memory(trees[:t + 1], 2 * BATCH, 8)
    np.testing.assert_array_equal(memory["labels"], lab)
    np.testing.assert_allclose(memory["embeddings"], emb, atol=1e-6)
    assert int(memory["filled"]) == min(t, 2) * BATCH
    assert int(memory["position"]) == t * BATCH % (2 * BATCH)
  # After one step half of each shard is empty: label -1, zero rows.
  first = trees[1]["xbm"]
  empty = first["labels"].reshape(8, 4)[:, 2:]
  assert (empty == -1).all()
  assert not first["embeddings"].reshape(8, 4, DIM)[:, 2:].any()


def test_one_device_memory_is_the_whole_fifo():
  trees, _ = _run("none", 3, 2 * BATCH)
  emb, lab = _expected_memory(trees, 2 * BATCH, 1)
  np.testing.assert_array_equal(trees[-1]["xbm"]["labels"], lab)
  np.testing.assert_allclose(trees[-1]["xbm"]["embeddings"], emb, atol=1e-6)
  assert int(trees[-1]["xbm"]["filled"]) == 2 * BATCH


def test_before_start_step_the_memory_neither_fills_nor_counts():
  trees, losses = _run("shard_map", 4, 2 * BATCH, start_step=2)
  plain_trees, plain = _run("shard_map", 2, 0)
  for t in (1, 2):
    assert int(trees[t]["xbm"]["filled"]) == 0
    assert (trees[t]["xbm"]["labels"] == -1).all()
    assert not trees[t]["xbm"]["embeddings"].any()
  np.testing.assert_allclose(losses[:2], plain, rtol=1e-6)  # no memory term
  chex.assert_trees_all_close(trees[2]["params"], plain_trees[2]["params"],
                              atol=1e-6)
  assert int(trees[4]["xbm"]["filled"]) == 2 * BATCH
  emb, lab = _expected_memory(trees, 2 * BATCH, 8, start_step=2)
  np.testing.assert_array_equal(trees[4]["xbm"]["labels"], lab)
  np.testing.assert_allclose(trees[4]["xbm"]["embeddings"], emb, atol=1e-6)


@pytest.mark.parametrize("mode", ["none", "shard_map"])
def test_own_copies_are_excluded_so_the_first_memory_term_repeats_the_batch(
    mode):
  """Step 0: the memory holds just the batch, so without its self pairs
  L(batch, memory) = L(batch, batch) and the loss is (1 + weight) times it.
  A self pair (similarity 1, same label) would lower it."""
  _, with_memory = _run(mode, 1, 2 * BATCH, weight=0.5)
  _, plain = _run(mode, 1, 0)
  np.testing.assert_allclose(with_memory[0], 1.5 * plain[0], rtol=1e-6)


def test_enqueue_ids_are_the_rows_written():
  memory = xbm_lib.init_memory(12, 2)
  memory = memory.replace(position=jnp.int32(8))
  new, ids = xbm_lib.enqueue(memory, jnp.ones((4, 2)), jnp.arange(4), step=0)
  np.testing.assert_array_equal(ids, [8, 9, 10, 11])
  np.testing.assert_array_equal(new.labels, [-1] * 8 + [0, 1, 2, 3])
  assert int(new.position) == 0 and int(new.filled) == 4


def test_memory_rows_must_be_whole_batch_slices():
  memory = xbm_lib.init_memory(10, 2)
  with pytest.raises(ValueError, match="multiple of the global batch"):
    xbm_lib.enqueue(memory, jnp.ones((4, 2)), jnp.arange(4), step=0)


def test_bfloat16_storage():
  trees, losses = _run("shard_map", 2, 2 * BATCH, dtype="bfloat16")
  assert trees[-1]["xbm"]["embeddings"].dtype == jnp.bfloat16
  emb, _ = _expected_memory(trees, 2 * BATCH, 8)
  np.testing.assert_allclose(
      trees[-1]["xbm"]["embeddings"].astype(np.float32), emb, atol=1e-2)
  assert np.isfinite(losses).all()


ADAM = optim.make_optimizer(name="adam", learning_rate=1e-2)


@pytest.fixture(scope="module")
def placement_runs():
  return {mode: _run(mode, 4, 2 * BATCH, tx=ADAM)
          for mode in ("none", "shard_map", "pmap")}


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_devices_reach_the_parameters_of_one_device(placement_runs, mode):
  assert jax.device_count() == 8
  ref, ref_losses = placement_runs["none"]
  got, losses = placement_runs[mode]
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  chex.assert_trees_all_close(got[-1]["params"], ref[-1]["params"],
                              atol=2e-5, rtol=1e-4)
  # The same rows, laid out per device: as sets of (label, embedding).
  def rows(tree):
    m = tree["xbm"]
    order = np.lexsort(np.c_[m["embeddings"], m["labels"]].T)
    return m["labels"][order], m["embeddings"][order]
  for a, b in zip(rows(got[-1]), rows(ref[-1])):
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_the_memory_term_changes_the_training(placement_runs):
  """Without it the parameters differ (so the comparison above can fail)."""
  ref, _ = placement_runs["none"]
  plain, _ = _run("none", 4, 0, tx=ADAM)
  diff = max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(
      jax.tree.leaves(plain[-1]["params"]), jax.tree.leaves(ref[-1]["params"])))
  assert diff > 1e-3


@pytest.mark.parametrize("mode, shape", [("shard_map", (4, DIM)),
                                         ("pmap", (1, 4, DIM)),
                                         ("none", (32, DIM))])
def test_each_device_holds_its_share_of_the_rows(mode, shape):
  placement = parallel.get_placement(mode)
  host = state_lib.state_to_tree(_initial(2 * BATCH))
  placed = placement.replicate(host, sharded=xbm_lib.is_sharded)
  emb = placed["xbm"]["embeddings"]
  assert {s.data.shape for s in emb.addressable_shards} == {shape}
  assert placed["xbm"]["position"].addressable_shards[0].data.size == 1
  back = placement.to_host(placed, sharded=xbm_lib.is_sharded)
  chex.assert_trees_all_equal(back, host)


def test_bytes_per_device():
  assert xbm_lib.bytes_per_device(2048, 64, "float32", 1) == 2048 * (256 + 4)
  assert xbm_lib.bytes_per_device(2048, 64, "bfloat16", 8) == 256 * (128 + 4)


# ----------------------------------------------------------------------------
# Config checks.
# ----------------------------------------------------------------------------


def _check(**overrides):
  config_checks.check_config(helpers.digits_config(**overrides),
                             device_count=8, process_count=1)


@pytest.mark.parametrize("overrides, message", [
    ({"xbm.size": -40}, r"config\.xbm\.size: must be an int >= 0"),
    ({"xbm.size": 100}, r"config\.xbm\.size: must be a multiple of the global "
     r"batch 40 \(each of the 8 devices then holds a whole number of its "
     r"5-row batch slices\); got 100\."),
    ({"xbm.start_step": -1}, r"config\.xbm\.start_step: must be an int >= 0"),
    ({"xbm.weight": -0.5}, r"config\.xbm\.weight: must be a number >= 0"),
    ({"xbm.dtype": "float16"}, r"config\.xbm\.dtype: must be 'float32' or "
     r"'bfloat16'"),
])
def test_bad_xbm_values_name_the_field_and_the_fix(overrides, message):
  with pytest.raises(config_checks.ConfigError, match=message) as e:
    _check(**overrides)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["proxy_anchor", "arcface"])
def test_a_loss_without_references_cannot_use_a_memory(name):
  c = helpers.digits_config(**{"xbm.size": 80})
  c.loss = config_lib.loss_config(name)
  with pytest.raises(config_checks.ConfigError,
                     match=rf"config\.xbm\.size: loss '{name}' \(\w+\) does "
                     "not compare embeddings with reference embeddings"):
    config_checks.check_config(c, device_count=8, process_count=1)
  c.xbm.size = 0
  config_checks.check_config(c, device_count=8, process_count=1)


@pytest.mark.parametrize("name", sorted(losses_lib.LOSSES))
def test_every_loss_with_references_takes_a_memory_and_no_other(name):
  """The config check traces each pair loss against a memory."""
  c = helpers.digits_config(**{"xbm.size": 80})
  c.loss = config_lib.loss_config(name)
  if losses_lib.get_loss(name).supports_ref:
    config_checks.check_config(c, device_count=8, process_count=1)
  else:
    with pytest.raises(config_checks.ConfigError, match=r"config\.xbm\.size"):
      config_checks.check_config(c, device_count=8, process_count=1)


def test_the_pair_losses_take_references():
  assert {n for n, e in losses_lib.LOSSES.items() if e.supports_ref} >= {
      "circle", "multi_similarity", "ranked_list", "contrastive", "triplet",
      "lifted_structure", "n_pair", "margin"}


def test_memory_sizes_that_are_whole_batches_pass():
  for size in (0, 40, 2040):
    _check(**{"xbm.size": size, "xbm.dtype": "bfloat16", "xbm.weight": 0.0})


@pytest.mark.parametrize("loss", ["circle", "contrastive"])
def test_the_command_line_sets_a_memory_for_a_pair_loss(loss):
  c = test_config.parse(str(REPO_ROOT / "experiments/configs/digits.py"),
                        f"--config.loss.name={loss}", "--config.xbm.size=80",
                        "--config.xbm.start_step=3")
  assert (c.loss.name, c.xbm.size, c.xbm.start_step) == (loss, 80, 3)
  config_checks.check_config(c, device_count=8, process_count=1)


# ----------------------------------------------------------------------------
# The trainer: checkpoints and resume.
# ----------------------------------------------------------------------------

RUN_STEPS = 8
# The digits job (global batch 40) with a memory of 2 batches filled from
# step 2, so the killed run's checkpoint at step 4 holds a full memory.
RUN_FLAGS = [
    f"--config.num_train_steps={RUN_STEPS}", "--config.checkpoint_every_steps=4",
    "--config.eval_every_steps=0", "--config.eval_at_init=False",
    "--config.eval_clustering=False", "--config.best_metric=",
    "--config.log_every_steps=4", "--config.dataset.num_threads=2",
    "--config.xbm.size=80", "--config.xbm.start_step=2",
    # A one-block conv4 of width 8: the same job, a quarter of the compile.
    "--config.model.kwargs.width=8", "--config.model.kwargs.num_blocks=1"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds_xbm"))


def _main(workdir, data_dir):
  """The digits job with a memory, in a process of its own (8 CPU devices,
  as this test process: tests/conftest.py's XLA_FLAGS are inherited)."""
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.main",
       "--config=experiments/configs/digits.py", f"--workdir={workdir}",
       f"--config.dataset.data_dir={data_dir}", *RUN_FLAGS],
      cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
      env=dict(os.environ, PYTHONPATH=os.pathsep.join(
          [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])))


def _saved(workdir, step=RUN_STEPS):
  return helpers.saved_tree(workdir, step)


def test_sigkill_then_rerun_with_a_memory_is_bitwise_identical(data_dir,
                                                                tmp_path):
  reference = str(tmp_path / "reference")
  helpers.finish(_main(reference, data_dir))
  want = _saved(reference)
  assert int(want["xbm"]["filled"]) == 80 and (want["xbm"]["labels"] >= 0).all()
  killed = str(tmp_path / "killed")
  proc = _main(killed, data_dir)
  first = os.path.join(killed, "checkpoints", "latest", "4",
                       "_CHECKPOINT_METADATA")
  helpers.sigkill_when_exists(proc, first)  # nothing saved on the way out
  latest = os.listdir(os.path.join(killed, "checkpoints", "latest"))
  assert str(RUN_STEPS) not in latest, "killed too late to test anything"
  at_kill = _saved(killed, 4)["xbm"]
  assert int(at_kill["filled"]) == 80  # the memory was saved mid-run
  helpers.finish(_main(killed, data_dir))
  chex.assert_trees_all_equal(_saved(killed), want)


def test_a_workdir_from_before_the_memory_resumes_unchanged(data_dir,
                                                           tmp_path):
  """A run whose config.json has no xbm section (written by a version
  without XBM) resumes, and its checkpoints stay without a memory."""
  c = helpers.digits_config(**{
      "dataset.data_dir": data_dir, "dataset.num_threads": 2,
      "num_train_steps": 2, "checkpoint_every_steps": 2,
      "eval_every_steps": 0, "eval_at_init": False, "eval_clustering": False,
      "best_metric": ""})
  workdir = str(tmp_path / "old")
  loop.train_and_evaluate(c, workdir)
  path = os.path.join(workdir, "config.json")
  with open(path) as f:
    saved = json.load(f)
  del saved["xbm"]
  with open(path, "w") as f:
    json.dump(saved, f)
  c.num_train_steps = 4
  result = loop.train_and_evaluate(c, workdir)
  assert result["step"] == 4
  assert "xbm" not in _saved(workdir, 4)
