"""The trainer's class matrix sharded over the devices (circle_jax/train/class_rows.py).

Step level, on 8 simulated devices: a few train steps with the class matrix
and its Adam moments split by rows over the devices reach the parameters of
the one-device run with the whole matrix (shard_map and pmap), with a class
count that is not a multiple of the devices; summing the rows' gradients
over devices (the mutation) does not; the proxies' learning-rate multiplier
applies to the sharded rows; PartialFC's sampling replays after a resume.
The trainer-level tests (config checks, kill -9 and resume, a run saved on 8
devices resumed on 2) run the digits job.
"""

import functools
import os
import shutil
import subprocess
import sys

import chex
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import config as config_lib
from circle_jax import losses as losses_lib
from circle_jax import parallel
from circle_jax.train import class_rows as class_rows_lib
from circle_jax.train import config_checks
from circle_jax.train import optim
from circle_jax.train import state as state_lib
from circle_jax.train import step as step_lib
from circle_jax.train import workdir as workdir_lib
from tests import test_config
from tests.conftest import REPO_ROOT
from tests.train import helpers

# Slow (runs per placement, resumes): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

NUM_STEPS = 3
C = 5  # classes 0-3 in the batches, 4 absent; ceil(5 / 8) = 1 row a device
LR = 1e-2
ADAM = optim.make_optimizer(name="adam", learning_rate=LR,
                            lr_multipliers={"loss": 10.0})
MODEL = helpers.TinyNet(freeze_bn=True)


def _host_state(name, num_classes, tx=ADAM):
  """The one-device host tree at step 0: the whole class matrix."""
  entry = losses_lib.get_loss(name)
  proxies = entry.init_params(jax.random.PRNGKey(7), num_classes,
                              MODEL.embedding_dim)
  state = helpers.initial_state(
      MODEL, tx, jnp.zeros((2, 6, 6, 1)), key=jax.random.PRNGKey(0),
      loss_params={entry.param_name: proxies})
  return state, parallel.SingleDevice().to_host(
      state_lib.state_to_tree(state))


def _batches(num_classes=4, steps=NUM_STEPS):
  return [jax.tree.map(np.asarray, helpers.fake_batch(
      jax.random.PRNGKey(i), num_classes=num_classes)) for i in range(steps)]


def _steps(mode, name, *, num_classes=C, shard=True, hyper=None,
           exclude_rows=True, tx=ADAM, host=None, batches=None):
  """``(host tree, grad norms)`` after the ``batches`` (default: 3 steps)
  from ``host`` (default: step 0) under ``mode``."""
  state, init = _host_state(name, num_classes, tx)
  entry = losses_lib.get_loss(name)
  hyper = dict(hyper or {})
  rows = None
  if shard:
    rows = class_rows_lib.ClassRows(
        entry.param_name, num_classes,
        entry.defaults.get("centers_per_class", 1))
    hyper.update(shard_classes=True, num_classes=num_classes)
  placement = parallel.get_placement(mode)
  sharded = class_rows_lib.sharded_leaves(rows)
  fn = functools.partial(
      step_lib.train_step, loss_fn=step_lib.make_loss_fn(entry, hyper),
      base_key=jax.random.PRNGKey(3),
      sharded=sharded if exclude_rows else None)
  step = placement.wrap_step(fn, sharded=sharded)
  placed = placement.replicate(class_rows_lib.pad(
      rows, init if host is None else host, placement.num_devices),
      sharded=sharded)
  state = state_lib.state_from_tree(state, placed)
  norms = []
  for batch in _batches() if batches is None else batches:
    state, metrics = step(state, placement.shard_batch(batch))
    metrics = jax.device_get(placement.first_replica(metrics))
    assert bool(metrics["finite"])
    norms.append(float(metrics["grad_norm"]))
  tree = placement.to_host(state_lib.state_to_tree(state), sharded=sharded)
  return class_rows_lib.unpad(rows, tree), norms


@pytest.fixture(scope="module")
def runs():
  return {mode: _steps(mode, "proxy_anchor", shard=mode != "none")
          for mode in ("none", "shard_map", "pmap")}


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_sharded_rows_reach_the_one_device_parameters(runs, mode):
  assert jax.device_count() == 8
  ref, ref_norms = runs["none"]
  got, norms = runs[mode]
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
  chex.assert_trees_all_close(got["params"], ref["params"], atol=2e-5,
                              rtol=1e-4)
  chex.assert_trees_all_close(got["opt_state"], ref["opt_state"], atol=2e-5,
                              rtol=1e-4)
  assert got["params"]["loss"]["proxies"].shape == (C, MODEL.embedding_dim)


def test_several_rows_per_class_are_sharded_by_class():
  """SoftTriple's K = 10 centres a class: 50 rows, 10 a device (+ 30
  padding), the same parameters as one device."""
  ref, _ = _steps("none", "soft_triple", shard=False,
                  batches=_batches(steps=2))
  got, _ = _steps("pmap", "soft_triple", batches=_batches(steps=2))
  assert got["params"]["loss"]["centers"].shape == (5 * 10,
                                                    MODEL.embedding_dim)
  chex.assert_trees_all_close(got["params"], ref["params"], atol=2e-5,
                              rtol=1e-4)


def test_summing_the_rows_gradients_over_devices_is_caught(runs):
  """pmap psum-ing the sharded rows' gradients (as it must the replicated
  parameters') moves every row by the other devices' gradients too."""
  ref, _ = runs["none"]
  wrong, _ = _steps("pmap", "proxy_anchor", exclude_rows=False)
  diff = np.abs(wrong["params"]["loss"]["proxies"]
                - ref["params"]["loss"]["proxies"]).max()
  assert diff > 1e-2


def test_the_proxies_learning_rate_multiplier_applies_to_sharded_rows():
  """Adam's first update is lr x multiplier x sign(g): the rows of the
  classes in the batch move by 10 x lr, the model's parameters by lr."""
  _, init = _host_state("proxy_anchor", C)
  got, _ = _steps("shard_map", "proxy_anchor", batches=_batches(steps=1))
  moved = np.abs(got["params"]["loss"]["proxies"]
                 - init["params"]["loss"]["proxies"])
  np.testing.assert_allclose(moved[:4].max(), 10 * LR, rtol=1e-3)
  head = np.abs(got["params"]["model"]["head"]["kernel"]
                - init["params"]["model"]["head"]["kernel"])
  np.testing.assert_allclose(head.max(), LR, rtol=1e-3)


@pytest.mark.parametrize("mode, shape", [("shard_map", (1, 4)),
                                         ("pmap", (1, 1, 4))])
def test_each_device_holds_its_rows_and_their_adam_moments(mode, shape):
  _, host = _host_state("proxy_anchor", C)
  rows = class_rows_lib.ClassRows("proxies", C)
  placement = parallel.get_placement(mode)
  placed = placement.replicate(rows.pad(host, 8), sharded=rows.sharded)
  leaves = [x for p, x in jax.tree_util.tree_leaves_with_path(placed)
            if rows.is_rows(p)]
  assert len(leaves) == 3  # the proxies, Adam's mu and nu
  for x in leaves:
    assert {s.data.shape for s in x.addressable_shards} == {shape}
  back = rows.unpad(placement.to_host(placed, sharded=rows.sharded))
  chex.assert_trees_all_equal(back, host)


def test_padding_lays_out_ceil_c_over_n_classes_per_device():
  rows = class_rows_lib.ClassRows("proxies", 5, per_class=3)
  tree = {"params": {"loss": {"proxies": np.ones((15, 2))}},
          "other": np.ones((15, 2))}
  padded = rows.pad(tree, 4)  # ceil(5 / 4) = 2 classes, 6 rows a device
  assert padded["params"]["loss"]["proxies"].shape == (24, 2)
  assert (padded["params"]["loss"]["proxies"][15:] == 0).all()
  assert padded["other"].shape == (15, 2)
  chex.assert_trees_all_equal(rows.unpad(padded), tree)
  with pytest.raises(ValueError, match="has 14 rows; the class matrix has 15"):
    rows.pad({"loss": {"proxies": np.ones((14, 2))}}, 4)


def test_sampled_classes_replay_after_a_resume():
  """PartialFC's sampling (r < 1) depends on (seed, step) only: two steps
  equal one step, a host round trip, and the second step, bitwise; and the
  sampling does change the step (so the comparison can fail)."""
  classes = 8 * 32  # 32 rows a device > the global batch of 16: sampled
  kw = dict(num_classes=classes, hyper={"sample_rate": 0.25})
  two = _batches(num_classes=classes, steps=2)
  whole, _ = _steps("shard_map", "arcface", batches=two, **kw)
  first, _ = _steps("shard_map", "arcface", batches=two[:1], **kw)
  resumed, _ = _steps("shard_map", "arcface", batches=two[1:], host=first,
                      **kw)
  chex.assert_trees_all_equal(resumed, whole)
  full, _ = _steps("shard_map", "arcface", batches=two,
                   num_classes=classes)
  diff = np.abs(full["params"]["loss"]["class_weights"]
                - whole["params"]["loss"]["class_weights"]).max()
  assert diff > 1e-3


# ----------------------------------------------------------------------------
# Config checks.
# ----------------------------------------------------------------------------


def _config(loss="proxy_anchor", *, loss_fields=None, **overrides):
  c = helpers.digits_config(**overrides)
  c.loss = config_lib.loss_config(loss, **dict(loss_fields or {}))
  return c


def _fails(c, message):
  with pytest.raises(config_checks.ConfigError, match=message) as e:
    config_checks.check_config(c, device_count=8, process_count=1)
  assert "\n" not in str(e.value)


def test_the_class_layout_fields_default_once_from_the_loss_layout():
  layout = losses_lib.class_shard.Layout()
  c = config_lib.loss_config("arcface")
  assert (c.shard_classes, c.sample_rate) == (layout.shard_classes,
                                              layout.sample_rate)
  assert "sample_rate" not in config_lib.loss_config("proxy_anchor")
  assert "shard_classes" not in config_lib.loss_config("circle")
  for name in ("proxy_anchor", "arcface", "soft_triple"):
    config_checks.check_config(
        _config(name, loss_fields={"shard_classes": True}), device_count=8,
        process_count=1)


def test_a_loss_without_a_class_matrix_has_no_shard_classes():
  with pytest.raises(flags.IllegalFlagValueError, match=r"config\.loss\.shard_classes: loss "
                     r"'circle' has no hyperparameter 'shard_classes'"):
    test_config.parse(str(REPO_ROOT / "experiments/configs/digits.py"),
                      "--config.loss.shard_classes=true")
  c = test_config.parse(str(REPO_ROOT / "experiments/configs/digits.py"),
                        "--config.loss.shard_classes=true",
                        "--config.loss.name=arcface",
                        "--config.loss.sample_rate=0.5")
  assert (c.loss.shard_classes, c.loss.sample_rate) == (True, 0.5)


@pytest.mark.parametrize("fields, overrides, message", [
    ({"shard_classes": True}, {"parallelism": "none"},
     r"config\.loss\.shard_classes: shards the class matrix over the devices:"
     r" use parallelism 'shard_map' or 'pmap', not 'none'\."),
    ({"sample_rate": 0.0}, {}, r"config\.loss\.sample_rate: must be a number"
     r" in \(0, 1\]"),
    ({"sample_rate": 1.5}, {}, r"config\.loss\.sample_rate: must be a number"
     r" in \(0, 1\]"),
    ({"shard_classes": True}, {"optim.grad_clip_norm": 1.0},
     r"config\.optim\.grad_clip_norm: .* use optim\.grad_clip_value or "
     r"loss\.shard_classes=False\."),
    ({}, {"dataset.num_classes": 6},
     r"config\.dataset\.num_classes: 6 classes, but 'digits' trains on 5 .*"
     r"unset it to use the data's count\."),
])
def test_bad_class_layouts_are_one_line_naming_the_fix(fields, overrides,
                                                      message):
  _fails(_config("arcface", loss_fields=fields, **overrides), message)


def test_the_datas_own_class_count_and_sampling_alone_pass():
  config_checks.check_config(
      _config("arcface", loss_fields={"sample_rate": 0.5},
              **{"dataset.num_classes": 5}), device_count=8, process_count=1)


# ----------------------------------------------------------------------------
# The trainer: kill -9 and resume, and a run saved on 8 devices resumed on 2.
# ----------------------------------------------------------------------------

RUN_STEPS = 8
RUN_FLAGS = [
    "--config.loss.name=proxy_anchor", "--config.loss.shard_classes=true",
    f"--config.num_train_steps={RUN_STEPS}",
    "--config.checkpoint_every_steps=4", "--config.eval_every_steps=0",
    "--config.eval_at_init=False", "--config.eval_clustering=False",
    "--config.best_metric=", "--config.log_every_steps=4",
    "--config.dataset.num_threads=2",
    # A one-block conv4 of width 8: the same job, a quarter of the compile.
    "--config.model.kwargs.width=8", "--config.model.kwargs.num_blocks=1"]


def _main(workdir, data_dir, devices=8):
  """The digits job (5 classes: 3 padding rows on 8 devices, 1 on 2) with
  the class matrix sharded, in a process of its own on ``devices`` CPU
  devices."""
  flags = os.environ.get("XLA_FLAGS", "").replace(
      "--xla_force_host_platform_device_count=8",
      f"--xla_force_host_platform_device_count={devices}")
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.main",
       "--config=experiments/configs/digits.py", f"--workdir={workdir}",
       f"--config.dataset.data_dir={data_dir}", *RUN_FLAGS],
      cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
      env=dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=os.pathsep.join(
          [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])))


def _saved(workdir):
  return helpers.saved_tree(workdir, RUN_STEPS)


def test_sigkill_resumes_bitwise_and_8_devices_resume_on_2(tmp_path):
  data_dir = str(tmp_path / "tfds")
  reference = str(tmp_path / "reference")
  helpers.finish(_main(reference, data_dir))
  want = _saved(reference)
  assert want["params"]["loss"]["proxies"].shape == (5, 4)  # whole, unpadded
  killed = str(tmp_path / "killed")
  proc = _main(killed, data_dir)
  helpers.sigkill_when_exists(proc, os.path.join(
      killed, "checkpoints", "latest", "4", "_CHECKPOINT_METADATA"))
  latest = os.listdir(os.path.join(killed, "checkpoints", "latest"))
  assert str(RUN_STEPS) not in latest, "killed too late to test anything"
  moved = str(tmp_path / "moved")
  shutil.copytree(killed, moved)
  helpers.finish(_main(killed, data_dir))
  chex.assert_trees_all_equal(_saved(killed), want)
  # The step-4 checkpoint of 8 devices, re-sharded over 2 (ceil(5 / 2) = 3
  # rows each, one padding row): the class rows and their Adam moments
  # continue as on 8 devices, to float rounding.
  helpers.finish(_main(moved, data_dir, devices=2))
  got = _saved(moved)
  for path in (("params",), ("opt_state",)):
    a = [x for p, x in jax.tree_util.tree_leaves_with_path(got[path[0]])
         if class_rows_lib.ClassRows("proxies", 5).is_rows(p)]
    b = [x for p, x in jax.tree_util.tree_leaves_with_path(want[path[0]])
         if class_rows_lib.ClassRows("proxies", 5).is_rows(p)]
    assert a and len(a) == len(b)
    for x, y in zip(a, b):
      np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-4)


def test_a_run_resumes_with_the_class_matrix_sharded_or_whole(tmp_path):
  """The checkpoint holds the whole matrix either way and the loss is the
  same, so loss.shard_classes may change on resume; loss.sample_rate (another
  loss) may not."""
  saved = workdir_lib.config_to_dict(_config("arcface"))
  workdir_lib.record(str(tmp_path), saved, step=4, changes=[])
  new = workdir_lib.config_to_dict(
      _config("arcface", loss_fields={"shard_classes": True}))
  assert workdir_lib.check_resume(str(tmp_path), new, resume_step=4) == [
      ("loss.shard_classes", False, True)]
  new = workdir_lib.config_to_dict(
      _config("arcface", loss_fields={"sample_rate": 0.5}))
  with pytest.raises(workdir_lib.WorkdirConfigError,
                     match=r"loss\.sample_rate: 1\.0 -> 0\.5"):
    workdir_lib.check_resume(str(tmp_path), new, resume_step=4)
