"""Orbax checkpoints: the latest ones for resuming, the best one for inference.

Layout under ``DIR/checkpoints``::

  latest/<step>/{state, data, meta}   every ``checkpoint_every_steps`` and at the end
  best/<step>/{state, data, meta}     the best evaluation by ``config.best_metric``

``state`` is the host copy of the :class:`TrainState` tree (step, params,
opt_state, batch_stats) as numpy arrays, so a checkpoint does not depend on the
parallelism mode or the device count it was written with. ``data`` is the
train iterator's state (JSON), ``meta`` the step and, for ``best``, the
metrics.

Atomicity: orbax writes a step into a temporary directory and renames it when
complete (the commit point); ``latest_step()`` only lists finalised steps and
leftover temporary directories are removed at start-up, so a checkpoint
interrupted by SIGKILL is never restored. Saves are asynchronous; all
processes call every method (orbax synchronises them and process 0 writes
the replicated arrays).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import zlib
from typing import Any, List, Optional, Tuple

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from circle_jax.errors import UserError

PyTree = Any
ITEMS = ("state", "data", "meta")
# Unreadable steps are moved here (never deleted): DIR/checkpoints/unreadable.
UNREADABLE = "unreadable"


class CheckpointWriteError(UserError):
  """A checkpoint could not be written (full disk, read-only workdir, ...)."""


class CorruptCheckpointError(UserError):
  """A checkpoint step cannot be read back, or no step can."""


def state_digest(tree: PyTree) -> int:
  """CRC-32 of a host state tree: every leaf's shape, dtype and bytes.

  Saved with each ``latest`` step and compared on restore, so bytes
  overwritten inside a state file are found even where the storage format
  does not check them. Integer leaves are hashed as int64: a restore casts
  them to the template's integer type (the step counter is saved as int32
  and restored into an int64 template).
  """
  crc = 0
  for leaf in jax.tree.leaves(tree):
    x = np.asarray(leaf)
    if x.dtype.kind in "biu":
      x = x.astype(np.int64)
    x = np.ascontiguousarray(x)
    crc = zlib.crc32(f"{x.dtype.str}{x.shape}".encode(), crc)
    crc = zlib.crc32(x.view(np.uint8).reshape(-1) if x.size else b"", crc)
  return crc


# The errors of a write that the user fixes on their side, and the fix.
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
WRITE_ERRNOS = _READ_ONLY + _NO_SPACE
WRITE_FIX = ("Free space there or make it writable (or pass another "
             "--workdir), then rerun the same command to resume.")


def errno_of(error: BaseException) -> Optional[int]:
  """The errno of the first OSError in an exception's cause/context chain."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno:
      return error.errno
    error = error.__cause__ or error.__context__
  return None


def write_failure(path: str, error: BaseException) -> str:
  """Why writing under ``path`` failed, in words (full disk, read-only, ...)."""
  text = f"{type(error).__name__}: {error}"
  err = errno_of(error)
  probe = path
  while probe and not os.path.exists(probe):
    probe = os.path.dirname(probe)
  try:
    free = shutil.disk_usage(probe).free if probe else None
  except OSError:
    free = None
  if err in _READ_ONLY or (
      err is None and ("Read-only file system" in text
                       or "Permission denied" in text)):
    return "the folder is read-only (or not writable by this user)"
  if err in _NO_SPACE or (
      err is None and ("No space left" in text or "RESOURCE_EXHAUSTED" in text
                       or free == 0)):
    shown = "" if free is None else f" ({free // 1024} KiB free)"
    return f"no space left on the device{shown}"
  return text.splitlines()[0][:200]


def _to_json(x):
  """Makes metrics / iterator states JSON-serialisable."""
  if isinstance(x, dict):
    return {str(k): _to_json(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_to_json(v) for v in x]
  if isinstance(x, (np.generic, np.ndarray)) or hasattr(x, "item"):
    x = np.asarray(x)
    return x.item() if x.ndim == 0 else x.tolist()
  return x


def error_line(e: BaseException) -> str:
  """An error's first line (at most 160 characters), or its type's name."""
  lines = str(e).splitlines()
  return (lines[0][:160] if lines else "") or type(e).__name__


class Checkpoints:
  """The ``latest`` and ``best`` checkpoint managers of a run.

  Args:
    directory: ``DIR/checkpoints``.
    best_metric: the metric name that ranks evaluations (e.g. ``recall@1``);
      None disables the ``best`` checkpoint.
    best_mode: ``max`` or ``min``.
    max_to_keep: latest checkpoints to keep.
    asynchronous: save in a background thread.
  """

  def __init__(self, directory, *, best_metric: Optional[str] = None,
               best_mode: str = "max", max_to_keep: int = 2,
               asynchronous: bool = True):
    if best_mode not in ("max", "min"):
      raise ValueError(f"`best_mode` must be 'max' or 'min'; got {best_mode!r}.")
    directory = os.path.abspath(os.fspath(directory))
    self.directory = directory
    self.best_metric = best_metric
    self._pending: Optional[int] = None  # the newest step handed to orbax
    common = dict(
        create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=asynchronous)
    self.latest = ocp.CheckpointManager(
        os.path.join(directory, "latest"),
        item_names=ITEMS,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, **common))
    self.best = None
    if best_metric:
      self.best = ocp.CheckpointManager(
          os.path.join(directory, "best"),
          item_names=ITEMS,
          options=ocp.CheckpointManagerOptions(
              max_to_keep=1, best_fn=lambda m: float(m[best_metric]),
              best_mode=best_mode, **common))

  # -- saving ---------------------------------------------------------------

  @staticmethod
  def _args(state_tree, data_state, meta):
    return ocp.args.Composite(
        state=ocp.args.StandardSave(state_tree),
        data=ocp.args.JsonSave(_to_json(data_state or {})),
        meta=ocp.args.JsonSave(_to_json(meta)))

  def save_latest(self, step: int, state_tree: PyTree, data_state=None,
                  meta: Optional[dict] = None) -> bool:
    """Saves (asynchronously) unless ``step`` is already saved.

    Args:
      step: the step (number of updates applied).
      state_tree: host copy of the state (``state_to_tree`` then ``to_host``).
      data_state: the train iterator's ``get_state()``.
      meta: extra JSON-serialisable items kept in ``meta`` with the step.

    Raises:
      CheckpointWriteError: the write failed (an earlier asynchronous write
        included); the message names the folder and the cause.
    """
    step = int(step)
    self.wait()  # a failed earlier write surfaces here, under its own step
    if step in self.latest.all_steps():
      return False
    meta = dict(meta or {}, step=step, state_crc32=state_digest(state_tree))
    self._pending = step
    with self._writing(step):
      return self.latest.save(
          step, args=self._args(state_tree, data_state, meta), force=True)

  @contextlib.contextmanager
  def _writing(self, step):
    """Turns any failure of a write into one :class:`CheckpointWriteError`."""
    try:
      yield
    except UserError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise self.write_error(step, e) from e

  def write_error(self, step, exc: BaseException) -> CheckpointWriteError:
    step = self._pending if step is None else step
    saved = [s for s in self.latest.all_steps() if step is None or s < step]
    kept = (f"earlier checkpoints (last: step {max(saved)}) are intact"
            if saved else "no earlier checkpoint exists")
    what = f"checkpoint step {step}" if step is not None else "a checkpoint"
    return CheckpointWriteError(
        f"Could not write {what} in {self.directory}: "
        f"{write_failure(self.directory, exc)}; {kept}. {WRITE_FIX}")

  def check_for_errors(self):
    """Raises the error of a failed asynchronous write, if any."""
    for manager in (self.latest, self.best):
      if manager is None:
        continue
      with self._writing(None):
        manager.check_for_errors()

  def save_best(self, step: int, state_tree: PyTree, data_state,
                metrics: dict) -> bool:
    """Offers an evaluated state; orbax keeps it if it is the best so far.

    Waits for the write to finish, so that a later ``latest`` checkpoint never
    exists without the ``best`` of the evaluations before it.
    """
    if self.best is None:
      return False
    step = int(step)
    if step in self.best.all_steps():
      return False
    metrics = _to_json(metrics)
    with self._writing(step):
      saved = self.best.save(
          step, args=self._args(state_tree, data_state,
                                {"step": step, "metrics": metrics}),
          metrics={k: v for k, v in metrics.items()
                   if isinstance(v, (int, float))}, force=True)
      self.best.wait_until_finished()
    return saved

  # -- restoring ------------------------------------------------------------

  def latest_step(self) -> Optional[int]:
    return self.latest.latest_step()

  def best_step(self) -> Optional[int]:
    return None if self.best is None else self.best.best_step()

  def best_metrics(self) -> Optional[dict]:
    """``{'step': s, 'metrics': {...}}`` of the best checkpoint, or None."""
    step = self.best_step()
    if step is None:
      return None
    meta = self.best.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(meta["meta"])

  def restore(self, template: Optional[PyTree] = None, *,
              step: Optional[int] = None,
              which: str = "latest"):
    """Restores ``(state_tree, data_state, meta)``.

    Args:
      template: a host (numpy) tree with the structure, shapes and dtypes of
        the saved state (e.g. of a freshly initialised state); None returns
        the saved tree as nested dicts/lists.
      step: the step to restore (default: the latest, or the best).
      which: ``latest`` or ``best``.

    Returns:
      The state tree (numpy arrays) and the JSON items.
    """
    manager = self.latest if which == "latest" else self.best
    if manager is None:
      raise ValueError("This run has no `best` checkpoints (no best_metric).")
    if step is None:
      step = manager.latest_step() if which == "latest" else manager.best_step()
    if step is None:
      raise FileNotFoundError(f"No {which} checkpoint in {self.directory}.")
    abstract = None
    if template is not None:
      abstract = jax.tree.map(
          lambda x: np.zeros(np.shape(x), np.asarray(x).dtype), template)
    out = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore()))
    tree = jax.tree.map(np.asarray, out["state"])
    want = (out["meta"] or {}).get("state_crc32")
    if want is not None and state_digest(tree) != want:
      raise CorruptCheckpointError(
          f"checkpoint step {step} in {manager.directory}: the state's bytes "
          "differ from the checksum saved with it")
    return tree, out["data"], out["meta"]

  def restore_newest(self, template: PyTree, check=None):
    """Restores the newest ``latest`` step that reads back cleanly.

    A step that fails to restore (a truncated or overwritten file, an item
    missing from its folder, a checksum mismatch) is skipped for the next
    older one; once an older step restores, each newer unreadable step is
    moved to ``DIR/checkpoints/unreadable/`` (never deleted) and named in the
    returned notes. If no step restores nothing is moved: the steps may be
    fine and the template wrong.

    Args:
      template: the host state tree the saved state must fit.
      check: optional ``check(tree, step)`` that raises if the restored tree
        does not fit (its error is raised as is, not taken as corruption).

    Returns:
      ``(tree, data_state, meta, step, notes)``, or None without checkpoints.

    Raises:
      CorruptCheckpointError: no step restores (one line naming the folder
        and the fix).
    """
    steps = sorted(self.latest.all_steps(), reverse=True)
    if not steps:
      return None
    failed: List[Tuple[int, str]] = []
    for step in steps:
      try:
        tree, data, meta = self.restore(template, step=step)
      except Exception as e:  # pylint: disable=broad-except
        failed.append((step, error_line(e)))
        continue
      if check is not None:
        check(tree, step)
      notes = [self._move_aside(s, why) for s, why in failed]
      return tree, data, meta, step, notes
    tried = ", ".join(str(s) for s, _ in failed)
    raise CorruptCheckpointError(
        f"No checkpoint in {os.path.join(self.directory, 'latest')} restores "
        f"(steps {tried}; newest: {failed[0][1]}); move that folder away to "
        "start from step 0, or pass another --workdir.")

  def _move_aside(self, step: int, why: str) -> str:
    dst = self._move_to_unreadable(self.latest, "latest", step)
    return (f"Checkpoint step {step} is unreadable ({why}); moved to {dst} "
            "and resumed from the newest readable step.")

  def move_best_aside(self, why: str) -> str:
    """Moves the unreadable ``best`` step to ``DIR/checkpoints/unreadable/``.

    Never deletes it. Returns the note that says so; the run's result then
    comes from its last step (the caller's fallback).
    """
    step = self.best_step()
    if step is None:  # nothing listed: nothing to move
      return f"The best checkpoint is unreadable ({why})."
    dst = self._move_to_unreadable(self.best, "best", step)
    return (f"The best checkpoint (step {step}) is unreadable ({why}); moved "
            f"to {dst}; the result is the last step's.")

  def _move_to_unreadable(self, manager, which: str, step: int) -> str:
    src = os.path.join(manager.directory, str(step))
    dst_dir = os.path.join(self.directory, UNREADABLE)
    dst = os.path.join(dst_dir,
                       f"{which}-{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    if jax.process_index() == 0:
      os.makedirs(dst_dir, exist_ok=True)
      os.rename(src, dst)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint_aside_{which}_{step}")
    manager.reload()
    return dst

  def wait(self):
    """Waits for pending writes; a failed one raises CheckpointWriteError."""
    with self._writing(None):
      self.latest.wait_until_finished()
      if self.best is not None:
        self.best.wait_until_finished()
    self.check_for_errors()

  def close(self):
    self.latest.close()
    if self.best is not None:
      self.best.close()
