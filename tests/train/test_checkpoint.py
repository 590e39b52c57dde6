"""Tests of circle_jax/train/checkpoint.py: the orbax checkpoints of a run.

Round trips of the ``latest`` and ``best`` checkpoints, then real faults:
corrupt checkpoints fall back to an older step; failed writes are one line.
The corruption tests damage real orbax checkpoint files. The write-failure
tests run on a real 1 MiB tmpfs (and a read-only remount of it) mounted in a
private mount namespace (``unshare -rm``), where the machine allows it; where
it does not, they are skipped and the fault-injection test below still checks
the message.
"""

import errno
import glob
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from circle_jax.train import checkpoint as ckpt_lib


def _tree(step, n=20000):
  return {"params": {"w": np.arange(n, dtype=np.float32) + step},
          "step": np.int32(step)}


def _saved(tmp_path, steps=(20, 40)):
  ck = ckpt_lib.Checkpoints(str(tmp_path / "checkpoints"))
  for s in steps:
    ck.save_latest(s, _tree(s), {"pos": s}, {"note": "x"})
  ck.wait()
  ck.close()
  return str(tmp_path / "checkpoints")


def _state_files(directory, step):
  files = glob.glob(f"{directory}/latest/{step}/state/**", recursive=True)
  return sorted((f for f in files if os.path.isfile(f)),
                key=os.path.getsize, reverse=True)


def _damage(directory, step, how):
  if how == "truncate":
    with open(_state_files(directory, step)[0], "r+b") as f:
      f.truncate(50)
  elif how == "overwrite":  # 100 bytes inside the largest state file
    path = _state_files(directory, step)[0]
    with open(path, "r+b") as f:
      f.seek(os.path.getsize(path) // 2)
      f.write(b"\x5a" * 100)
  elif how == "missing_item":
    shutil.rmtree(f"{directory}/latest/{step}/data")
  else:
    raise ValueError(how)


@pytest.mark.parametrize("how", ["truncate", "overwrite", "missing_item"])
def test_newest_unreadable_step_falls_back_and_is_moved_aside(tmp_path, how):
  directory = _saved(tmp_path)
  _damage(directory, 40, how)
  ck = ckpt_lib.Checkpoints(directory)
  tree, data, meta, step, notes = ck.restore_newest(_tree(0))
  assert step == 20 and int(tree["step"]) == 20 and data == {"pos": 20}
  np.testing.assert_array_equal(tree["params"]["w"], _tree(20)["params"]["w"])
  assert len(notes) == 1 and "step 40 is unreadable" in notes[0]
  # Moved aside, never deleted; the manager no longer lists it.
  moved = glob.glob(f"{directory}/unreadable/latest-40-*")
  assert len(moved) == 1 and os.path.isdir(moved[0])
  assert ck.latest.all_steps() == [20]
  # Training goes on: the next save works.
  ck.save_latest(60, _tree(60))
  ck.wait()
  assert sorted(ck.latest.all_steps()) == [20, 60]
  ck.close()


def test_an_unreadable_best_step_is_moved_aside_with_a_note(tmp_path):
  directory = str(tmp_path / "checkpoints")
  ck = ckpt_lib.Checkpoints(directory, best_metric="recall@1")
  for s, r in ((20, 0.9), (40, 0.5)):
    ck.save_best(s, _tree(s), {"pos": s}, {"recall@1": r})
  ck.wait()
  assert ck.best_step() == 20
  files = glob.glob(f"{directory}/best/20/state/**", recursive=True)
  largest = max((f for f in files if os.path.isfile(f)), key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.truncate(50)
  with pytest.raises(Exception):
    ck.restore(_tree(0), which="best")
  note = ck.move_best_aside("truncated")
  assert "best checkpoint (step 20) is unreadable (truncated)" in note
  assert "\n" not in note
  moved = glob.glob(f"{directory}/unreadable/best-20-*")
  assert len(moved) == 1 and os.path.isdir(moved[0])
  assert ck.best_step() is None and ck.best.all_steps() == []
  ck.close()


def test_overwritten_bytes_are_caught_by_the_checksum(tmp_path):
  directory = _saved(tmp_path, steps=(40,))
  _damage(directory, 40, "overwrite")
  ck = ckpt_lib.Checkpoints(directory)
  with pytest.raises(Exception) as e:
    ck.restore(_tree(0), step=40)
  # Either the storage layer or our checksum notices; never silent.
  assert "40" in str(e.value) or isinstance(
      e.value, (ValueError, ckpt_lib.CorruptCheckpointError))
  ck.close()


def test_no_readable_step_is_one_line_and_moves_nothing(tmp_path):
  directory = _saved(tmp_path, steps=(40,))
  _damage(directory, 40, "truncate")
  ck = ckpt_lib.Checkpoints(directory)
  with pytest.raises(ckpt_lib.CorruptCheckpointError) as e:
    ck.restore_newest(_tree(0))
  msg = str(e.value)
  assert "\n" not in msg
  assert os.path.join(directory, "latest") in msg and "another --workdir" in msg
  assert os.path.isdir(f"{directory}/latest/40")
  assert not os.path.exists(f"{directory}/unreadable")
  ck.close()


def test_a_template_that_does_not_fit_is_not_corruption(tmp_path):
  directory = _saved(tmp_path)
  ck = ckpt_lib.Checkpoints(directory)

  def check(tree, step):
    raise RuntimeError(f"does not fit at {step}")

  with pytest.raises(RuntimeError, match="does not fit at 40"):
    ck.restore_newest(_tree(0), check=check)
  assert sorted(ck.latest.all_steps()) == [20, 40]
  ck.close()


def test_digest_sees_every_byte_dtype_and_shape():
  a = _tree(1)
  assert ckpt_lib.state_digest(a) == ckpt_lib.state_digest(_tree(1))
  b = _tree(1)
  b["params"]["w"][7] += 1
  assert ckpt_lib.state_digest(a) != ckpt_lib.state_digest(b)
  c = _tree(1)
  c["params"]["w"] = c["params"]["w"].reshape(2, -1)
  assert ckpt_lib.state_digest(a) != ckpt_lib.state_digest(c)


def test_latest_round_trip_keeps_state_data_and_meta(tmp_path):
  ck = ckpt_lib.Checkpoints(str(tmp_path / "checkpoints"),
                            asynchronous=False)
  tree = _tree(7, n=10)
  assert ck.latest_step() is None and ck.restore_newest(tree) is None
  with pytest.raises(FileNotFoundError, match="No latest checkpoint"):
    ck.restore(tree)
  assert ck.save_latest(7, tree, {"pos": np.int64(3)},
                        {"lr": np.float32(0.5), "ks": (1, 2)})
  assert not ck.save_latest(7, _tree(8, n=10))  # a saved step is kept as is
  ck.wait()
  got, data, meta = ck.restore(_tree(0, n=10))
  np.testing.assert_array_equal(got["params"]["w"], tree["params"]["w"])
  assert got["params"]["w"].dtype == np.float32 and int(got["step"]) == 7
  # numpy scalars and tuples are stored as JSON numbers and lists.
  assert data == {"pos": 3}
  assert meta == {"lr": 0.5, "ks": [1, 2], "step": 7,
                  "state_crc32": ckpt_lib.state_digest(tree)}
  # Without a template the saved tree comes back as it was written.
  bare, _, _ = ck.restore()
  np.testing.assert_array_equal(bare["params"]["w"], tree["params"]["w"])
  ck.close()


def test_max_to_keep_drops_the_oldest_latest_steps(tmp_path):
  ck = ckpt_lib.Checkpoints(str(tmp_path / "checkpoints"), max_to_keep=2,
                            asynchronous=False)
  for s in (1, 2, 3):
    ck.save_latest(s, _tree(s, n=4))
  ck.wait()
  assert sorted(ck.latest.all_steps()) == [2, 3] and ck.latest_step() == 3
  tree, _, meta = ck.restore(_tree(0, n=4), step=2)
  assert int(tree["step"]) == 2 and meta["step"] == 2
  ck.close()


@pytest.mark.parametrize("mode, want", [("max", 20), ("min", 40)])
def test_best_keeps_the_best_evaluation_by_its_mode(tmp_path, mode, want):
  ck = ckpt_lib.Checkpoints(str(tmp_path / "checkpoints"),
                            best_metric="recall@1", best_mode=mode)
  for s, r in ((20, 0.9), (40, 0.5), (60, 0.7)):
    ck.save_best(s, _tree(s, n=4), {"pos": s},
                 {"recall@1": np.float32(r), "note": "text is kept"})
  assert ck.best_step() == want
  best = ck.best_metrics()
  assert best["step"] == want and best["metrics"]["note"] == "text is kept"
  assert best["metrics"]["recall@1"] == pytest.approx(
      {20: 0.9, 40: 0.5}[want])
  tree, data, _ = ck.restore(_tree(0, n=4), which="best")
  assert int(tree["step"]) == want and data == {"pos": want}
  # The latest checkpoints are another folder: none was written.
  assert ck.latest_step() is None
  ck.close()


def test_a_run_without_best_metric_keeps_no_best(tmp_path):
  ck = ckpt_lib.Checkpoints(str(tmp_path / "checkpoints"))
  assert ck.best is None and ck.best_step() is None
  assert ck.best_metrics() is None
  assert not ck.save_best(5, _tree(5, n=4), None, {"recall@1": 1.0})
  with pytest.raises(ValueError, match="no `best` checkpoints"):
    ck.restore(which="best")
  ck.close()
  assert not os.path.exists(tmp_path / "checkpoints" / "best")


def test_bad_best_mode_is_refused():
  with pytest.raises(ValueError, match="'max' or 'min'; got 'up'"):
    ckpt_lib.Checkpoints("/nonexistent/checkpoints", best_metric="x",
                         best_mode="up")


def test_errno_of_follows_the_cause_and_context_chain():
  assert ckpt_lib.errno_of(ValueError("no errno")) is None
  try:
    try:
      raise OSError(errno.EROFS, "Read-only file system")
    except OSError as inner:
      raise RuntimeError("wrapped") from inner
  except RuntimeError as e:
    assert ckpt_lib.errno_of(e) == errno.EROFS
  try:
    try:
      raise OSError(errno.ENOSPC, "full")
    except OSError:
      raise KeyError("raised while handling")  # __context__, not __cause__
  except KeyError as e:
    assert ckpt_lib.errno_of(e) == errno.ENOSPC


@pytest.mark.parametrize("error, want", [
    (OSError(errno.EROFS, "x"), "the folder is read-only"),
    (OSError(errno.EACCES, "x"), "the folder is read-only"),
    (RuntimeError("Permission denied: /a"), "the folder is read-only"),
    (OSError(errno.ENOSPC, "x"), "no space left on the device ("),
    (RuntimeError("RESOURCE_EXHAUSTED: disk"), "no space left on the device"),
    (RuntimeError("tensorstore failed\nsecond line"),
     "RuntimeError: tensorstore failed"),
])
def test_write_failure_names_the_cause(tmp_path, error, want):
  got = ckpt_lib.write_failure(str(tmp_path / "not" / "yet"), error)
  assert got.startswith(want) and "\n" not in got


def test_error_line_is_the_first_line_or_the_type():
  assert ckpt_lib.error_line(ValueError("first\nsecond")) == "first"
  assert ckpt_lib.error_line(ValueError("x" * 300)) == "x" * 160
  assert ckpt_lib.error_line(KeyError()) == "KeyError"


# ----------------------------------------------------------------------------
# Write failures.
# ----------------------------------------------------------------------------

_ON_SMALL_FS = textwrap.dedent("""
    import os, subprocess, sys
    import numpy as np
    from circle_jax.train import checkpoint as C
    root, mode = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(0)  # incompressible state
    tree = lambda s, n: {"w": rng.standard_normal(n, np.float32),
                         "step": np.int32(s)}
    ck = C.Checkpoints(os.path.join(root, "checkpoints"))
    ck.save_latest(1, tree(1, 1000))
    ck.wait()
    if mode == "readonly":
      subprocess.run(["mount", "-o", "remount,ro", root], check=True)
      n = 1000
    else:
      n = 2_000_000  # 8 MB of state on a 1 MiB filesystem
    try:
      ck.save_latest(2, tree(2, n))
      ck.wait()
    except C.CheckpointWriteError as e:
      print("ERROR:" + str(e))
    print("STEPS:" + ",".join(map(str, ck.latest.all_steps())), flush=True)
    # After a failed write on a read-only filesystem the interpreter's exit
    # can wait forever on orbax/tensorstore threads: leave at once.
    os._exit(0)
""")


def _run_on_tmpfs(tmp_path, mode):
  root = tmp_path / "fs"
  root.mkdir()
  if shutil.which("unshare") is None:
    pytest.skip("no unshare: cannot mount a small filesystem here")
  script = tmp_path / "write.py"
  script.write_text(_ON_SMALL_FS)
  cmd = (f"mount -t tmpfs -o size=1m tmpfs {root} && "
         f"{sys.executable} {script} {root} {mode}")
  proc = subprocess.run(["unshare", "-rm", "sh", "-c", cmd],
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  if "mount:" in proc.stderr and "STEPS:" not in proc.stdout:
    pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
  return proc


@pytest.mark.parametrize("mode", ["full", "readonly"])
def test_full_or_readonly_disk_is_one_line_and_keeps_earlier_steps(tmp_path,
                                                                    mode):
  proc = _run_on_tmpfs(tmp_path, mode)
  lines = proc.stdout.splitlines()
  errors = [l for l in lines if l.startswith("ERROR:")]
  assert len(errors) == 1, proc.stdout + proc.stderr
  msg = errors[0]
  assert "checkpoints" in msg and "step 1" in msg and "step 2" in msg
  want = "no space left" if mode == "full" else "read-only"
  assert want in msg, msg
  # The earlier checkpoint is intact and still listed.
  assert "STEPS:1" in lines


def test_write_error_names_folder_and_cause_with_injected_fault(tmp_path,
                                                               monkeypatch):
  # The fallback where no filesystem can be mounted: orbax's save raises
  # ENOSPC as a real full disk makes the OS do.
  ck = ckpt_lib.Checkpoints(str(tmp_path / "checkpoints"))
  ck.save_latest(1, _tree(1))
  ck.wait()

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(ck.latest, "save", full)
  with pytest.raises(ckpt_lib.CheckpointWriteError) as e:
    ck.save_latest(2, _tree(2))
  msg = str(e.value)
  assert "\n" not in msg and "no space left" in msg
  assert "step 1" in msg and str(tmp_path) in msg
  ck.close()


def test_digest_ignores_the_integer_width_a_restore_may_cast_to():
  a = _tree(3)
  b = dict(_tree(3), step=np.int64(3))
  assert ckpt_lib.state_digest(a) == ckpt_lib.state_digest(b)
  c = dict(_tree(3), step=np.int64(4))
  assert ckpt_lib.state_digest(a) != ckpt_lib.state_digest(c)
