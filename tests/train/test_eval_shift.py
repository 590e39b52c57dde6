"""The trainer evaluates with shifted copies (``config.eval_shift``); the
views and their mean by hand are in tests/evaluation/test_embedding.py."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import config_facts
from circle_jax import evaluation as eval_lib
from circle_jax.train import loop
from circle_jax.evaluation import embedding as embedding_lib
from circle_jax.train import run as run_lib
from circle_jax.train import restore as restore_lib
from tests.evaluation import reference
from tests.train import helpers

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


def test_trainer_evaluates_with_the_shifted_views(tmp_path):
  """The run's metrics are those of the shift-averaged embeddings, computed
  here from the plain model; without the shift they differ."""
  c = helpers.digits_config(**{
      "dataset.data_dir": str(tmp_path / "tfds"), "dataset.num_threads": 2,
      "num_train_steps": 2, "eval_every_steps": 0, "eval_at_init": False,
      "checkpoint_every_steps": 0, "log_every_steps": 1,
      "eval_clustering": False, "best_metric": "", "eval_shift": 1})
  workdir = str(tmp_path / "run")
  loop.train_and_evaluate(c, workdir)
  with open(os.path.join(workdir, "metrics.json")) as f:
    final = json.load(f)["final"]
  run = restore_lib.restore_run(workdir)
  emb, labels = run.embed_split()
  source = run_lib.load_split(run.config, run.info, run.info.eval_splits[0])
  pre = config_facts.eval_preprocess(run.config, run.info)
  kw = dict(placement=run.placement, batch_size=64, num_threads=1)
  views = []
  plain_apply = jax.jit(functools.partial(run.model.apply, train=False))
  for dy, dx in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
    shift = lambda v, x, dy=dy, dx=dx: plain_apply(  # noqa: E731
        v, jnp.asarray(reference.shifted(np.asarray(x), dy, dx)))
    out, lab = embedding_lib.embed_split(
        run.variables, lambda v, x, f=shift: jax.pure_callback(
            lambda a: np.asarray(f(run.variables, a), np.float32),
            jax.ShapeDtypeStruct((x.shape[0], 4), np.float32), x),
        source, pre, **kw)
    np.testing.assert_array_equal(lab, labels)
    views.append(out / np.linalg.norm(out, axis=1, keepdims=True))
  want = np.mean(views, axis=0)
  np.testing.assert_allclose(emb, want, rtol=1e-5, atol=1e-6)
  metrics = eval_lib.retrieval_metrics(emb, labels, ks=tuple(run.info.ks))
  for k, v in metrics.items():
    assert final[k] == pytest.approx(float(v), abs=1e-6)
  plain, _ = embedding_lib.embed_split(
      run.variables, embedding_lib.model_apply(run.model), source, pre, **kw)
  assert not np.allclose(plain / np.linalg.norm(plain, axis=1, keepdims=True),
                         emb / np.linalg.norm(emb, axis=1, keepdims=True),
                         atol=1e-3)


@pytest.mark.parametrize("fraction", [0.0, 0.4])
def test_finished_run_resumed_with_a_shift_is_evaluated_again(tmp_path,
                                                              fraction):
  """Its last and its selected step are evaluated with the new setting (on
  the test split, and on the validation split that selected it); the
  selection stays; nothing is trained."""
  c = helpers.digits_config(**{
      "dataset.data_dir": str(tmp_path / "tfds"), "dataset.num_threads": 2,
      "dataset.validation_fraction": fraction,
      "batch.classes_per_batch": 3 if fraction else 5,
      "num_train_steps": 4, "eval_every_steps": 2, "eval_at_init": False,
      "checkpoint_every_steps": 2, "log_every_steps": 2,
      "eval_clustering": False, "best_mode": "min"})
  workdir = str(tmp_path / "run")
  before = loop.train_and_evaluate(c, workdir)
  c.eval_shift = 1
  after = loop.train_and_evaluate(c, workdir)
  # Nothing is trained: the training time is the one the last checkpoint
  # recorded (its wait for the final write is not in it), never more.
  assert 0 < after["train_seconds"] <= before["train_seconds"]
  assert after["best"]["step"] == before["best"]["step"]
  assert after["result"]["step"] == before["result"]["step"]
  for which, part in (("best", after["result"]["test"]),
                      ("latest", after["final"])):
    run = restore_lib.restore_run(workdir, which)
    emb, labels = run.embed_split()  # with the run's eval_shift, now 1
    assert run.config.eval_shift == 1
    want = eval_lib.retrieval_metrics(emb, labels, ks=tuple(run.info.ks))
    for k, v in want.items():
      assert part[k] == pytest.approx(float(v), abs=1e-6), (which, k)
  assert after["final"] != before["final"]
  if fraction:
    run = restore_lib.restore_run(workdir, "best")
    _, val = run_lib.load_sources(run.config, run.info)
    emb, labels = run.embed_split(source=val)
    want = eval_lib.retrieval_metrics(emb, labels, ks=tuple(run.info.ks))
    for k, v in want.items():
      assert after["best"]["validation"][k] == pytest.approx(float(v),
                                                             abs=1e-6), k
    assert after["best"]["validation"] != before["best"]["validation"]
  assert [list(ch["changes"]) for ch in after["config_changes"]] == [
      ["eval_shift"]]
