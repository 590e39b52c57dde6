"""Subprocess runs of the main job: SIGKILL + resume, and two JAX processes.

Each run is ``python -m experiments.main`` on digits with a few steps; the
comparisons read the final checkpoints (``checkpoints/latest/<last step>``).
"""

import os
import signal
import subprocess

import chex
import portpicker
import pytest

from circle_jax.train import checkpoint as ckpt_lib
from experiments.tools import check_determinism
from tests.train import helpers

# Slow (jobs killed and resumed): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
STEPS = 24


def _command(workdir, data_dir, *extra):
  return check_determinism.short_run_command(workdir, data_dir, STEPS, extra)


def _env(devices):
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _run(cmd, env, timeout=300):
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


def _final(workdir):
  ckpts = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"))
  assert ckpts.latest_step() == STEPS
  tree, data_state, _ = ckpts.restore()
  ckpts.close()
  assert data_state == {"step": STEPS}
  return tree


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds_sub"))


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
  """An uninterrupted 4-device run."""
  workdir = str(tmp_path_factory.mktemp("ref"))
  _run(_command(workdir, data_dir), _env(4))
  return _final(workdir)


def test_sigkill_then_rerun_gives_bitwise_identical_parameters(
    reference, data_dir, tmp_path):
  workdir = str(tmp_path / "killed")
  cmd, env = _command(workdir, data_dir), _env(4)
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  first = os.path.join(workdir, "checkpoints", "latest", "4",
                       "_CHECKPOINT_METADATA")
  helpers.sigkill_when_exists(proc, first)
  assert not os.path.exists(os.path.join(workdir, "metrics.json"))
  # What the killed run left: finalised steps, maybe a temporary directory.
  latest = os.path.join(workdir, "checkpoints", "latest")
  left = sorted(os.listdir(latest))
  assert "4" in left
  assert str(STEPS) not in left, "killed too late to test anything"
  _run(cmd, env)
  chex.assert_trees_all_equal(_final(workdir), reference)


def test_half_written_checkpoint_is_never_restored(reference, data_dir,
                                                   tmp_path):
  """A temporary (unfinalised) step directory is ignored and cleaned up."""
  workdir = str(tmp_path / "tmpdir")
  cmd, env = _command(workdir, data_dir), _env(4)
  _run(cmd[:6] + ["--config.num_train_steps=8"] + cmd[7:], env)
  latest = os.path.join(workdir, "checkpoints", "latest")
  assert sorted(os.listdir(latest)) == ["4", "8"]
  # Fake an interrupted save of step 20: a copy of step 8, corrupted, with
  # orbax's temporary name (the rename to "20" is the commit point).
  import shutil
  tmp = os.path.join(latest, "20.orbax-checkpoint-tmp-1234567")
  shutil.copytree(os.path.join(latest, "8"), tmp)
  for root, _, files in os.walk(os.path.join(tmp, "state")):
    for name in files:
      with open(os.path.join(root, name), "wb") as f:
        f.write(b"garbage")
  ckpts = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"))
  assert ckpts.latest_step() == 8
  ckpts.close()
  _run(cmd, env)
  assert not os.path.exists(tmp)
  chex.assert_trees_all_equal(_final(workdir), reference)


def test_two_processes_match_one_process(reference, data_dir, tmp_path):
  """2 processes x 2 CPU devices (gloo collectives) == 1 process x 4."""
  workdir = str(tmp_path / "multi")
  port = portpicker.pick_unused_port()
  procs = []
  for pid in range(2):
    cmd = _command(workdir, data_dir, f"--coordinator_address=localhost:{port}",
                   "--num_processes=2", f"--process_id={pid}")
    procs.append(subprocess.Popen(
        cmd, cwd=REPO, env=_env(2), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True))
  outs = [p.communicate(timeout=400) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-4000:]
  assert os.path.exists(os.path.join(workdir, "metrics.json"))
  # Not bitwise: gloo's cross-process all-reduce sums in another order than
  # the in-process one, and 24 SGD-momentum steps accumulate that rounding
  # (measured: max |diff| 4.5e-5 on conv kernels of magnitude ~0.1-1). A wrong
  # batch split, device order or gradient scaling gives O(0.1-1) differences.
  chex.assert_trees_all_close(_final(workdir), reference, rtol=1e-3,
                              atol=2e-4)


def _start_until_step(cmd, env, step):
  """Starts a run and returns it once it reports ``step`` (stderr lines)."""
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  lines = []
  for line in proc.stderr:
    lines.append(line)
    if line.startswith(f"step {step}/"):
      return proc, lines
  proc.wait()
  raise AssertionError("the run ended before step "
                       f"{step}:\n{''.join(lines)[-3000:]}")


def test_sigterm_saves_the_last_completed_step_and_resumes_exactly(
    reference, data_dir, tmp_path):
  """A real SIGTERM mid-run: the step in flight finishes and is saved."""
  workdir = str(tmp_path / "preempted")
  # No periodic checkpoint before the end, a progress line after every step.
  cmd = _command(workdir, data_dir, "--config.checkpoint_every_steps=100",
                 "--config.log_every_steps=1")
  env = _env(4)
  proc, lines = _start_until_step(cmd, env, 2)
  proc.send_signal(signal.SIGTERM)
  _, rest = proc.communicate(timeout=300)
  lines += rest.splitlines(keepends=True)
  assert proc.returncode == 75, "".join(lines)[-3000:]
  done = [int(l.split()[1].split("/")[0]) for l in lines
          if l.startswith("step ")]
  saved = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"))
  saved_step = saved.latest_step()
  saved.close()
  assert saved_step == done[-1], "the saved step is the last completed one"
  assert 2 <= saved_step < STEPS, "preempted too late to test anything"
  message = [l for l in lines if l.startswith("Preempted")]
  assert message and f"last saved step is {saved_step}" in message[0]
  assert "exit status 75" in message[0]
  assert "Resume with" in "".join(lines)
  _run(cmd, env)
  chex.assert_trees_all_equal(_final(workdir), reference)


def test_one_run_per_workdir_and_a_killed_holder_is_taken_over(
    reference, data_dir, tmp_path):
  workdir = str(tmp_path / "locked")
  cmd, env = _command(workdir, data_dir, "--config.log_every_steps=1"), _env(4)
  first, _ = _start_until_step(cmd, env, 2)
  first.send_signal(signal.SIGSTOP)  # alive, holding the lock, not finishing
  try:
    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 1
    errors = [l for l in second.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and f"is in use by pid {first.pid}" in errors[0]
  finally:
    first.send_signal(signal.SIGKILL)  # kill -9: the lock file stays behind
    first.wait()
  assert os.path.exists(os.path.join(workdir, "run.lock"))
  third = _run(cmd, env)
  assert f"Took over the lock of a run that is gone (pid {first.pid}" in (
      third.stderr)
  assert not os.path.exists(os.path.join(workdir, "run.lock"))
  chex.assert_trees_all_equal(_final(workdir), reference)


def test_full_disk_is_one_line_naming_the_folder_and_cause(data_dir,
                                                           tmp_path):
  """The main job with its workdir on a real 400 KiB tmpfs (mounted in a
  private mount namespace; skipped where the machine does not allow it)."""
  import shutil
  if shutil.which("unshare") is None:
    pytest.skip("no unshare: cannot mount a small filesystem here")
  fs = tmp_path / "fs"
  fs.mkdir()
  workdir = str(fs / "run")
  run = " ".join(_command(workdir, data_dir, "--config.num_train_steps=40"))
  proc = subprocess.run(
      ["unshare", "-rm", "sh", "-c",
       f"mount -t tmpfs -o size=400k tmpfs {fs} || exit 97; {run}"],
      cwd=REPO, env=_env(4), capture_output=True, text=True, timeout=300)
  if proc.returncode == 97:
    pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
  assert proc.returncode == 1, proc.stderr[-3000:]
  errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1, proc.stderr[-3000:]
  assert f"{workdir}/checkpoints" in errors[0]
  assert "no space left on the device" in errors[0]
  # Not asserted: that nothing else is printed. orbax's logged tracebacks are
  # dropped (console), but when a write fails after its asyncio loop closed,
  # tensorstore's callback threads sometimes print "RuntimeError: Event loop
  # is closed" tracebacks themselves, past any Python hook (seen in 3 of 7
  # runs); the one error line above is still the job's message.


def test_sigterm_to_one_of_two_processes_stops_both_at_one_step(
    reference, data_dir, tmp_path):
  """A real SIGTERM to process 1 of a 2-process run (a preempted host): JAX's
  preemption service tells process 0, both save the same step, exit 75, and
  the same two commands resume to the parameters of an unbroken run."""
  workdir = str(tmp_path / "multi_preempted")
  port = portpicker.pick_unused_port()
  env = _env(2)
  cmds = [_command(workdir, data_dir, "--config.checkpoint_every_steps=100",
                   "--config.log_every_steps=1",
                   f"--coordinator_address=localhost:{port}",
                   "--num_processes=2", f"--process_id={pid}")
          for pid in range(2)]
  lines0 = []
  procs = [subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for c in cmds]
  for line in procs[0].stderr:  # process 0 reports the steps
    lines0.append(line)
    if line.startswith("step 2/"):
      break
  else:
    raise AssertionError("".join(lines0)[-3000:])
  procs[1].send_signal(signal.SIGTERM)
  _, rest0 = procs[0].communicate(timeout=300)
  _, err1 = procs[1].communicate(timeout=300)
  lines0 += rest0.splitlines(keepends=True)
  assert procs[0].returncode == 75, "".join(lines0)[-3000:]
  assert procs[1].returncode == 75, err1[-3000:]
  saved = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"))
  saved_step = saved.latest_step()
  saved.close()
  assert 2 <= saved_step < STEPS, "preempted too late to test anything"
  assert any(f"last saved step is {saved_step}" in l for l in lines0)
  # Resume: the same two commands.
  port = portpicker.pick_unused_port()
  cmds = [[a if not a.startswith("--coordinator_address=") else
           f"--coordinator_address=localhost:{port}" for a in c] for c in cmds]
  procs = [subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for c in cmds]
  for p in procs:
    _, err = p.communicate(timeout=400)
    assert p.returncode == 0, err[-4000:]
  # As in test_two_processes_match_one_process: gloo's sums round
  # differently from the 4-device reference's, nothing more.
  chex.assert_trees_all_close(_final(workdir), reference, rtol=1e-3,
                              atol=2e-4)
