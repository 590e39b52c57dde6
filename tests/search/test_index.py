"""The gallery index: contents, model records, atomic save, bad files."""

import os
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from circle_jax.search import index as index_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def _record(**kw):
  base = dict(run="/runs/a", step=10, checkpoint="best", embedding_dim=3,
              fingerprint="f" * 64)
  return index_lib.ModelRecord(**{**base, **kw})


def _index(n=5, labels=True):
  rng = np.random.default_rng(n)
  return index_lib.GalleryIndex.from_arrays(
      rng.normal(size=(n, 3)), ids=[f"item{i}" for i in range(n)],
      labels=[f"c{i % 2}" for i in range(n)] if labels else None,
      metadata=[{"path": f"/img/{i}.png", "shelf": i} for i in range(n)],
      model=_record())


def test_save_load_round_trip(tmp_path):
  index = _index()
  index.cutpoints = {"best_f1": {"threshold": 0.5, "precision": 1.0,
                                 "recall": 0.5, "f1": 0.66, "accuracy": 0.7}}
  path = index.save(str(tmp_path / "g.npz"))
  back = index_lib.load(path)
  np.testing.assert_array_equal(back.embeddings, index.embeddings)
  assert back.ids == index.ids and back.metadata == index.metadata
  assert back.labels.tolist() == index.labels.tolist()
  assert back.model == index.model and back.cutpoints == index.cutpoints
  np.testing.assert_allclose(np.linalg.norm(back.embeddings, axis=1), 1,
                             rtol=1e-6)
  # No pickle inside: numpy reads every member with allow_pickle=False.
  with np.load(path, allow_pickle=False) as z:
    assert set(z.files) == {"header", "embeddings", "ids", "labels"}


def test_add_and_remove():
  index = _index(4)
  index.add(np.ones((2, 3)), ids=["x", "y"], labels=["c9", "c9"])
  assert len(index) == 6 and index.labels[-1] == "c9"
  assert index.remove(["item1", "x"]) == 2
  assert index.ids == ["item0", "item2", "item3", "y"]
  assert index.labels.tolist() == ["c0", "c0", "c1", "c9"]
  assert [m.get("shelf") for m in index.metadata] == [0, 2, 3, None]
  with pytest.raises(index_lib.IndexContentError, match="already in"):
    index.add(np.ones((1, 3)), ids=["y"], labels=["c"])
  with pytest.raises(index_lib.IndexContentError, match="every item or"):
    index.add(np.ones((1, 3)), ids=["z"])
  with pytest.raises(index_lib.IndexContentError, match="not in the index"):
    index.remove(["nope"])
  with pytest.raises(index_lib.IndexContentError, match="4-d|3-d"):
    index.add(np.ones((1, 4)), ids=["w"], labels=["c"])


def test_another_models_queries_are_refused_in_one_line():
  index = _index()
  index.check_model(_record(), 3)          # the same model
  index.check_model(None, 3)               # unknown: only the size
  for other, why in [(_record(fingerprint="0" * 64), "other weights"),
                     (_record(embedding_dim=4), "4-d"),
                     (_record(fingerprint=None, step=11), "another run")]:
    with pytest.raises(index_lib.ModelMismatchError) as e:
      index.check_model(other, other.embedding_dim)
    assert why in str(e.value) and "\n" not in str(e.value)
  with pytest.raises(index_lib.ModelMismatchError, match="8-d embeddings"):
    index.check_model(None, 8)


def test_a_fault_between_write_and_rename_keeps_the_old_index(
    tmp_path, monkeypatch):
  path = str(tmp_path / "g.npz")
  old = _index(3)
  old.save(path)

  def fail(src, dst):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(index_lib, "_replace", fail)
  with pytest.raises(OSError):
    _index(7).save(path)
  assert os.listdir(tmp_path) == ["g.npz"]          # temporary file removed
  assert index_lib.load(path).ids == old.ids


_SAVER = """
import sys, numpy as np
from circle_jax.search import index as index_lib
big = index_lib.GalleryIndex.from_arrays(
    np.random.default_rng(0).normal(size=(400_000, 64)).astype("float32"))
print("ready", flush=True)
while True:
  big.save(sys.argv[1])
"""


def test_stale_temporary_files_of_a_killed_save_are_removed(tmp_path):
  path = str(tmp_path / "g.npz")
  dead = 2**31 - 1  # above any pid_max: no such process
  stale = f".g.npz.{dead}.ab_c1234.tmp"
  kept = [f".g.npz.{os.getpid()}.ab_c1234.tmp",   # a live save
          f".g.npz.7.{dead}.ab_c1234.tmp",        # another file's (g.npz.7)
          f".h.npz.{dead}.ab_c1234.tmp", f".g.npz.{dead}.ab.tmp.x", "g.txt"]
  for name in [stale] + kept:
    (tmp_path / name).write_text("partial")
  _index(3).save(path)
  assert sorted(os.listdir(tmp_path)) == sorted(kept + ["g.npz"])
  (tmp_path / stale).write_text("partial")
  index_lib.load(path)
  assert sorted(os.listdir(tmp_path)) == sorted(kept + ["g.npz"])


@pytest.mark.slow
def test_killing_a_save_midway_leaves_the_previous_index(tmp_path):
  """A real kill -9 of a process while it writes its temporary file; the
  next load removes that file."""
  path = str(tmp_path / "g.npz")
  _index(3).save(path)
  proc = subprocess.Popen(
      [sys.executable, "-c", _SAVER, path], stdout=subprocess.PIPE,
      env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"), text=True)
  try:
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.time() + 60
    while time.time() < deadline:
      tmp = [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
      if tmp and os.path.getsize(tmp_path / tmp[0]) > 0:
        break
      time.sleep(0.005)
    else:
      pytest.fail("the save never started")
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
  back = index_lib.load(path)
  assert os.listdir(tmp_path) == ["g.npz"]  # the killed save's file removed
  assert len(back) in (3, 400_000)  # the old index, or a whole new one
  if len(back) == 3:
    assert back.ids == ["item0", "item1", "item2"]


def test_damaged_and_foreign_files_are_one_line_naming_them(tmp_path):
  path = tmp_path / "g.npz"
  _index().save(str(path))
  data = path.read_bytes()
  cases = {"truncated.npz": data[: len(data) // 2],
           "noise.npz": b"not a zip at all",
           "empty.npz": b""}
  for name, content in cases.items():
    (tmp_path / name).write_bytes(content)
  np.savez(tmp_path / "embed.npz", embeddings=np.zeros((2, 3)))
  with zipfile.ZipFile(tmp_path / "other.npz", "w") as z:
    z.writestr("header.npy", b"garbage")
  for name in list(cases) + ["embed.npz", "other.npz", "missing.npz"]:
    with pytest.raises(index_lib.IndexFileError) as e:
      index_lib.load(str(tmp_path / name))
    message = str(e.value)
    assert name in message and "\n" not in message, message
