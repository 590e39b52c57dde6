"""Indexes and queries from a trained run and image folders.

The images are embedded as :mod:`circle_jax.embed` does
(:func:`circle_jax.embed.embed_files`: the run's eval preprocessing, its best
checkpoint unless told otherwise). Labels come from the first sub-folder of
each image's relative path (``cats/001.png`` -> ``cats``) or from a CSV of
``path,label`` rows (paths relative to the folder; a header row ``path,label``
is allowed).
"""

from __future__ import annotations

import csv
import os
from typing import Callable, Dict, List, Optional, Tuple

from absl import logging
import numpy as np

from circle_jax import embed as embed_lib
from circle_jax.errors import UserError
from circle_jax.search import index as index_lib

FOLDERS = "folders"


class LabelsError(UserError, ValueError):
  """Labels that cannot be read for the images."""


def restore(workdir: str, which: Optional[str] = None):
  """``(run, record)``: the run restored on one device and its
  :class:`~circle_jax.search.index.ModelRecord`."""
  from circle_jax import parallel  # pylint: disable=g-import-not-at-top
  from circle_jax.train import restore as restore_lib  # pylint: disable=g-import-not-at-top
  run = restore_lib.restore_run(workdir, which,
                                placement=parallel.SingleDevice())
  record = index_lib.ModelRecord.of_run(run)
  return run, record


def read_labels(folder: str, paths: List[str], source: Optional[str]
                ) -> Optional[np.ndarray]:
  """Labels of ``paths``: None, sub-folder names (``folders``) or a CSV."""
  if not source:
    return None
  if source == FOLDERS:
    labels = [p.replace("\\", "/").split("/")[0] if "/" in p.replace(
        "\\", "/") else None for p in paths]
    missing = [p for p, lab in zip(paths, labels) if lab is None]
    if missing:
      raise LabelsError(
          f"--labels folders: {missing[0]!r} is not in a sub-folder of "
          f"{folder!r}; put each class in its own sub-folder or pass a CSV.")
    return np.asarray(labels, dtype=str)
  if not os.path.isfile(source):
    raise LabelsError(f"--labels: {source!r} is neither `folders` nor a CSV "
                      "file of path,label rows.")
  table: Dict[str, str] = {}
  with open(source, newline="") as f:
    for n, row in enumerate(csv.reader(f)):
      if n == 0 and [c.strip().lower() for c in row[:2]] == ["path",
                                                             "label"]:
        continue
      if len(row) < 2:
        if row:
          raise LabelsError(f"{source}:{n + 1}: expected path,label; got "
                            f"{row!r}.")
        continue
      table[os.path.normpath(row[0].strip())] = row[1].strip()
  missing = [p for p in paths if os.path.normpath(p) not in table]
  if missing:
    raise LabelsError(f"{source} has no label for {missing[0]!r} "
                      f"({len(missing)} image(s) unlabelled); add a row "
                      "path,label for each image.")
  return np.asarray([table[os.path.normpath(p)] for p in paths], dtype=str)


def embed_images(run, images: str, *, batch_size: int = 64,
                 on_batch: Optional[Callable[[int, int], None]] = None
                 ) -> Tuple[List[str], np.ndarray, list]:
  """``(paths, embeddings, skipped)`` of a folder or of one image file."""
  if os.path.isfile(images):
    folder, paths = os.path.dirname(images) or ".", [
        os.path.basename(images)]
  else:
    folder, paths = images, embed_lib.list_images(images)
    if not paths:
      raise embed_lib.EmbedError(
          f"no image files under {images!r} (looked for "
          f"{' '.join(embed_lib.IMAGE_EXTENSIONS)}, recursively).")
  logging.info("Embedding %d images of %s with %s (step %s).", len(paths),
               images, run.workdir, run.step)
  done = (lambda n: on_batch(n, len(paths))) if on_batch else None
  return embed_lib.embed_files(run, folder, paths, batch_size=batch_size,
                               on_batch=done)


def build_from_folder(workdir: str, images: str, *,
                      labels: Optional[str] = FOLDERS,
                      which: Optional[str] = None, batch_size: int = 64,
                      on_batch=None) -> index_lib.GalleryIndex:
  """An index of the images under ``images`` embedded by the run.

  Args:
    workdir: the trained run.
    images: the gallery's folder.
    labels: ``folders`` (sub-folder names; None when the images are not in
      sub-folders), a CSV file, or None.
    which: ``best`` or ``latest`` checkpoint (default: best if any).
    batch_size: images per forward pass.
    on_batch: ``on_batch(done, total)`` after each batch (progress).

  Returns:
    The index; item ids are the relative paths, metadata ``{"path": ...}``.
  """
  run, record = restore(workdir, which)
  paths, emb, skipped = embed_images(run, images, batch_size=batch_size,
                                     on_batch=on_batch)
  if labels == FOLDERS and not any("/" in p.replace("\\", "/")
                                   for p in paths):
    labels = None
  lab = read_labels(images, paths, labels)
  root = os.path.abspath(images)
  index = index_lib.GalleryIndex(record)
  index.add(emb, ids=paths, labels=lab,
            metadata=[{"path": os.path.join(root, p)} for p in paths])
  index.skipped = skipped
  return index
