"""Metric writers: the console (absl logging) and TensorBoard event files.

The writers follow ``clu.metric_writers``' interface (``write_scalars(step,
dict)``, ``write_hparams``, ``flush``, ``close``). They are not clu's own:
clu 0.0.12's ``clu.metric_writers`` imports TensorFlow when it is imported
(even for its ``LoggingWriter``), and this project does not depend on
TensorFlow. TensorBoard event files are written by tensorboardX (pure Python
on protobuf): one ``Event`` per ``write_scalars`` call, a ``simple_value``
per tag. Only scalars are written, which is what the trainer logs.
TensorBoard, if installed elsewhere, reads the directory.
"""

from __future__ import annotations

import struct
from typing import Any, List, Mapping, Optional, Tuple

from absl import logging


def _scalar_values(scalars: Mapping[str, Any]) -> Mapping[str, float]:
  """The entries of ``scalars`` that convert to ``float`` (others skipped)."""
  values = {}
  for k, v in scalars.items():
    try:
      values[k] = float(v)
    except (TypeError, ValueError):
      continue
  return values


class EventFileWriter:
  """Writes scalars to ``logdir/events.out.tfevents.<time>.<host>``."""

  def __init__(self, logdir: str):
    # Imported here: importing tensorboardX imports torch where torch is
    # installed (the test environment), about a second that only a process
    # that writes event files should pay.
    import tensorboardX  # pylint: disable=g-import-not-at-top
    from tensorboardX.proto import summary_pb2  # pylint: disable=g-import-not-at-top
    self._summary_pb2 = summary_pb2
    self._writer = tensorboardX.FileWriter(logdir)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    values = _scalar_values(scalars)
    if values:
      summary = self._summary_pb2.Summary(value=[
          self._summary_pb2.Summary.Value(tag=str(k), simple_value=v)
          for k, v in values.items()])
      self._writer.add_summary(summary, global_step=int(step))

  def write_hparams(self, hparams):
    logging.info("hparams: %s", dict(hparams))

  def flush(self):
    self._writer.flush()

  def close(self):
    self._writer.close()


def read_events(path: str) -> list:
  """Every ``Event`` protocol buffer of an event file, in order.

  Reads the TFRecord framing (8-byte length, masked CRC-32C of the length,
  the record, masked CRC-32C of the record), checks both checksums with
  tensorboardX's CRC and parses each record as tensorboardX's ``Event``.

  Raises:
    ValueError: a checksum does not match (a corrupt or truncated file).
  """
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  from tensorboardX.record_writer import masked_crc32c  # pylint: disable=g-import-not-at-top
  with open(path, "rb") as f:
    data = f.read()
  events, pos = [], 0
  while pos < len(data):
    header = data[pos:pos + 8]
    end = pos + 12 + (struct.unpack("<Q", header)[0] if len(header) == 8
                      else 0)
    payload = data[pos + 12:end]
    if end + 4 > len(data) or struct.unpack(
        "<II", data[pos + 8:pos + 12] + data[end:end + 4]) != (
            masked_crc32c(header), masked_crc32c(payload)):
      raise ValueError(f"Corrupt or truncated record at byte {pos} of {path}.")
    events.append(event_pb2.Event.FromString(payload))
    pos = end + 4
  return events


def read_scalars(path: str) -> List[Tuple[int, str, float]]:
  """``(step, tag, value)`` of every scalar of an event file, in order."""
  return [(e.step, v.tag, v.simple_value)
          for e in read_events(path) for v in e.summary.value]


class ConsoleWriter:
  """Logs scalars with absl (like clu's LoggingWriter)."""

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    items = ", ".join(f"{k} = {_fmt(v)}" for k, v in sorted(scalars.items()))
    logging.info("[%d] %s", step, items)

  def write_hparams(self, hparams):
    logging.info("hparams: %s", dict(hparams))

  def flush(self):
    pass

  def close(self):
    pass


def _fmt(v):
  try:
    return f"{float(v):.6g}"
  except (TypeError, ValueError):
    return str(v)


class MultiWriter:
  """Forwards every call to several writers."""

  def __init__(self, writers):
    self.writers = list(writers)

  def write_scalars(self, step, scalars):
    for w in self.writers:
      w.write_scalars(step, scalars)

  def write_hparams(self, hparams):
    for w in self.writers:
      w.write_hparams(hparams)

  def flush(self):
    for w in self.writers:
      w.flush()

  def close(self):
    for w in self.writers:
      w.close()


def create_writer(logdir: Optional[str], *, is_primary: bool) -> MultiWriter:
  """Console + TensorBoard on process 0; console only elsewhere."""
  writers = [ConsoleWriter()]
  if is_primary and logdir:
    writers.append(EventFileWriter(logdir))
  return MultiWriter(writers)
