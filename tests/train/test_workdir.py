"""A workdir remembers its config: refusal, allowed changes, checkpoint fit."""

import json
import os

import numpy as np
import pytest

from circle_jax.train import loop
from circle_jax.train import restore as restore_lib
from circle_jax.train import workdir as workdir_lib
from tests.train import test_loop

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


def test_flatten_and_diff_list_every_changed_leaf():
  a = {"loss": {"name": "circle", "gamma": 80.0, "margin": 0.4},
       "model": {"kwargs": {}, "embedding_dim": 4}, "seed": 0}
  b = {"loss": {"name": "circle", "gamma": 64.0, "margin": 0.4,
                "block_size": 512},
       "model": {"kwargs": {}, "embedding_dim": 8}, "seed": 0}
  assert workdir_lib.flatten(a) == {
      "loss.name": "circle", "loss.gamma": 80.0, "loss.margin": 0.4,
      "model.kwargs": {}, "model.embedding_dim": 4, "seed": 0}
  assert workdir_lib.config_diff(a, b) == [
      ("loss.block_size", "<absent>", 512), ("loss.gamma", 80.0, 64.0),
      ("model.embedding_dim", 4, 8)]
  assert workdir_lib.config_diff(a, a) == []
  # A field added to the schema unset is no difference; set, it is one.
  unset = {**a, "loss": {**a["loss"], "collective": None}}
  assert workdir_lib.config_diff(a, unset) == []
  ring = {**a, "loss": {**a["loss"], "collective": "ring"}}
  assert workdir_lib.config_diff(a, ring) == [
      ("loss.collective", "<absent>", "ring")]


def test_check_resume_allows_only_resumable_fields(tmp_path):
  saved = {"num_train_steps": 10, "eval_every_steps": 5,
           "dataset": {"name": "digits", "num_threads": 2},
           "loss": {"name": "circle", "margin": 0.4}}
  workdir_lib.record(str(tmp_path), saved, step=0, changes=[])
  new = json.loads(json.dumps(saved))
  new["num_train_steps"], new["dataset"]["num_threads"] = 20, 4
  diff = workdir_lib.check_resume(str(tmp_path), new, resume_step=10)
  assert diff == [("dataset.num_threads", 2, 4), ("num_train_steps", 10, 20)]
  new["loss"]["margin"] = 0.25
  new["dataset"]["name"] = "omniglot_small"
  with pytest.raises(workdir_lib.WorkdirConfigError) as err:
    workdir_lib.check_resume(str(tmp_path), new, resume_step=10)
  msg = str(err.value)
  assert "holds a run at step 10 trained with another config" in msg
  assert 'dataset.name: "digits" -> "omniglot_small"' in msg
  assert "loss.margin: 0.4 -> 0.25" in msg
  assert "num_train_steps" not in msg          # allowed: not listed
  assert "another --workdir" in msg and "--force_resume" in msg
  assert len(workdir_lib.check_resume(str(tmp_path), new, resume_step=10,
                                      force=True)) == 4
  # No saved config (e.g. a run of an older version): nothing to compare.
  assert workdir_lib.check_resume(str(tmp_path / "other"), new,
                                  resume_step=3) == []


def test_record_appends_the_changes_with_their_step(tmp_path):
  workdir_lib.record(str(tmp_path), {"a": 1}, step=0, changes=[])
  assert not (tmp_path / workdir_lib.CHANGES_FILE).exists()
  workdir_lib.record(str(tmp_path), {"a": 2}, step=7,
                     changes=[("a", 1, 2)])
  workdir_lib.record(str(tmp_path), {"a": 3}, step=9,
                     changes=[("a", 2, 3)])
  assert workdir_lib.load_config(str(tmp_path)) == {"a": 3}
  hist = workdir_lib.load_changes(str(tmp_path))
  assert [(h["step"], h["changes"]) for h in hist] == [
      (7, {"a": {"from": 1, "to": 2}}), (9, {"a": {"from": 2, "to": 3}})]


@pytest.fixture(scope="module")
def short_run(test_loop_data_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("short_run"))
  c = test_loop.short_config(test_loop_data_dir, num_train_steps=6,
                             eval_every_steps=0, checkpoint_every_steps=3,
                             eval_clustering=False, eval_at_init=False)
  loop.train_and_evaluate(c, workdir)
  return workdir


@pytest.fixture(scope="module")
def test_loop_data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def test_changed_training_config_is_refused_and_nothing_is_overwritten(
    short_run, test_loop_data_dir):
  before = open(os.path.join(short_run, "config.json")).read()
  c = test_loop.short_config(test_loop_data_dir, num_train_steps=6,
                             eval_every_steps=0, checkpoint_every_steps=3,
                             eval_clustering=False, eval_at_init=False)
  c.loss.margin = 0.3
  c.model.embedding_dim = 8
  with pytest.raises(workdir_lib.WorkdirConfigError,
                     match=r"loss\.margin: 0\.4 -> 0\.3; "
                           r"model\.embedding_dim: 4 -> 8\)"):
    loop.train_and_evaluate(c, short_run)
  # Forced, the checkpoint cannot hold an 8-d head: a clear error, before
  # config.json is touched (so the embedding tool still reads the right one).
  with pytest.raises(restore_lib.CheckpointError,
                     match=r"\['params'\].*saved \(\d+, 4\), config builds "
                           r"\(\d+, 8\).*another --workdir"):
    loop.train_and_evaluate(c, short_run, force_resume=True)
  assert open(os.path.join(short_run, "config.json")).read() == before


def test_allowed_change_resumes_and_is_recorded(short_run, test_loop_data_dir):
  c = test_loop.short_config(test_loop_data_dir, num_train_steps=8,
                             eval_every_steps=0, checkpoint_every_steps=4,
                             eval_clustering=False, eval_at_init=False)
  result = loop.train_and_evaluate(c, short_run)
  assert result["step"] == 8
  changes = result["config_changes"]
  assert changes[-1]["step"] == 6
  assert changes[-1]["changes"] == {
      "num_train_steps": {"from": 6, "to": 8},
      "checkpoint_every_steps": {"from": 3, "to": 4}}
  saved = workdir_lib.load_config(short_run)
  assert saved["num_train_steps"] == 8
  with open(os.path.join(short_run, "metrics.json")) as f:
    assert json.load(f)["config_changes"] == changes
  assert np.isfinite(result["final"]["recall@1"])
