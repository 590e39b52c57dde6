"""One run per workdir: a lock file that names its holder.

Two jobs writing the same checkpoints and ``metrics.json`` corrupt each other
silently, so the training job takes ``DIR/run.lock`` before it touches
anything in the workdir. The file is created atomically (``O_CREAT |
O_EXCL``) and records who holds it: the process id, the host, the time the
run started and, where ``/proc`` exists, the process' start time (so a
recycled pid is not mistaken for the holder).

A second job on the same workdir refuses with :class:`WorkdirLockedError`,
one line that names the holder. A lock whose holder is gone (the job was
killed with ``kill -9``, or the machine rebooted) is taken over: the job
returns a note that says whose lock it replaced. A lock written on another
host cannot be checked from here and is never taken over; the message says
how to remove it if that run is really gone.

In multi-host runs only process 0 holds the lock (``is_primary``): the other
processes write nothing into the workdir but the checkpoints orbax writes
collectively.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from typing import Any, Dict, Optional

from circle_jax import paths
from circle_jax.errors import UserError

LOCK_FILE = "run.lock"


class WorkdirLockedError(UserError):
  """Another live run holds the workdir."""


def _proc_start_ticks(pid: int) -> Optional[int]:
  """The start time of process ``pid`` in clock ticks since boot, if known."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      stat = f.read().decode("ascii", "replace")
  except OSError:
    return None
  # The command name (field 2) is in parentheses and may hold spaces.
  fields = stat[stat.rfind(")") + 2:].split()
  try:
    return int(fields[19])  # field 22 of proc(5), counted from field 3
  except (IndexError, ValueError):
    return None


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def holder_alive(holder: Dict[str, Any]) -> Optional[bool]:
  """Whether the process that wrote ``holder`` still runs.

  Returns None when that cannot be known here (another host).
  """
  if holder.get("host") != socket.gethostname():
    return None
  pid = holder.get("pid")
  if not isinstance(pid, int) or pid <= 0 or not _pid_alive(pid):
    return False
  want = holder.get("pid_start")
  if want is None:
    return True
  return _proc_start_ticks(pid) == want


def describe(holder: Dict[str, Any]) -> str:
  return (f"pid {holder.get('pid')} on host {holder.get('host')} since "
          f"{holder.get('started')}")


class WorkdirLock:
  """``with WorkdirLock(workdir) as lock:`` holds ``workdir/run.lock``.

  Attributes:
    path: the lock file.
    note: None, or a line saying whose stale lock was taken over.
  """

  def __init__(self, workdir: str, *, is_primary: bool = True):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.is_primary = is_primary
    self.note: Optional[str] = None
    self._held: Optional[Dict[str, Any]] = None

  def _read(self) -> Dict[str, Any]:
    return self._read_file(self.path)

  @staticmethod
  def _read_file(path: str) -> Dict[str, Any]:
    try:
      with open(path) as f:
        data = json.load(f)
      return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
      return {}  # unreadable or half-written: no live holder can be named

  def _create(self) -> bool:
    me = {
        "pid": os.getpid(),
        "pid_start": _proc_start_ticks(os.getpid()),
        "host": socket.gethostname(),
        "started": datetime.datetime.now().astimezone().isoformat(
            timespec="seconds"),
    }
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "w") as f:
      json.dump(me, f)
    self._held = me
    return True

  def acquire(self) -> "WorkdirLock":
    """Takes the lock, or raises :class:`WorkdirLockedError`.

    Raises:
      WorkdirLockedError: a live run (or a run on another host) holds it.
    """
    if not self.is_primary:
      return self
    paths.make_folder(os.path.dirname(self.path), "--workdir")
    for _ in range(3):  # another job may race us for a stale lock
      if self._create():
        return self
      holder = self._read()
      alive = holder_alive(holder) if holder else False
      if alive or alive is None:
        where = ("is in use by" if alive else "is locked by a run on another "
                 "host,")
        raise WorkdirLockedError(
            f"Workdir {os.path.dirname(self.path)} {where} {describe(holder)}"
            f" ({self.path}); wait for that run to end or use another "
            "--workdir" + ("" if alive else ", or delete the lock file if "
                           "that run is gone") + ".")
      # The holder is gone: move its lock aside atomically, then retry.
      stale = f"{self.path}.stale.{os.getpid()}"
      try:
        os.rename(self.path, stale)
      except FileNotFoundError:
        continue
      moved = self._read_file(stale)
      if moved != holder:  # another job replaced it meanwhile: put it back
        try:
          os.link(stale, self.path)  # never overwrites a newer lock
        except FileExistsError:
          pass
        os.remove(stale)
        continue
      os.remove(stale)
      self.note = (f"Took over the lock of a run that is gone "
                   f"({describe(holder) if holder else 'unreadable lock file'}"
                   f") in {os.path.dirname(self.path)}.")
    raise WorkdirLockedError(
        f"Could not take the lock {self.path}: other jobs keep taking it; "
        "run one job per --workdir.")

  def release(self) -> None:
    """Removes the lock file if this process still holds it."""
    if self._held is None:
      return
    if self._read().get("pid") == self._held["pid"]:
      try:
        os.remove(self.path)
      except FileNotFoundError:
        pass
    self._held = None

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
