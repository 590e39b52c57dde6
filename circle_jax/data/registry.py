"""Dataset names used by configs -> builders, split metadata and defaults."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import types
from typing import Mapping, Optional, Tuple

from absl import logging
import filelock
import tensorflow_datasets as tfds

from circle_jax.data import augment
from circle_jax.data import builders
from circle_jax.data import integrity


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """What a trainer needs to know about a dataset before reading it.

  Attributes:
    name: the config name (``cub200``, ``cars196``, ...).
    num_train_classes: classes of the train split (the proxy count).
    num_test_classes: classes of the evaluation split(s).
    num_images: split name -> number of images of the complete dataset:
      the builder's ``EXPECTED_SIZES``, which preparation checks (read-only).
    channels: 3 (RGB) or 1 (grayscale).
    train_split: the split to train on ('train').
    eval_splits: ``('test',)``, or ``('query', 'gallery')`` for In-Shop
      (retrieve each query among the gallery).
    preprocess: default preset kwargs for :func:`augment.get_preprocess`
      (``preset``, ``image_size``, ``resize_size``, ``scale``).
    ks: the Recall@K cut-offs the literature reports for the dataset,
      ``(1, 2, 4, 8)`` for CUB/Cars/Omniglot/digits, ``(1, 10, 100, 1000)``
      for SOP, ``(1, 10, 20, 30, 40)`` for In-Shop. Their only home:
      ``circle_jax.evaluation.DEFAULT_KS`` and ``default_ks`` read them here.
    ks_name: the dataset's key in ``circle_jax.evaluation.DEFAULT_KS`` (its
      name).
    needs_files: False for ``digits`` (scikit-learn's) and ``omniglot_small``
      (its archives ship with the package).
    train_superclasses: the class count of each superclass of the train
      split, in label order (its classes are consecutive labels), where the
      test classes are of superclasses never trained on: ``omniglot_small``'s
      five alphabets. Empty: no superclass is declared. Read by the
      superclass-disjoint validation split
      (``dataset.validation_by='superclass'``); a test checks it against the
      prepared split's class names.
    superclass_name: what a superclass is called (``alphabet``).
  """

  name: str
  num_train_classes: int
  num_test_classes: int
  channels: int
  train_split: str
  eval_splits: Tuple[str, ...]
  preprocess: Mapping[str, object]
  ks: Tuple[int, ...]
  needs_files: bool = True
  train_superclasses: Tuple[int, ...] = ()
  superclass_name: str = "superclass"

  @property
  def super_labels(self) -> bool:
    """Whether its records carry the official super-class of their class
    (``super_label``, :func:`circle_jax.data.split_super_labels`: SOP)."""
    return bool(builders.BUILDERS[self.name].SUPER_LABELS)

  @property
  def num_images(self) -> Mapping[str, int]:
    return types.MappingProxyType(
        dict(builders.BUILDERS[self.name].EXPECTED_SIZES))

  @property
  def ks_name(self) -> str:
    return self.name

  @property
  def splits(self) -> Tuple[str, ...]:
    return (self.train_split,) + self.eval_splits

  @property
  def eval_preprocess_name(self) -> str:
    return str(self.preprocess["preset"])

  def get_preprocess(self, *, train: bool, **overrides) -> augment.Preprocess:
    """This dataset's default preset (train or eval), with `overrides` (None:
    the dataset's value)."""
    kwargs = dict(self.preprocess)
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return augment.get_preprocess(kwargs.pop("preset"), train=train, **kwargs)


_RGB = dict(preset="bninception", image_size=224, resize_size=256,
            scale=(0.16, 1.0))

DATASETS = {
    s.name: s for s in (
        # CUB and Cars split by class id; their builders hold the boundary.
        DatasetSpec("cub200", builders.Cub200.NUM_TRAIN_CLASSES, 100, 3,
                    "train", ("test",), _RGB, (1, 2, 4, 8)),
        DatasetSpec("cars196", builders.Cars196.NUM_TRAIN_CLASSES, 98, 3,
                    "train", ("test",), _RGB, (1, 2, 4, 8)),
        DatasetSpec("sop", 11318, 11316, 3, "train", ("test",), _RGB,
                    (1, 10, 100, 1000)),
        DatasetSpec("inshop", 3997, 3985, 3, "train", ("query", "gallery"),
                    _RGB, (1, 10, 20, 30, 40)),
        DatasetSpec("omniglot", 964, 659, 1, "train", ("test",),
                    dict(preset="grayscale", image_size=28), (1, 2, 4, 8)),
        DatasetSpec("omniglot_small", 136, 106, 1, "train", ("test",),
                    dict(preset="grayscale", image_size=28), (1, 2, 4, 8),
                    needs_files=False,
                    # Balinese, Early_Aramaic, Greek, Korean, Latin.
                    train_superclasses=(24, 22, 24, 40, 26),
                    superclass_name="alphabet"),
        DatasetSpec("digits", 5, 5, 1, "train", ("test",),
                    dict(preset="grayscale", image_size=16), (1, 2, 4, 8),
                    needs_files=False),
        # Smooth-AP's split and its Recall@K cut-offs (Brown et al. 2020).
        DatasetSpec("inaturalist2018", 5690, 2452, 3, "train", ("test",),
                    _RGB, (1, 4, 16, 32)),
    )
}


def _spec(name) -> DatasetSpec:
  if name not in DATASETS:
    raise ValueError(f"Unknown dataset {name!r}; known datasets: "
                     f"{', '.join(DATASETS)}.")
  return DATASETS[name]


def get_dataset_info(name: str) -> DatasetSpec:
  """The :class:`DatasetSpec` of a dataset name.

  Raises:
    ValueError: for an unknown name, listing the known ones.
  """
  return _spec(name)


def get_builder(name: str, *, data_dir, download: bool = False,
                **kwargs) -> builders.EncodedImageBuilder:
  """The tfds builder of `name` writing ArrayRecord files under `data_dir`."""
  _spec(name)
  return builders.BUILDERS[name](data_dir=str(data_dir),
                                 file_format="array_record",
                                 allow_download=download, **kwargs)


def load_split(name: str, split: str, *, data_dir,
               manual_dir: Optional[str] = None, download: bool = False):
  """Random-access source of one split; builds the dataset on first use.

  The first call for a dataset runs the tfds ``download_and_prepare``: it
  reads the official files from `manual_dir` (or downloads them, for
  Omniglot only and only when `download` is True) and writes ArrayRecord
  files to ``<data_dir>/<name>/<version>/`` (1.0.0; SOP 1.1.0). Later calls
  only open those files.
  Jobs sharing `data_dir` prepare a dataset once: the others wait for the
  lock ``<data_dir>/<name>.lock`` and then read the result.

  Args:
    name: a dataset name (see :data:`DATASETS`).
    split: 'train' or 'test' (In-Shop: 'train', 'query' or 'gallery').
    data_dir: where the prepared dataset lives.
    manual_dir: folder holding the official archives or their extracted
      folders (default ``<data_dir>/downloads/manual``).
    download: allow downloading the files that have a public URL.

  Returns:
    A ``tfds`` ``ArrayRecordDataSource`` (``len()``, ``source[i]``,
    ``source.__getitems__(indices)``) of records ``{'image': bytes (encoded
    JPEG/PNG), 'label': int (0..C-1 within the split; In-Shop query and
    gallery share labels), 'path': bytes (utf-8 official relative path)}``,
    sorted by ``(label, path)``. :func:`circle_jax.data.split_labels` gives
    all labels without reading images.

  Raises:
    ValueError: unknown dataset or split.
    MissingDatasetFilesError: the files are missing (the message lists every
      expected file and where to get it).
    CorruptImageError: an image or archive cannot be read (names it).
    CorruptPreparedDataError: a prepared file is truncated or damaged (names
      it and the command that rebuilds the prepared folder).
  """
  spec = _spec(name)
  if split not in spec.splits:
    raise ValueError(f"Dataset {name!r} has splits {', '.join(spec.splits)}; "
                     f"got {split!r}.")
  manual_dir = (str(pathlib.Path(manual_dir).expanduser()) if manual_dir
                else None)
  builder = get_builder(name, data_dir=data_dir, download=download,
                        requested_manual_dir=manual_dir)
  if not builder.is_prepared():
    if manual_dir is not None and pathlib.Path(manual_dir).exists() and (
        not pathlib.Path(manual_dir).is_dir()):
      raise builders.MissingDatasetFilesError(
          f"Dataset {name!r}: manual_dir '{manual_dir}' is a file; give the "
          "folder that holds the official files "
          "(--config.dataset.manual_dir).")
    if manual_dir is not None and not pathlib.Path(manual_dir).is_dir():
      raise builders.MissingDatasetFilesError(
          f"Dataset {name!r}: manual_dir '{manual_dir}' does not exist; "
          "create it and put the official files there, or fix the path "
          "(--config.dataset.manual_dir).")
    builder = _prepare(name, builder, data_dir=data_dir,
                       manual_dir=manual_dir, download=download)
  source = builder.as_data_source(split)
  integrity.check_split(builder, split)  # a damaged file fails here, named
  return source


def preparation_lock(name: str, *, data_dir) -> filelock.FileLock:
  """The lock that one job holds while it prepares dataset ``name`` in
  ``data_dir``: the file ``<data_dir>/<name>.lock``, beside the dataset's
  folder (released by the system if its holder dies)."""
  data_dir = pathlib.Path(data_dir)
  data_dir.mkdir(parents=True, exist_ok=True)
  return filelock.FileLock(str(data_dir / f"{name}.lock"))


def _prepare(name, builder, *, data_dir, manual_dir, download):
  """Prepares the dataset once however many jobs share ``data_dir``.

  A sweep's first jobs start together: each takes :func:`preparation_lock`;
  the first prepares (tfds writes into an ``incomplete.*`` folder renamed
  when complete), the others wait, then find the dataset prepared and only
  read it. Returns a builder of the prepared dataset.
  """
  lock = preparation_lock(name, data_dir=data_dir)
  try:
    lock.acquire(timeout=0)
  except filelock.Timeout:
    logging.info("Waiting for another job preparing dataset %r in %s (%s).",
                 name, data_dir, lock.lock_file)
    lock.acquire()
  try:
    builder = get_builder(name, data_dir=data_dir, download=download,
                          requested_manual_dir=manual_dir)
    if not builder.is_prepared():  # else another job prepared it meanwhile
      config = tfds.download.DownloadConfig(manual_dir=manual_dir)
      # tfds prints its own progress to stdout; keep stdout for results.
      with contextlib.redirect_stdout(io.StringIO()):
        builder.download_and_prepare(download_config=config)
  finally:
    lock.release()
  return builder


def is_prepared(name: str, *, data_dir) -> bool:
  """Whether :func:`load_split` will only open files (no preparation)."""
  return get_builder(name, data_dir=data_dir).is_prepared()
