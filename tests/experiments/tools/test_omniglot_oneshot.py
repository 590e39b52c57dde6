"""experiments/tools/omniglot_oneshot.py: the official one-shot runs from the
command line (on the tiny runs of ``tests/evaluation/oneshot_fixture.py``)."""

import os
import pathlib
import subprocess
import sys

import pytest

from circle_jax import config_facts
from circle_jax.evaluation import omniglot_oneshot
from circle_jax.train import restore as restore_lib
from tests.evaluation.oneshot_fixture import make_runs, train_tiny_workdir

# Slow (whole jobs or benchmarks): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

REPO = str(pathlib.Path(__file__).resolve().parents[3])


def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             PYTHONPATH=os.pathsep.join(
                 p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
  return subprocess.run(
      [sys.executable, "-m", "experiments.tools.omniglot_oneshot", *args],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return train_tiny_workdir(str(tmp_path_factory.mktemp("oneshot_cli")))


def test_prints_each_run_and_the_mean(workdir, tmp_path):
  _, runs = make_runs(tmp_path, as_zip=False, top_folder=True,
                      run_relative=False)
  proc = _cli(f"--workdir={workdir}", f"--runs={runs}", "--which=latest")
  assert proc.returncode == 0, proc.stderr[-2000:]
  result, _ = omniglot_oneshot.evaluate_run(
      restore_lib.restore_run(workdir, "latest"),
      omniglot_oneshot.read_runs(runs))
  lines = proc.stdout.strip().splitlines()
  assert "latest checkpoint at step 2" in lines[0]
  assert lines[1:] == [f"{n}  {e:6.2f}%" for n, e in zip(
      result.runs, result.errors)] + [
          f"mean   {result.mean_error:6.2f}% over 3 runs"]


def test_bad_runs_path_is_one_line(workdir, tmp_path):
  proc = _cli(f"--workdir={workdir}", f"--runs={tmp_path / 'all_runs.zip'}")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      f"error: --runs: '{tmp_path / 'all_runs.zip'}' does not exist; give "
      "all_runs.zip of the Omniglot repository (python/one-shot-"
      "classification) or its extracted folder."]


def test_an_ensemble_on_the_stand_in_runs(workdir):
  """Two --workdir make one ensemble (here the same model twice: the
  ensemble's errors are that model's); --stand_in draws the runs from the
  held-out alphabets and says they are not the official runs."""
  proc = _cli(f"--workdir={workdir}", f"--workdir={workdir}", "--stand_in",
              "--stand_in_seed=1", "--which=latest")
  assert proc.returncode == 0, proc.stderr[-2000:]
  result, _ = omniglot_oneshot.evaluate_run(
      restore_lib.restore_run(workdir, "latest"),
      omniglot_oneshot.stand_in_runs(seed=1))
  lines = proc.stdout.strip().splitlines()
  assert lines[:2] == [f"member {workdir}, latest checkpoint at step 2: mean "
                       f"{result.mean_error:6.2f}%"] * 2
  assert lines[2] == ("ensemble of 2 models, stand-in runs (seed 1), not the "
                      "official runs: 1-NN (cosine) one-shot error")
  assert lines[3:] == [f"{n}  {e:6.2f}%" for n, e in zip(
      result.runs, result.errors)] + [
          f"mean   {result.mean_error:6.2f}% over 20 runs"]


def test_default_runs_are_the_official_runs_and_eval_shift_overrides(workdir):
  """Without --runs or --stand_in: the official runs shipped with the
  package; --eval_shift replaces the run's test-time shift, and one out of
  range is refused in one line."""
  proc = _cli(f"--workdir={workdir}", "--which=latest", "--eval_shift=1")
  assert proc.returncode == 0, proc.stderr[-2000:]
  run = restore_lib.restore_run(workdir, "latest")
  assert run.config.eval_shift == 0
  run.config.eval_shift = 1
  result, _ = omniglot_oneshot.evaluate_run(run,
                                            omniglot_oneshot.official_runs())
  lines = proc.stdout.strip().splitlines()
  assert lines[0].endswith("official runs: 1-NN (cosine) one-shot error")
  assert lines[1:] == [f"{n}  {e:6.2f}%" for n, e in zip(
      result.runs, result.errors)] + [
          f"mean   {result.mean_error:6.2f}% over 20 runs"]
  size = config_facts.eval_preprocess(run.config, run.info).image_size
  proc = _cli(f"--workdir={workdir}", "--which=latest", f"--eval_shift={size}")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      f"error: --eval_shift (for {workdir}): must be an int in "
      f"[0, {(size - 1) // 2}] (pixels of the {size} px evaluation image; "
      f"0: off); got {size}."]


def test_several_stand_in_draws_print_each_draws_mean(workdir):
  """--stand_in_draws 2 scores the draws of seeds 2 and 3 together: one line
  per draw with its own mean (what --stand_in_seed alone gives for it), and
  the mean over the 40 runs."""
  proc = _cli(f"--workdir={workdir}", "--stand_in", "--stand_in_seed=2",
              "--stand_in_draws=2", "--which=latest")
  assert proc.returncode == 0, proc.stderr[-2000:]
  run = restore_lib.restore_run(workdir, "latest")
  draws = [omniglot_oneshot.evaluate_run(
      run, omniglot_oneshot.stand_in_runs(seed=k))[0] for k in (2, 3)]
  lines = proc.stdout.strip().splitlines()
  assert "stand-in runs (seeds 2-3), not the official runs" in lines[0]
  assert lines[1:] == [
      f"seed2  {draws[0].mean_error:6.2f}% (mean of 20 runs)",
      f"seed3  {draws[1].mean_error:6.2f}% (mean of 20 runs)",
      f"mean   {(draws[0].mean_error + draws[1].mean_error) / 2:6.2f}% "
      "over 40 runs"]


@pytest.mark.parametrize("args, message", [
    (["--stand_in", "--stand_in_draws=0"], "--stand_in_draws must be >= 1; "
     "got 0."),
    (["--stand_in_draws=2"], "--stand_in_draws needs --stand_in"),
])
def test_bad_stand_in_draws_is_one_usage_line(workdir, args, message):
  proc = _cli(f"--workdir={workdir}", *args)
  assert proc.returncode == 2
  assert message in proc.stderr.strip().splitlines()[-1]


def test_align_flags_replace_the_runs_oneshot_config(workdir):
  """--align with --align_shift and --align_angles scores as the library
  does with those config.oneshot fields, and says how it compares."""
  proc = _cli(f"--workdir={workdir}", "--which=latest", "--align",
              "--align_shift=1", "--align_angles=-5,5")
  assert proc.returncode == 0, proc.stderr[-2000:]
  run = restore_lib.restore_run(workdir, "latest")
  assert not run.config.oneshot.align
  run.config.oneshot.update(align=True, align_shift=1, align_angles=(-5., 5.))
  result, _ = omniglot_oneshot.evaluate_run(run,
                                            omniglot_oneshot.official_runs())
  lines = proc.stdout.strip().splitlines()
  assert lines[0].endswith(
      "official runs: 1-NN (aligned cosine: views shifted up to 1 px, rotated "
      "-5, 5 deg) one-shot error")
  assert lines[1:] == [f"{n}  {e:6.2f}%" for n, e in zip(
      result.runs, result.errors)] + [
          f"mean   {result.mean_error:6.2f}% over 20 runs"]


@pytest.mark.parametrize("args, code, message", [
    (["--align_angles=a,b"], 2, "expected degrees separated by commas"),
    (["--align", "--align_angles=90"], 1, "error: the one-shot alignment of "),
])
def test_bad_align_flags_are_one_line(workdir, args, code, message):
  proc = _cli(f"--workdir={workdir}", "--which=latest", *args)
  assert proc.returncode == code
  assert message in proc.stderr.strip().splitlines()[-1]
