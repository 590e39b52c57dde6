"""The main job on a real full disk: one line, the last checkpoint kept, resume.

The workdir is on a real 1 MiB tmpfs (mounted here, so the test needs root;
elsewhere it is skipped, and ``tests/train/test_checkpoint_faults.py`` checks
the message with an injected ``ENOSPC`` and in a private mount namespace).
The filesystem is unmounted even when the test fails.
"""

import contextlib
import os
import re
import subprocess
import sys

import pytest

# Slow (jobs killed and resumed): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


@contextlib.contextmanager
def _tmpfs(path, size):
  os.makedirs(path, exist_ok=True)
  proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                         "tmpfs", str(path)], capture_output=True, text=True)
  if proc.returncode:
    pytest.skip("cannot mount a tmpfs here (needs root): "
                f"{(proc.stderr or proc.stdout).strip()[:200]}; the injected "
                "ENOSPC of tests/train/test_checkpoint_faults.py still runs")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", str(path)], check=False)


def _job(workdir, data_dir):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             PYTHONPATH=REPO)
  return subprocess.run(
      [sys.executable, "-m", "experiments.main",
       "--config=experiments/configs/digits.py", f"--workdir={workdir}",
       "--config.num_train_steps=30", "--config.checkpoint_every_steps=10",
       "--config.eval_every_steps=30", "--config.eval_at_init=false",
       "--config.eval_clustering=false", f"--config.dataset.data_dir={data_dir}"],
      # The test session's compilation cache (tests/conftest.py), not on the
      # tmpfs: the resumed job loads the programs the first one compiled.
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_a_full_disk_is_one_line_keeps_the_last_step_and_resumes(tmp_path):
  fs = tmp_path / "fs"
  workdir = fs / "run"
  data_dir = tmp_path / "tfds"  # the prepared dataset is not on the tmpfs
  with _tmpfs(fs, "1m"):
    proc = _job(workdir, data_dir)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Event loop is closed" not in proc.stderr, proc.stderr[-3000:]
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "no space left on the device" in errors[0], errors[0]
    assert str(workdir / "checkpoints") in errors[0], errors[0]
    kept = int(re.search(r"last: step (\d+)", errors[0]).group(1))
    # Every line is the job's own: progress, notes, the one error.
    for line in proc.stderr.splitlines():
      assert re.match(r"(step \d+|error:|Preparing dataset)", line), line
    # Space is freed (the filesystem grows): the same command resumes.
    subprocess.run(["mount", "-o", "remount,size=16m", str(fs)], check=True)
    proc = _job(workdir, data_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resumed from step {kept} ({workdir})." in proc.stderr, (
        proc.stderr[-3000:])
    assert "recall@1" in proc.stdout
