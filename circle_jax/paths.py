"""The folders and files a user names, checked with one line each.

A ``--workdir`` that is an existing file, an ``--out`` under a file, a
``dataset.manual_dir`` that is a file: the operating system's error
(``FileExistsError``, ``NotADirectoryError``) names neither the option nor
the fix. These helpers raise :class:`PathError` instead: one line naming the
option, the path, what is in the way and what to give.
"""

from __future__ import annotations

import errno
import os

from circle_jax.errors import UserError


class PathError(UserError):
  """A path given by the user is not what it must be (folder, file)."""


def _file_in_the_way(path: str) -> str:
  """The first existing non-folder on the way to ``path`` (or "")."""
  probe = os.path.abspath(path)
  parts = []
  while probe and probe != os.path.dirname(probe):
    parts.append(probe)
    probe = os.path.dirname(probe)
  for p in reversed(parts):
    if os.path.lexists(p) and not os.path.isdir(p):
      return p
  return ""


def folder_problem(path: str, option: str) -> str:
  """Why ``path`` cannot be or become a folder, or "" when it can."""
  blocker = _file_in_the_way(path)
  if not blocker:
    return ""
  if os.path.abspath(blocker) == os.path.abspath(path):
    return (f"{option}: {path!r} is a file; it must be a folder (give a new "
            "or existing folder).")
  return (f"{option}: {path!r} cannot be a folder: {blocker!r} is a file; "
          "give another path.")


def make_folder(path: str, option: str) -> str:
  """Creates the folder ``path`` (and its parents) if needed; returns it.

  Args:
    path: the folder.
    option: how the user gave it, for the message (``--workdir``).

  Raises:
    PathError: a file is in the way, or the folder cannot be created (no
      permission, read-only or full filesystem).
  """
  problem = folder_problem(path, option)
  if problem:
    raise PathError(problem)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    problem = folder_problem(path, option)  # raced with another process
    if problem:
      raise PathError(problem) from None
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC,
                   errno.EDQUOT):
      raise PathError(
          f"{option}: cannot create the folder {path!r} ({e.strerror}); "
          "give a folder you can write to.") from None
    raise
  return path


def output_file(path: str, option: str) -> str:
  """Checks that ``path`` can be written as a file; creates its folder.

  Raises:
    PathError: ``path`` is a folder, or its folder cannot be made.
  """
  if os.path.isdir(path):
    raise PathError(f"{option}: {path!r} is a folder; give a file name.")
  folder = os.path.dirname(os.path.abspath(path))
  blocker = _file_in_the_way(folder)
  if blocker:
    raise PathError(f"{option}: {path!r} cannot be written: {blocker!r} is "
                    "a file; give another path.")
  make_folder(folder, option)
  return path
