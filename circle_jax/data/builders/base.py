"""Shared machinery of the dataset builders: source trees, split plans, errors.

Every builder in :mod:`circle_jax.data.builders` is a
``tfds.core.GeneratorBasedBuilder`` that writes ArrayRecord files read back
with random access (``builder.as_data_source(split)``). Records are::

  {'image': bytes,      # the encoded image exactly as found (JPEG/PNG)
   'label': int64,      # contiguous class id 0..C-1 within the split
   'path': bytes}       # the image's path in the official layout (utf-8)

Images are stored encoded (``tfds.features.Tensor(shape=(), dtype=object)``)
rather than as ``tfds.features.Image``, which needs TensorFlow to encode; they
are decoded with PIL in the input pipeline (:mod:`circle_jax.data.pipeline`).

Order and labels. Builders write with ``disable_shuffling=True`` and integer
keys, so a split is stored sorted by ``(label, path)``: the same files give the
same ArrayRecord order whatever the archive layout or generation order. Labels
are the rank of the class among the split's classes (sorted by the dataset's
own class id), and the number of images of each class is saved in the
``DatasetInfo`` metadata (``info.metadata['splits'][split]['class_counts']``),
so the label of every record is known without reading the records
(:func:`split_labels`).
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import io
import pathlib
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from absl import logging
from etils import epath
import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from circle_jax.data.builders import sources as source_trees
from circle_jax.errors import UserError



class MissingDatasetFilesError(UserError, FileNotFoundError):
  """Raised when the files a dataset needs are neither found nor downloadable."""


@dataclasses.dataclass(frozen=True)
class ExpectedFile:
  """One file (or folder) a builder needs, for the missing-files message.

  Attributes:
    alternatives: paths relative to the manual directory, any one of which
      satisfies the requirement (e.g. an archive or its extracted folder).
    source: where to get it (URL or instructions).
  """

  alternatives: Tuple[str, ...]
  source: str

  def describe(self) -> str:
    alts = " or ".join(f"'{a}'" for a in self.alternatives)
    return f"  - {alts}\n      from: {self.source}"


Layouts = Sequence[Tuple[str, Sequence[ExpectedFile]]]


def missing_files_error(dataset: str, manual_dir, expected: Sequence[ExpectedFile],
                        missing: Sequence[ExpectedFile], hint: str = "",
                        layouts: Optional[Layouts] = None):
  """Builds a :class:`MissingDatasetFilesError` naming every expected file.

  The first line names what is missing, where it was looked for and the fix;
  the next lines list every expected file with its source. A dataset read
  from any of several layouts (``layouts``: ``(name, files)`` pairs, any one
  complete layout will do) lists each of them; ``expected`` and ``missing``
  are then those of the layout closest to what was found.
  """
  what = " and ".join(repr(m.alternatives[0]) for m in missing)
  if layouts:
    what += f" (or another of the {len(layouts)} accepted layouts below)"
  if manual_dir is None:
    first = (f"Dataset '{dataset}': no manual_dir given, and {what} cannot be "
             "downloaded; put the official files in a folder and pass it as "
             "manual_dir (--config.dataset.manual_dir=FOLDER).")
  else:
    first = (f"Dataset '{dataset}': {what} not found in manual_dir "
             f"'{manual_dir}'; put the official files there or point "
             "manual_dir at the folder that holds them.")
  lines = [first, "Missing:", *[m.describe() for m in missing]]
  if layouts:
    lines.append("Accepted layouts (any one, complete):")
    for name, files in layouts:
      lines.append(f"  {name} (all of):")
      lines += ["  " + line for f in files for line in f.describe().split("\n")]
  else:
    lines += ["Expected layout (all of):", *[e.describe() for e in expected]]
  if hint:
    lines.append(hint)
  return MissingDatasetFilesError("\n".join(lines))


# ----------------------------------------------------------------------------
# Split plans and the builder base class.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PlannedImage:
  """One image of a split: where it is and which class it belongs to.

  Attributes:
    source: key of the :class:`~.sources.SourceTree` holding it.
    member: its path inside that tree.
    path: the path written to the record (the official relative path).
    class_key: sortable original class id (int, or tuple for Omniglot).
    super_label: the official id of its super-class (a builder with
      ``SUPER_LABELS``, e.g. SOP's ``super_class_id``), else None.
  """

  source: str
  member: str
  path: str
  class_key: object
  super_label: Optional[int] = None


def finalize_split(images: Sequence[PlannedImage], class_keys=None):
  """Sorts a split by (class, path) and assigns contiguous labels.

  Args:
    images: the split's images.
    class_keys: the label space (default: the split's own classes); splits
      that must share labels (In-Shop query and gallery) pass their union.

  Returns:
    `(images, labels, class_keys)`: images sorted by `(class_key, path)`,
    int64 labels (rank of each image's class among the split's classes) and
    the sorted list of class keys.
  """
  images = sorted(images, key=lambda im: (im.class_key, im.path))
  if class_keys is None:
    class_keys = sorted({im.class_key for im in images})
  rank = {k: i for i, k in enumerate(class_keys)}
  labels = np.array([rank[im.class_key] for im in images], np.int64)
  return images, labels, class_keys


def encode_png(array: np.ndarray) -> bytes:
  """Encodes a uint8 ``[H, W]`` or ``[H, W, 3]`` array as PNG bytes."""
  buf = io.BytesIO()
  Image.fromarray(np.asarray(array, np.uint8)).save(buf, format="PNG")
  return buf.getvalue()


def check_image(data: bytes, where: str) -> None:
  """Parses an encoded image's header (and PNG checksums) with PIL.

  Raises:
    CorruptImageError: naming `where` if PIL cannot identify or verify it.
  """
  try:
    with Image.open(io.BytesIO(data)) as im:
      im.verify()
  except Exception as e:  # PIL raises many types (OSError, SyntaxError, ...).
    raise source_trees.CorruptImageError(
        f"Corrupt or unreadable image {where}: {type(e).__name__}: {e}. "
        "Download the dataset again.") from e


# Keys are spread over the md5-hash range tfds buckets on, so that with
# `disable_shuffling` the writer still spills evenly to its 1000 on-disk
# buckets (a few MiB each) instead of sorting one huge bucket in memory.
_KEY_SPACE = 2**128


def _key(index: int, total: int) -> int:
  return index * (_KEY_SPACE // max(total, 1))


class EncodedImageBuilder(tfds.core.GeneratorBasedBuilder,
                          skip_registration=True):
  """Base builder: encoded images + contiguous labels + paths.

  Subclasses set ``name``, ``SPLITS``, ``EXPECTED_FILES`` and implement
  :meth:`_open_sources` (find or download the source trees) and
  :meth:`_plan` (read the metadata into per-split lists of
  :class:`PlannedImage`). ``EXPECTED_SIZES`` (split -> number of images of the
  complete official dataset) is checked after planning; a mismatch is
  recorded in the metadata and logged, not raised, so partial copies and
  test fixtures still build.

  Construct with ``allow_download=False`` to forbid network access for
  datasets that have a download URL (the manual directory is always tried
  first).
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  SPLITS: Tuple[str, ...] = ("train", "test")
  # Groups of splits labelled in one shared label space.
  SHARED_LABELS: Tuple[Tuple[str, ...], ...] = ()
  EXPECTED_FILES: Tuple[ExpectedFile, ...] = ()
  EXPECTED_SIZES: Mapping[str, int] = {}
  HOMEPAGE = ""
  CITATION = ""
  DESCRIPTION = ""
  # Whether the records carry a "super_label" (int64, the super-class id of
  # the official lists) and the split metadata "class_super_labels" (that
  # of each class, in label order; read by split_super_labels).
  SUPER_LABELS = False

  def __init__(self, *, allow_download: bool = True,
               requested_manual_dir=None, **kwargs):
    self.allow_download = allow_download
    # The manual_dir the user gave, for messages: tfds' download manager
    # reports an empty folder as no manual_dir at all.
    self.requested_manual_dir = requested_manual_dir
    super().__init__(**kwargs)

  # tfds finds a builder's source file (for its checksums.tsv) through
  # `importlib_resources`, a package it does not install; point it at the
  # module file directly.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):  # pylint: disable=no-self-argument
    return epath.Path(inspect.getfile(cls))

  def _info(self):
    features = {
        "image": tfds.features.Tensor(shape=(), dtype=np.object_),
        "label": tfds.features.Tensor(shape=(), dtype=np.int64),
        "path": tfds.features.Text(),
    }
    if self.SUPER_LABELS:
      features["super_label"] = tfds.features.Tensor(shape=(),
                                                     dtype=np.int64)
    return tfds.core.DatasetInfo(
        builder=self,
        description=self.DESCRIPTION,
        features=tfds.features.FeaturesDict(features),
        supervised_keys=("image", "label"),
        homepage=self.HOMEPAGE or None,
        citation=self.CITATION or None,
        disable_shuffling=True,
        metadata=tfds.core.MetadataDict(),
    )

  # -- to implement --------------------------------------------------------

  @abc.abstractmethod
  def _open_sources(self, manual_dir, dl_manager) -> Dict[str, source_trees.SourceTree]:
    """Returns the source trees, or raises MissingDatasetFilesError."""

  @abc.abstractmethod
  def _plan(self, sources: Mapping[str, source_trees.SourceTree]
            ) -> Dict[str, List[PlannedImage]]:
    """Reads the metadata: split name -> images of that split."""

  # -- helpers for subclasses ----------------------------------------------

  def missing(self, manual_dir, missing: Sequence[ExpectedFile], hint=""):
    return missing_files_error(self.name, manual_dir, self.EXPECTED_FILES,
                               missing, hint)

  def single_source(self, manual_dir, key: str, **where
                    ) -> Dict[str, source_trees.SourceTree]:
    """``{key: tree}``: the one source tree that
    :func:`circle_jax.data.builders.sources.find_source` finds in
    ``manual_dir`` with ``where`` (``folder``, ``archives``, ``marker``), or
    the missing-files error naming every expected file."""
    tree = source_trees.find_source(manual_dir, **where)
    if tree is None:
      raise self.missing(manual_dir, self.EXPECTED_FILES)
    return {key: tree}

  @staticmethod
  def manual_dir_of(dl_manager):
    """The manual directory, or None when unset, absent or empty."""
    try:
      return dl_manager.manual_dir
    except (AssertionError, ValueError):
      return None

  # -- tfds hooks ----------------------------------------------------------

  def plan_splits(self, manual_dir, dl_manager=None):
    """Opens the sources and returns `{split: (images, labels, class_keys)}`."""
    if manual_dir is not None:
      manual_dir = pathlib.Path(str(manual_dir))
    sources = self._open_sources(manual_dir, dl_manager)
    plan = self._plan(sources)
    keys = {}
    for group in self.SHARED_LABELS:
      union = sorted({im.class_key for s in group for im in plan[s]})
      keys.update({s: union for s in group})
    return sources, {s: finalize_split(plan[s], keys.get(s))
                     for s in self.SPLITS}

  def _split_generators(self, dl_manager):
    manual_dir = self.manual_dir_of(dl_manager)
    if manual_dir is None and self.requested_manual_dir:
      manual_dir = self.requested_manual_dir
    sources, plans = self.plan_splits(manual_dir, dl_manager)
    meta = {}
    for split, (images, labels, class_keys) in plans.items():
      if not images:
        raise ValueError(
            f"Dataset '{self.name}': split '{split}' has no images; the "
            f"metadata found in {[s.description for s in sources.values()]} "
            "lists none for it.")
      counts = np.bincount(labels, minlength=len(class_keys))
      expected = self.EXPECTED_SIZES.get(split)
      meta[split] = {
          "num_examples": len(images),
          "num_classes": len(class_keys),
          "class_counts": counts.tolist(),
          "class_names": [_class_name(k) for k in class_keys],
          "complete": expected is None or expected == len(images),
      }
      if self.SUPER_LABELS:
        meta[split]["class_super_labels"] = _class_super_labels(
            images, labels, len(class_keys), split)
      if expected is not None and expected != len(images):
        logging.warning(
            "%s/%s: %d images, the complete official dataset has %d.",
            self.name, split, len(images), expected)
    self.info.metadata["splits"] = meta
    return {
        split: self._generate_examples(sources, images, labels)
        for split, (images, labels, _) in plans.items()
    }

  def _generate_examples(self, sources, images, labels):
    total = len(images)
    by_source: Dict[str, Dict[str, List[int]]] = {}
    for i, im in enumerate(images):
      by_source.setdefault(im.source, {}).setdefault(im.member, []).append(i)
    for source_key, members in by_source.items():
      tree = sources[source_key]
      for member, data in tree.iter_files(members):
        for i in members[member]:
          where = f"'{images[i].path}' ({tree.description})"
          check_image(data, where)
          record = {
              "image": data,
              "label": int(labels[i]),
              "path": images[i].path,
          }
          if self.SUPER_LABELS:
            record["super_label"] = int(images[i].super_label)
          yield _key(i, total), record


def _class_super_labels(images, labels, num_classes: int, split: str):
  """The super-label of each class (label order); one line naming a class
  whose images disagree."""
  of = [None] * num_classes
  for im, label in zip(images, labels):
    if of[label] is None:
      of[label] = int(im.super_label)
    elif of[label] != im.super_label:
      raise ValueError(
          f"split '{split}': class {im.class_key} has images of super-classes"
          f" {of[label]} and {im.super_label}; the lists are inconsistent.")
  return of


def _class_name(key) -> str:
  if isinstance(key, tuple):
    return "/".join(str(k) for k in key)
  return str(key)


def split_super_labels(source) -> np.ndarray:
  """The int64 super-label of every record of a split of a builder with
  ``SUPER_LABELS`` (SOP's ``super_class_id``), from the split metadata
  without reading the images (records are sorted by label), else from the
  records' ``super_label``; with :func:`split_labels`, the ``[N, 2]`` labels
  of :class:`circle_jax.data.samplers.HierarchicalSampler`.

  Raises:
    ValueError: the records carry no super-label.
  """
  info = getattr(source, "dataset_info", None)
  meta = getattr(info, "metadata", None) if info is not None else None
  split = str(getattr(source, "split", None))
  if meta and "splits" in meta and "class_super_labels" in meta[
      "splits"].get(split, {}):
    of_class = np.asarray(meta["splits"][split]["class_super_labels"],
                          np.int64)
    return of_class[split_labels(source)]
  if len(source) and "super_label" not in source[0]:
    raise ValueError("The records have no 'super_label': the dataset declares"
                     " no super-classes (SOP does).")
  return np.array([int(source[i]["super_label"]) for i in range(len(source))],
                  np.int64)


def split_labels(source) -> np.ndarray:
  """The int64 label of every record of a split, without reading the images.

  Uses the per-class counts saved by :class:`EncodedImageBuilder` (records
  are sorted by label); any other random-access source of ``{'label': ...}``
  records is read record by record.

  Args:
    source: a data source from :func:`circle_jax.data.load_split` (or any
      sequence of dicts with a ``'label'``).

  Returns:
    int64 array ``[len(source)]``.
  """
  labels = getattr(source, "labels", None)
  if isinstance(labels, np.ndarray) and len(labels) == len(source):
    return labels  # e.g. circle_jax.data.splits.ClassSubset
  info = getattr(source, "dataset_info", None)
  split = getattr(source, "split", None)
  meta = getattr(info, "metadata", None) if info is not None else None
  if meta and "splits" in meta and str(split) in meta["splits"]:
    counts = meta["splits"][str(split)]["class_counts"]
    labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if len(labels) == len(source):
      return labels
  return np.array([int(source[i]["label"]) for i in range(len(source))],
                  np.int64)
