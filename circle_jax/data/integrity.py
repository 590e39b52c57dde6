"""Prepared dataset files are checked when they are opened.

A truncated or damaged ArrayRecord shard (a full disk while preparing, a copy
cut short) otherwise fails deep inside the input pipeline at whatever step
first reads it, as a long Grain traceback that names no file. Opening a split
through :func:`check_split` instead checks, for every shard of the split, that
it opens, that it holds the number of records the dataset info recorded when
it was written, and that its first and last records read back. The first bad
shard raises :class:`CorruptPreparedDataError`: one line naming the file and
the command that rebuilds the prepared folder.

The check reads two records per shard and each shard's footer: milliseconds
for the datasets here, not a scan of the data. So it finds truncated,
emptied, missing and overwritten-header files, but not damage inside a chunk
in the middle of a shard, which only a full read would find.
"""

from __future__ import annotations

import os
import shlex
from typing import Sequence

from circle_jax.errors import UserError


class CorruptPreparedDataError(UserError):
  """A prepared dataset file is truncated, damaged or missing."""


def rebuild_hint(prepared_dir: str) -> str:
  """The command that removes a prepared folder so the next run rebuilds it."""
  return (f"rebuild it with `rm -r {shlex.quote(str(prepared_dir))}` and run "
          "the same command again (the dataset is prepared anew from its "
          "official files)")


def _check_shard(path: str, expected: int) -> str:
  """'' if the shard is good, else what is wrong with it."""
  # Imported here: array_record is a tfds dependency needed only for this.
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  if not os.path.exists(path):
    return "is missing"
  try:
    reader = array_record_module.ArrayRecordReader(
        path, "readahead_buffer_size:0")
  except Exception as e:  # pylint: disable=broad-except
    return f"cannot be opened ({str(e).splitlines()[0][:120]})"
  problem = ""
  try:
    count = reader.num_records()
    if count != expected:
      problem = (f"holds {count} records where the dataset info recorded "
                 f"{expected} (truncated or overwritten)")
    elif count:
      records = reader.read([0, count - 1])
      if len(records) != 2 or not all(records):
        problem = "has an empty first or last record"
  except Exception as e:  # pylint: disable=broad-except
    problem = f"cannot be read ({str(e).splitlines()[0][:120]})"
  try:
    reader.close()  # a damaged file can fail here too
  except Exception as e:  # pylint: disable=broad-except
    problem = problem or f"cannot be read ({str(e).splitlines()[0][:120]})"
  return problem


def check_shards(paths: Sequence[str], lengths: Sequence[int], *,
                 dataset: str, prepared_dir: str) -> None:
  """Checks shards against their recorded record counts.

  Raises:
    CorruptPreparedDataError: naming the first bad file and the fix.
  """
  if len(paths) != len(lengths):
    raise CorruptPreparedDataError(
        f"Dataset {dataset!r}: the prepared folder {prepared_dir} lists "
        f"{len(lengths)} shards but {len(paths)} files; "
        f"{rebuild_hint(prepared_dir)}.")
  for path, expected in zip(paths, lengths):
    problem = _check_shard(str(path), int(expected))
    if problem:
      raise CorruptPreparedDataError(
          f"Dataset {dataset!r}: prepared file {path} {problem}; "
          f"{rebuild_hint(prepared_dir)}.")


def check_split(builder, split: str) -> None:
  """Checks every ArrayRecord shard of ``split`` of a prepared tfds builder."""
  info = builder.info.splits[split]
  check_shards([str(p) for p in info.filepaths], list(info.shard_lengths),
               dataset=builder.info.name, prepared_dir=str(builder.data_dir))
