"""A saved gallery: embeddings, ids, labels, metadata and the model they
came from.

:class:`GalleryIndex` holds the ``[N, D]`` float32 embeddings of a gallery
(L2-normalised when added), one unique string id per item, optional labels
(all items labelled, or none), per-item metadata (a JSON object each; the
source ``path`` of an image, and anything the user adds), the
:class:`ModelRecord` of the model that embedded them, and named calibration
cut-points (:mod:`circle_jax.search.calibrate`).

The file is a NumPy ``.npz`` archive (no pickle: it is read with
``allow_pickle=False``) holding ``embeddings``, ``ids``, ``labels`` (if any),
and one JSON string ``header`` (format name and version, the model record,
the item metadata and the cut-points). :meth:`GalleryIndex.save` is atomic:
it writes a temporary file beside the target, flushes it to disk and renames
it over the target, so a save that is interrupted (a crash, ``kill -9``, a
full disk) leaves the previous index intact. The temporary file that a
killed save leaves behind (``.NAME.PID.XXXXXXXX.tmp``) is removed by the next
save or load of that path once its process ``PID`` is gone. A damaged or foreign file is one
:class:`IndexFileError` line naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import zipfile
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from circle_jax.errors import UserError

FORMAT = "circle_jax.search.index"
VERSION = 1
# The geometry of every ranking in circle_jax's evaluation: cosine similarity
# of L2-normalised embeddings (models trained on the Poincare ball are
# evaluated on their normalised features, see
# circle_jax.evaluation.embedding.model_apply).
GEOMETRY = "cosine"
NORMALIZATION = "l2"


class IndexFileError(UserError, ValueError):
  """An index file that is missing, damaged or not an index."""


class ModelMismatchError(UserError, ValueError):
  """Query embeddings of another model than the index's."""


class IndexContentError(UserError, ValueError):
  """Items that cannot be added or removed (ids, labels, dimension)."""


@dataclasses.dataclass(frozen=True)
class ModelRecord:
  """The model that embedded a gallery.

  Attributes:
    run: the run's workdir (absolute), or a name for embeddings from
      elsewhere.
    step: the checkpoint's training step (None: unknown).
    checkpoint: ``best`` or ``latest`` (None: unknown).
    embedding_dim: ``D``.
    geometry: how items are compared: ``cosine``.
    normalization: ``l2``: every stored embedding has unit norm.
    train_geometry: the loss's geometry in training (``cosine`` or
      ``poincare``; None: unknown).
    fingerprint: SHA-256 of the checkpoint's weights (None: unknown); two
      records with fingerprints are the same model exactly when these are
      equal.
  """

  run: str
  step: Optional[int]
  checkpoint: Optional[str]
  embedding_dim: int
  geometry: str = GEOMETRY
  normalization: str = NORMALIZATION
  train_geometry: Optional[str] = None
  fingerprint: Optional[str] = None

  @classmethod
  def of_run(cls, run) -> "ModelRecord":
    """The record of a restored run (:class:`circle_jax.train.restore.Run`)."""
    return cls(run=run.workdir, step=run.step, checkpoint=run.which,
               embedding_dim=int(run.config.model.embedding_dim),
               train_geometry=run.config.loss.get("geometry", "cosine"),
               fingerprint=weights_fingerprint(run.variables))

  def to_dict(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ModelRecord":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})

  def describe(self) -> str:
    step = "?" if self.step is None else self.step
    return f"{self.run} (step {step}, {self.embedding_dim}-d)"

  def differs(self, other: "ModelRecord") -> Optional[str]:
    """Why ``other`` is another model than this one (None: the same)."""
    if other.embedding_dim != self.embedding_dim:
      return (f"{other.embedding_dim}-d embeddings, the index holds "
              f"{self.embedding_dim}-d ones")
    if (other.geometry, other.normalization) != (self.geometry,
                                                 self.normalization):
      return (f"geometry {other.geometry}/{other.normalization}, the "
              f"index's is {self.geometry}/{self.normalization}")
    if self.fingerprint and other.fingerprint:
      if self.fingerprint != other.fingerprint:
        return "other weights"
      return None
    if (other.run, other.step) != (self.run, self.step):
      return "another run or step"
    return None


def weights_fingerprint(variables) -> str:
  """SHA-256 (hex) of a tree of arrays, by leaf path, dtype, shape, bytes."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_flatten_with_path(variables)[0]
  for path, leaf in sorted(leaves, key=lambda x: jax.tree_util.keystr(x[0])):
    a = np.ascontiguousarray(np.asarray(leaf))
    h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def _normalize(x: np.ndarray) -> np.ndarray:
  # The gallery's normalisation in every ranking (one place).
  from circle_jax.evaluation import tiled_ranking  # pylint: disable=g-import-not-at-top
  return tiled_ranking.l2_normalize_rows(x)


class GalleryIndex:
  """Gallery embeddings with their ids, labels, metadata and model.

  Build one with :meth:`from_arrays` (or
  :func:`circle_jax.search.build.build_from_folder`), search it with
  :func:`circle_jax.search.searching.search`, save it with :meth:`save` and
  read it back with :func:`load`.
  """

  def __init__(self, model: ModelRecord):
    self.model = model
    self.embeddings = np.zeros((0, model.embedding_dim), np.float32)
    self.ids: List[str] = []
    self.labels: Optional[np.ndarray] = None
    self.metadata: List[Dict[str, Any]] = []
    self.cutpoints: Dict[str, Dict[str, float]] = {}
    self.calibration: Dict[str, Any] = {}

  # --------------------------------------------------------------- building

  @classmethod
  def from_arrays(cls, embeddings, *, ids: Optional[Sequence[str]] = None,
                  labels=None, metadata: Optional[Sequence[Mapping]] = None,
                  model: Optional[ModelRecord] = None) -> "GalleryIndex":
    """An index of ``embeddings [N, D]``.

    Args:
      embeddings: float ``[N, D]``; stored L2-normalised.
      ids: ``N`` unique strings (default ``"0" .. "N-1"``).
      labels: ``N`` ints or strings, or None.
      metadata: ``N`` JSON-able dicts (e.g. ``{"path": ...}``), or None.
      model: the model that embedded them (default: a record named
        ``arrays`` with only the embedding size).
    """
    emb = np.asarray(embeddings)
    if emb.ndim != 2:
      raise IndexContentError(
          f"embeddings must be [num_items, dim]; got shape {emb.shape}.")
    if model is None:
      model = ModelRecord(run="arrays", step=None, checkpoint=None,
                          embedding_dim=int(emb.shape[1]))
    index = cls(model)
    index.add(emb, ids=ids if ids is not None
              else [str(i) for i in range(emb.shape[0])],
              labels=labels, metadata=metadata)
    return index

  def __len__(self) -> int:
    return len(self.ids)

  @property
  def dim(self) -> int:
    return self.model.embedding_dim

  def add(self, embeddings, *, ids: Sequence[str], labels=None,
          metadata: Optional[Sequence[Mapping]] = None) -> None:
    """Appends items; ids must be new, labels given iff the index has them."""
    emb = np.asarray(embeddings, np.float32)
    n = emb.shape[0] if emb.ndim == 2 else -1
    if emb.ndim != 2 or emb.shape[1] != self.dim:
      raise IndexContentError(
          f"embeddings of shape {emb.shape} do not fit this index of "
          f"{self.dim}-d items.")
    if not np.all(np.isfinite(emb)):
      raise IndexContentError("embeddings contain NaN or infinite values.")
    ids = [str(i) for i in ids]
    if len(ids) != n:
      raise IndexContentError(f"{len(ids)} ids for {n} embeddings.")
    seen = set(self.ids)
    dup = [i for i in ids if i in seen]
    if dup or len(set(ids)) != len(ids):
      dup = dup or [i for i in ids if ids.count(i) > 1]
      raise IndexContentError(
          f"id {dup[0]!r} is already in the index (ids must be unique); "
          "remove it first or choose other ids.")
    if len(self) and (labels is None) != (self.labels is None):
      raise IndexContentError(
          "labels must be given for every item or for none: this index "
          + ("has" if self.labels is not None else "has no") + " labels.")
    if labels is not None:
      labels = np.asarray(labels)
      if labels.shape != (n,):
        raise IndexContentError(f"{labels.shape[0] if labels.ndim else 0} "
                                f"labels for {n} embeddings.")
      if labels.dtype.kind not in "iuU":
        labels = labels.astype(str)
      if self.labels is not None and len(self):
        if (labels.dtype.kind == "U") != (self.labels.dtype.kind == "U"):
          raise IndexContentError(
              "labels must all be strings or all integers, like the "
              "index's.")
        labels = np.concatenate([self.labels, labels])
      self.labels = labels if labels.dtype.kind == "U" else labels.astype(
          np.int64)
    if metadata is None:
      metadata = [{} for _ in ids]
    if len(metadata) != n:
      raise IndexContentError(f"{len(metadata)} metadata entries for {n} "
                              "embeddings.")
    self.embeddings = np.concatenate([self.embeddings, _normalize(emb)])
    self.ids.extend(ids)
    self.metadata.extend(dict(m) for m in metadata)

  def remove(self, ids: Sequence[str]) -> int:
    """Removes the items with these ids; returns how many. Unknown ids are
    an error (nothing is removed)."""
    where = {i: j for j, i in enumerate(self.ids)}
    missing = [i for i in ids if str(i) not in where]
    if missing:
      raise IndexContentError(f"id {missing[0]!r} is not in the index.")
    drop = np.zeros(len(self), bool)
    drop[[where[str(i)] for i in ids]] = True
    keep = ~drop
    self.embeddings = self.embeddings[keep]
    self.ids = [i for i, k in zip(self.ids, keep) if k]
    self.metadata = [m for m, k in zip(self.metadata, keep) if k]
    if self.labels is not None:
      self.labels = self.labels[keep]
    return int(drop.sum())

  def check_model(self, other: Optional[ModelRecord], dim: int,
                  source: str = "the queries") -> None:
    """Raises :class:`ModelMismatchError` (one line) unless queries of
    ``dim`` dimensions embedded by ``other`` (None: unknown) fit."""
    if dim != self.dim:
      raise ModelMismatchError(
          f"{source} are {dim}-d embeddings but the index holds {self.dim}-d "
          f"ones from {self.model.describe()}: embed the queries with that "
          "model.")
    if other is not None:
      why = self.model.differs(other)
      if why:
        raise ModelMismatchError(
            f"{source} come from another model ({other.describe()}: {why}) "
            f"than the index ({self.model.describe()}): embed them with the "
            "index's model, or build the index again.")

  # ----------------------------------------------------------------- saving

  def _header(self) -> Dict[str, Any]:
    return {"format": FORMAT, "version": VERSION,
            "model": self.model.to_dict(), "metadata": self.metadata,
            "cutpoints": self.cutpoints, "calibration": self.calibration}

  def save(self, path: str) -> str:
    """Writes the index to ``path`` atomically; returns the path.

    A temporary file in the same folder is written, flushed and fsynced,
    then renamed over ``path`` (:func:`os.replace`, atomic on POSIX and
    Windows), so ``path`` holds either the previous index or this one.
    Temporary files of earlier saves of ``path`` whose process was killed
    are removed first.
    """
    path = os.path.abspath(os.path.expanduser(path))
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
      raise IndexFileError(f"{folder!r} is not a folder; create it or pass "
                           "another --index path.")
    arrays = {"header": np.asarray(json.dumps(self._header())),
              "embeddings": self.embeddings,
              "ids": np.asarray(self.ids, dtype=str)}
    if self.labels is not None:
      arrays["labels"] = self.labels
    _remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{os.getpid()}.",
                               suffix=_TEMP_SUFFIX, dir=folder)
    try:
      with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
      _replace(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.remove(tmp)
      raise
    with contextlib.suppress(OSError):  # the rename itself to disk
      dfd = os.open(folder, os.O_RDONLY)
      try:
        os.fsync(dfd)
      finally:
        os.close(dfd)
    return path


_TEMP_SUFFIX = ".tmp"


def _temp_prefix(path: str) -> str:
  """The temporary files of a save of ``path``: ``.NAME.PID.XXXXXXXX.tmp``
  in its folder (hidden; ``XXXXXXXX`` from :func:`tempfile.mkstemp`, no
  dots)."""
  return f".{os.path.basename(path)}."


def _process_exists(pid: int) -> bool:
  try:
    os.kill(pid, 0)  # signal 0: an existence check (POSIX)
  except ProcessLookupError:
    return False
  except OSError:  # e.g. PermissionError: it exists, another user's
    return True
  return True


def _remove_stale_temps(path: str) -> None:
  """Removes what interrupted saves of ``path`` left: its own temporary
  files (:func:`_temp_prefix`) whose writing process no longer exists. A
  save in progress in a live process keeps its file; other files are never
  touched. POSIX only (the process check); elsewhere they are left."""
  if os.name != "posix":
    return
  folder, prefix = os.path.dirname(path), _temp_prefix(path)
  try:
    names = os.listdir(folder)
  except OSError:
    return
  for name in names:
    if not (name.startswith(prefix) and name.endswith(_TEMP_SUFFIX)):
      continue
    parts = name[len(prefix):-len(_TEMP_SUFFIX)].split(".")
    if (len(parts) != 2 or not parts[0].isdigit()
        or _process_exists(int(parts[0]))):
      continue
    with contextlib.suppress(OSError):
      os.remove(os.path.join(folder, name))


def _replace(src: str, dst: str) -> None:
  """The rename that publishes a saved index (a seam for fault tests)."""
  os.replace(src, dst)


def load(path: str) -> GalleryIndex:
  """Reads an index saved by :meth:`GalleryIndex.save`.

  Raises:
    IndexFileError: ``path`` is missing, damaged (truncated, overwritten) or
      not an index (another ``.npz``, another file), in one line naming it.
  """
  shown = path
  path = os.path.abspath(os.path.expanduser(path))
  _remove_stale_temps(path)
  if not os.path.isfile(path):
    raise IndexFileError(f"{shown}: no such index file; build one with "
                         "`python -m circle_jax.search build`.")
  try:
    with np.load(path, allow_pickle=False) as z:
      names = set(z.files)
      if "header" not in names:
        raise IndexFileError(
            f"{shown} is not a circle_jax search index (a .npz without its "
            "header); build one with `python -m circle_jax.search build`.")
      header = json.loads(str(z["header"]))
      if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise IndexFileError(f"{shown} is not a circle_jax search index.")
      if header.get("version", 0) > VERSION:
        raise IndexFileError(
            f"{shown} was written by a newer circle_jax (index format "
            f"{header.get('version')}); upgrade circle_jax to read it.")
      embeddings = np.asarray(z["embeddings"], np.float32)
      ids = [str(i) for i in z["ids"]]
      labels = z["labels"] if "labels" in names else None
  except IndexFileError:
    raise
  except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError,
          json.JSONDecodeError, UnicodeDecodeError) as e:
    first = (str(e).splitlines() or [type(e).__name__])[0]
    raise IndexFileError(
        f"{shown} is damaged or not a circle_jax search index ({first}); "
        "build it again or restore a copy.") from e
  try:
    model = ModelRecord.from_dict(header["model"])
    metadata = list(header["metadata"])
    if (embeddings.ndim != 2 or embeddings.shape != (len(ids),
                                                     model.embedding_dim)
        or len(metadata) != len(ids)
        or (labels is not None and labels.shape != (len(ids),))):
      raise ValueError("its arrays do not agree in size")
  except (KeyError, TypeError, ValueError) as e:
    raise IndexFileError(f"{shown} is damaged: {e}; build it again or "
                         "restore a copy.") from e
  index = GalleryIndex(model)
  index.embeddings = embeddings
  index.ids = ids
  index.labels = labels
  index.metadata = metadata
  index.cutpoints = dict(header.get("cutpoints", {}))
  index.calibration = dict(header.get("calibration", {}))
  return index
