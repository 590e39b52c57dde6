"""Metric writers: console and TensorBoard event files, without TensorFlow.

The writers follow ``clu.metric_writers``' interface (``write_scalars(step,
dict)``, ``write_hparams``, ``flush``, ``close``), but clu 0.0.12's
``clu.metric_writers`` package imports TensorFlow when it is imported (even
for its LoggingWriter), and this project does not depend on TensorFlow. So
:class:`EventFileWriter` writes TensorBoard's format directly: a TFRecord file of ``Event``
protocol buffers (``wall_time``, ``step``, ``Summary{Value{tag,
simple_value}}``) with masked CRC-32C checksums. Only scalars are written
(images, histograms and hparams are ignored with a log line), which is what
the trainer logs. TensorBoard, if installed elsewhere, reads the directory.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any, Mapping, Optional

from absl import logging

# ---------------------------------------------------------------------------
# CRC-32C (Castagnoli), table driven, and TFRecord's masking.
# ---------------------------------------------------------------------------

_POLY = 0x82F63B78
_TABLE = []
for _i in range(256):
  _c = _i
  for _ in range(8):
    _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
  _TABLE.append(_c)


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for b in data:
    crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
  """One TFRecord: length, its masked CRC, the data and its masked CRC."""
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", masked_crc32c(length)) + data
          + struct.pack("<I", masked_crc32c(data)))


# ---------------------------------------------------------------------------
# Protocol-buffer encoding of the few Event fields used.
# ---------------------------------------------------------------------------


def _varint(n: int) -> bytes:
  out = bytearray()
  n &= (1 << 64) - 1
  while True:
    b = n & 0x7F
    n >>= 7
    if n:
      out.append(b | 0x80)
    else:
      out.append(b)
      return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
  return _varint((number << 3) | 2) + _varint(len(payload)) + payload


def scalar_event(step: int, values: Mapping[str, float],
                 wall_time: Optional[float] = None) -> bytes:
  """``Event{wall_time=1, step=2, summary=5{value=1{tag=1, simple_value=2}}}``."""
  summary = b"".join(
      _field_bytes(1, _field_bytes(1, str(tag).encode("utf-8"))
                   + b"\x15" + struct.pack("<f", float(value)))
      for tag, value in values.items())
  wall_time = time.time() if wall_time is None else wall_time
  return (b"\x09" + struct.pack("<d", wall_time)
          + b"\x10" + _varint(int(step)) + _field_bytes(5, summary))


def version_event() -> bytes:
  return (b"\x09" + struct.pack("<d", time.time())
          + _field_bytes(3, b"brain.Event:2"))


class EventFileWriter:
  """Writes scalars to ``logdir/events.out.tfevents.<time>.<host>``."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
    self.path = os.path.join(logdir, name)
    self._f = open(self.path, "ab")
    self._f.write(tfrecord(version_event()))

  def write_scalars(self, step: int, scalars: Mapping[str, Any]):
    values = {}
    for k, v in scalars.items():
      try:
        values[k] = float(v)
      except (TypeError, ValueError):
        continue
    if values:
      self._f.write(tfrecord(scalar_event(step, values)))

  def write_hparams(self, hparams):
    logging.info("hparams: %s", dict(hparams))

  def flush(self):
    self._f.flush()

  def close(self):
    if not self._f.closed:
      self._f.close()


def read_scalars(path: str) -> list:
  """Reads back ``(step, tag, value)`` from an event file (checks the CRCs)."""
  out = []
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos < len(data):
    (length,) = struct.unpack_from("<Q", data, pos)
    (crc_len,) = struct.unpack_from("<I", data, pos + 8)
    if crc_len != masked_crc32c(data[pos:pos + 8]):
      raise ValueError(f"Corrupt record length at byte {pos} of {path}.")
    payload = data[pos + 12:pos + 12 + length]
    (crc,) = struct.unpack_from("<I", data, pos + 12 + length)
    if crc != masked_crc32c(payload):
      raise ValueError(f"Corrupt record at byte {pos} of {path}.")
    pos += 16 + length
    out.extend(_parse_event(payload))
  return out


def _read_varint(buf, i):
  shift = result = 0
  while True:
    b = buf[i]
    i += 1
    result |= (b & 0x7F) << shift
    shift += 7
    if not b & 0x80:
      return result, i


def _fields(buf):
  i = 0
  while i < len(buf):
    key, i = _read_varint(buf, i)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _read_varint(buf, i)
    elif wire == 1:
      value, i = buf[i:i + 8], i + 8
    elif wire == 5:
      value, i = buf[i:i + 4], i + 4
    elif wire == 2:
      n, i = _read_varint(buf, i)
      value, i = buf[i:i + n], i + n
    else:
      raise ValueError(f"Unsupported wire type {wire}.")
    yield number, value


def _parse_event(buf):
  step, out = 0, []
  summaries = []
  for number, value in _fields(buf):
    if number == 2:
      step = value
    elif number == 5:
      summaries.append(value)
  for summary in summaries:
    for number, value in _fields(summary):
      if number != 1:
        continue
      tag, simple = None, None
      for n, v in _fields(value):
        if n == 1:
          tag = bytes(v).decode("utf-8")
        elif n == 2:
          (simple,) = struct.unpack("<f", v)
      out.append((step, tag, simple))
  return out


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
