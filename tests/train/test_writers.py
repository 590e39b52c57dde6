"""TensorBoard event files written through tensorboardX, read back."""

import os

import numpy as np
import pytest

from circle_jax.train import writers


def _event_file(logdir):
  (name,) = os.listdir(logdir)
  assert name.startswith("events.out.tfevents."), name
  return os.path.join(logdir, name)


def _write(logdir, is_primary=True):
  w = writers.create_writer(logdir, is_primary=is_primary)
  w.write_scalars(0, {"eval/recall@1": 0.41, "eval/map@r": np.float32(0.14)})
  w.write_scalars(10, {"train/loss": 2.5, "train/note": "not a number"})
  w.flush()
  w.write_scalars(20, {"train/loss": np.float64(1.25), "train/lr": 1e-4})
  w.close()


def test_scalars_read_back_with_their_steps_tags_and_values(tmp_path):
  logdir = str(tmp_path / "tb")
  _write(logdir)
  path = _event_file(logdir)
  assert writers.read_scalars(path) == [
      (0, "eval/recall@1", np.float32(0.41)),
      (0, "eval/map@r", np.float32(0.14)),
      (10, "train/loss", 2.5),                  # the string is skipped
      (20, "train/loss", 1.25),
      (20, "train/lr", np.float32(1e-4)),
  ]
  events = writers.read_events(path)
  # TensorBoard recognises the file by its first event's version string.
  assert events[0].file_version == "brain.Event:2"
  assert [e.step for e in events[1:]] == [0, 10, 20]
  assert all(e.wall_time > 1e9 for e in events)


def test_only_the_primary_process_writes_event_files(tmp_path):
  logdir = tmp_path / "tb"
  _write(str(logdir), is_primary=False)
  assert not logdir.exists()
  _write(None, is_primary=True)        # no logdir: console only
  assert os.listdir(tmp_path) == []


def test_a_corrupt_or_truncated_file_is_an_error(tmp_path):
  logdir = str(tmp_path / "tb")
  _write(logdir)
  path = _event_file(logdir)
  with open(path, "rb") as f:
    data = f.read()
  last = len(data) - 10
  corrupt = data[:last] + bytes([data[last] ^ 1]) + data[last + 1:]
  for bad in (corrupt, data[:-3], data[:-len(data) // 2]):
    with open(path, "wb") as f:
      f.write(bad)
    with pytest.raises(ValueError, match="Corrupt or truncated record"):
      writers.read_scalars(path)
