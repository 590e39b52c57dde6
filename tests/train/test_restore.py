"""Tests of circle_jax/train/restore.py: a workdir's config, checkpoints and
model, restored from a workdir written without training
(``helpers.write_run``); the trainer's own resumes are in test_loop.py."""

import json
import os

import jax
import numpy as np
import pytest

from circle_jax import config_facts
from circle_jax import data as data_lib
from circle_jax import parallel
from circle_jax.train import restore as restore_lib
from circle_jax.train import run as run_lib
from circle_jax.train import state as state_lib
from circle_jax.train import workdir as workdir_lib
from tests.train import helpers


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``(config, workdir, trees)``: latest step 4, best step 2."""
  root = tmp_path_factory.mktemp("restore")
  config = helpers.digits_config(**{"dataset.data_dir": str(root / "tfds"),
                                    "dataset.num_threads": 2})
  workdir = str(root / "run")
  return config, workdir, helpers.write_run(config, workdir)


def _equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_restore_run_takes_the_best_checkpoint_unless_asked(saved):
  config, workdir, trees = saved
  run = restore_lib.restore_run(workdir, placement=parallel.SingleDevice())
  assert (run.which, run.step) == ("best", 2)
  assert run.meta["metrics"] == {"recall@1": 0.5}
  assert run.workdir == os.path.abspath(workdir) and run.info.name == "digits"
  _equal(run.variables, state_lib.model_variables(trees["best"]))
  latest = restore_lib.restore_run(workdir, "latest",
                                   placement=parallel.SingleDevice())
  assert (latest.which, latest.step) == ("latest", 4)
  _equal(latest.variables, state_lib.model_variables(trees["latest"]))
  assert workdir_lib.config_to_dict(run.config) == (
      workdir_lib.config_to_dict(config))


# Slow tier (CI): embeds a whole saved run.
@pytest.mark.slow
def test_a_restored_run_embeds_as_its_model_does(saved):
  _, workdir, _ = saved
  run = restore_lib.restore_run(workdir)  # the config's placement: shard_map
  assert isinstance(run.placement, parallel.ShardMap)
  source = run_lib.load_split(run.config, run.info, "test")
  records = [source[i] for i in range(11)]
  emb, labels = run.embed_split(source=records)
  pre = config_facts.eval_preprocess(run.config, run.info)
  x = np.stack([pre(r["image"]) for r in records])
  want = run.model.apply(run.variables, x, train=False)
  np.testing.assert_allclose(emb, want, atol=1e-5)
  np.testing.assert_array_equal(labels, [r["label"] for r in records])
  assert emb.shape == (11, run.config.model.embedding_dim)


def test_a_workdir_without_a_run_or_a_checkpoint_is_a_run_error(saved,
                                                                 tmp_path):
  config, workdir, _ = saved
  with pytest.raises(restore_lib.RunError, match=(
      "config.json not found: --workdir must be the folder of a training "
      "run")):
    restore_lib.restore_run(str(tmp_path))
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  (fresh / "config.json").write_text(
      open(os.path.join(workdir, "config.json")).read())
  for which in (None, "best"):
    want = "latest" if which is None else "best"
    with pytest.raises(restore_lib.RunError,
                       match=f"has no {want} checkpoint yet; train it first"):
      restore_lib.restore_run(str(fresh), which)


def test_a_checkpoint_of_another_model_is_a_checkpoint_error(saved, tmp_path):
  _, workdir, _ = saved
  other = tmp_path / "other"
  other.mkdir()
  os.symlink(os.path.join(workdir, "checkpoints"), other / "checkpoints")
  saved_config = json.loads(
      open(os.path.join(workdir, "config.json")).read())
  saved_config["model"]["embedding_dim"] = 8
  (other / "config.json").write_text(json.dumps(saved_config))
  with pytest.raises(restore_lib.CheckpointError) as e:
    restore_lib.restore_run(str(other), placement=parallel.SingleDevice())
  msg = str(e.value)
  assert "\n" not in msg and "Checkpoint step 2" in msg
  assert "saved (4,), config builds (8,)" in msg
  assert msg.endswith("start fresh with another --workdir.")


def test_check_restored_names_the_misfits_parameters_first():
  template = {"params": {"a": np.zeros(2), "b": np.zeros((2, 3))},
              "step": np.zeros(())}
  restore_lib.check_restored(
      {"params": {"a": np.ones(2), "b": np.ones((2, 3))}, "step": 1},
      template, 5, "/d")
  with pytest.raises(restore_lib.CheckpointError) as e:
    restore_lib.check_restored({"step": np.zeros(3), "params": {
        "b": np.zeros((3, 2))}}, template, 5, "/d")
  assert str(e.value) == (
      "Checkpoint step 5 in /d does not fit this config's model/loss "
      "(['params']['a'] missing; ['params']['b'] saved (3, 2), config builds "
      "(2, 3); ['step'] saved (3,), config builds ()); it was written by "
      "another configuration: start fresh with another --workdir.")
  extra = {"params": {"a": np.ones(2), "b": np.ones((2, 3)),
                      "c": np.ones(1)}, "step": 1}
  with pytest.raises(restore_lib.CheckpointError,
                     match=r"\(different parameters\)"):
    restore_lib.check_restored(extra, template, 5, "/d")


def test_restore_checkpoint_checks_the_template(saved):
  config, workdir, trees = saved
  ckpts = restore_lib.open_checkpoints(config, workdir)
  try:
    tree, _, meta = restore_lib.restore_checkpoint(ckpts, trees["latest"])
    assert meta["step"] == 4 and int(tree["step"]) == 4
    _equal(tree, trees["latest"])
    tree, _, meta = restore_lib.restore_checkpoint(ckpts, which="best")
    assert meta["step"] == 2
    bad = jax.tree.map(lambda x: x, trees["latest"])
    bad["params"]["model"]["head"]["embedding"]["kernel"] = np.zeros((7, 7), np.float32)
    with pytest.raises(restore_lib.CheckpointError,
                       match="Checkpoint step .* in .*checkpoints"):
      restore_lib.restore_checkpoint(ckpts, bad)
  finally:
    ckpts.close()


def test_load_config_reads_the_runs_config(saved, tmp_path):
  config, workdir, _ = saved
  got = restore_lib.load_config(workdir)
  assert workdir_lib.config_to_dict(got) == workdir_lib.config_to_dict(config)
  with pytest.raises(restore_lib.RunError, match="not found"):
    restore_lib.load_config(str(tmp_path))
  assert data_lib.get_dataset_info(got.dataset.name).name == "digits"
