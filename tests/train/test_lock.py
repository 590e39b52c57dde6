"""One run per workdir: live holders refuse, dead holders are taken over."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from circle_jax.train import lock as lock_lib

_HOLDER = textwrap.dedent("""
    import sys, time
    from circle_jax.train import lock
    l = lock.WorkdirLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(120)
""")


def _start_holder(workdir):
  """A real process that takes the lock and sleeps; returns it once it holds."""
  proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(workdir)],
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "held"
  return proc


@pytest.fixture
def live_holder(tmp_path):
  """A live process holding ``tmp_path``'s lock for the whole test."""
  proc = _start_holder(tmp_path)
  yield proc
  proc.kill()
  proc.wait()


def _lock_pid(workdir):
  with open(workdir / lock_lib.LOCK_FILE) as f:
    return json.load(f)["pid"]


def test_lock_file_records_pid_host_and_start(tmp_path):
  with lock_lib.WorkdirLock(str(tmp_path)) as lock:
    with open(lock.path) as f:
      data = json.load(f)
    assert data["pid"] == os.getpid()
    assert data["host"] == socket.gethostname()
    assert data["started"][:4].isdigit()
    assert lock.note is None
  assert not os.path.exists(lock.path), "release removes the lock file"


def test_live_holder_refuses_in_one_line_naming_it(tmp_path, live_holder):
  with pytest.raises(lock_lib.WorkdirLockedError) as e:
    lock_lib.WorkdirLock(str(tmp_path)).acquire()
  msg = str(e.value)
  assert "\n" not in msg
  assert f"pid {live_holder.pid}" in msg
  assert socket.gethostname() in msg
  assert "another --workdir" in msg
  # The refusal leaves the holder's lock in place.
  assert _lock_pid(tmp_path) == live_holder.pid


def test_dead_holder_is_taken_over_with_a_note(tmp_path):
  proc = _start_holder(tmp_path)
  os.kill(proc.pid, signal.SIGKILL)  # kill -9: the holder cannot clean up
  proc.wait()
  assert (tmp_path / lock_lib.LOCK_FILE).exists()
  lock = lock_lib.WorkdirLock(str(tmp_path)).acquire()
  try:
    assert lock.note is not None and f"pid {proc.pid}" in lock.note
    with open(lock.path) as f:
      assert json.load(f)["pid"] == os.getpid()
  finally:
    lock.release()


def test_recycled_pid_is_not_the_holder(tmp_path):
  # Our own (live) pid with another process start time: a reused pid.
  me = lock_lib._proc_start_ticks(os.getpid())
  if me is None:
    pytest.skip("no /proc on this machine")
  holder = {"pid": os.getpid(), "pid_start": me + 1,
            "host": socket.gethostname(), "started": "earlier"}
  (tmp_path / lock_lib.LOCK_FILE).write_text(json.dumps(holder))
  with lock_lib.WorkdirLock(str(tmp_path)) as lock:
    assert lock.note is not None


def test_other_host_is_never_taken_over(tmp_path):
  holder = {"pid": 1, "host": "some-other-host", "started": "then"}
  (tmp_path / lock_lib.LOCK_FILE).write_text(json.dumps(holder))
  with pytest.raises(lock_lib.WorkdirLockedError, match="another host.*"
                     "delete the lock file"):
    lock_lib.WorkdirLock(str(tmp_path)).acquire()


def test_unreadable_lock_is_taken_over(tmp_path):
  (tmp_path / lock_lib.LOCK_FILE).write_text("{half-writ")
  with lock_lib.WorkdirLock(str(tmp_path)) as lock:
    assert "unreadable" in lock.note


def test_non_primary_process_writes_no_lock(tmp_path, live_holder):
  # Process 1 of a multi-host run neither checks nor writes the lock.
  with lock_lib.WorkdirLock(str(tmp_path), is_primary=False) as lock:
    assert lock.note is None
  assert _lock_pid(tmp_path) == live_holder.pid


def test_release_keeps_a_lock_another_run_took(tmp_path):
  lock = lock_lib.WorkdirLock(str(tmp_path)).acquire()
  other = {"pid": os.getpid() + 1, "host": "h", "started": "t"}
  (tmp_path / lock_lib.LOCK_FILE).write_text(json.dumps(other))
  lock.release()
  assert json.loads((tmp_path / lock_lib.LOCK_FILE).read_text()) == other


def test_a_second_lock_in_the_same_process_refuses(tmp_path):
  start = time.time()
  with lock_lib.WorkdirLock(str(tmp_path)):
    with pytest.raises(lock_lib.WorkdirLockedError, match="is in use by"):
      lock_lib.WorkdirLock(str(tmp_path)).acquire()
  assert time.time() - start < 30
