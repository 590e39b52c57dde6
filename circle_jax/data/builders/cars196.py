"""Stanford Cars-196 with the zero-shot split: classes 1-98 train, 99-196 test.

The official URLs are offline; users have one of three layouts, all read
here, each giving the same 196 classes (the class ids 1..196 of
``cars_meta.mat``'s ``class_names``) and the same split:

* ``official``: ``car_ims.tgz`` (or ``car_ims/``) and ``cars_annos.mat``
  (all 16,185 images; fields ``relative_im_path``, ``class``).
* ``tfds/torchvision``: ``cars_train.tgz`` and ``cars_test.tgz`` (or their
  folders), the devkit's ``cars_train_annos.mat`` (in ``devkit/``, beside the
  archives, or inside ``car_devkit.tgz``) and
  ``cars_test_annos_withlabels.mat`` (fields ``fname``, ``class``): what
  ``tfds.image_classification.Cars196`` downloads and what
  ``torchvision.datasets.StanfordCars`` reads under ``stanford_cars/``. The
  devkit's ``cars_meta.mat`` (class names only) is not needed.
* ``pytorch-metric-learning``: the class-folder mirror that
  ``pytorch_metric_learning.datasets.Cars196`` (2.9) downloads from Kaggle
  (``jutrera/stanford-car-dataset-by-classes-folder``) and extracts:
  ``names.csv`` (one class name per line, class id = line number),
  ``anno_train.csv`` / ``anno_test.csv`` (``fname,x1,y1,x2,y2,class``) and
  ``car_data/car_data/{train,test}/<class name, '/' -> '-'>/<fname>``; or
  that zip itself.

``manual_dir`` may also be the extracted image folder (``car_ims/``,
``cars_train/``, ...): the metadata beside it is found.
"""

from __future__ import annotations

import io
import pathlib
import zipfile
from typing import Dict, List, Optional, Tuple

import numpy as np
import scipy.io

from circle_jax.data.builders import base
from circle_jax.data.builders import sources as source_trees

_SOURCE = ("the Stanford Cars page (https://ai.stanford.edu/~jkrause/cars/"
           "car_dataset.html, now offline; mirrors: search 'car_ims.tgz "
           "cars_annos.mat')")
_TFDS_SOURCE = ("tfds's/torchvision's copies of the Stanford Cars files "
                "(search 'cars_train.tgz cars_test_annos_withlabels.mat "
                "car_devkit.tgz')")
_PML_SOURCE = ("the Kaggle mirror that pytorch-metric-learning downloads "
               "(https://www.kaggle.com/datasets/jutrera/"
               "stanford-car-dataset-by-classes-folder)")
_PML_ZIPS = ("stanford-car-dataset-by-classes-folder.zip",
             "stanford-car-dataset-by-classes-folder", "archive.zip")
_PML_CSVS = ("names.csv", "anno_train.csv", "anno_test.csv")
# Folders manual_dir may be, whose metadata sits beside them.
_INNER_FOLDERS = ("car_ims", "cars_train", "cars_test", "devkit", "car_data")

LAYOUTS = (
    ("official", (
        base.ExpectedFile(("car_ims.tgz", "car_ims/"), _SOURCE),
        base.ExpectedFile(("cars_annos.mat",), _SOURCE))),
    ("tfds/torchvision", (
        base.ExpectedFile(("cars_train.tgz", "cars_train/"), _TFDS_SOURCE),
        base.ExpectedFile(("cars_test.tgz", "cars_test/"), _TFDS_SOURCE),
        base.ExpectedFile(("devkit/cars_train_annos.mat",
                           "cars_train_annos.mat", "car_devkit.tgz"),
                          _TFDS_SOURCE),
        base.ExpectedFile(("cars_test_annos_withlabels.mat",),
                          _TFDS_SOURCE + "; the devkit's cars_test_annos.mat"
                          " has no labels"))),
    ("pytorch-metric-learning", (
        base.ExpectedFile(("names.csv + anno_train.csv + anno_test.csv + "
                           "car_data/car_data/", _PML_ZIPS[0]), _PML_SOURCE),)),
)


def _search_dirs(manual_dir) -> List[pathlib.Path]:
  """Where the files may be: manual_dir, torchvision's ``stanford_cars/``
  in it, and its parent when manual_dir is an extracted inner folder."""
  if manual_dir is None:
    return []
  root = pathlib.Path(manual_dir)
  dirs = [root]
  if (root / "stanford_cars").is_dir():
    dirs.append(root / "stanford_cars")
  if root.name in _INNER_FOLDERS:
    dirs.append(root.parent)
  return dirs


def _first_file(dirs, names) -> Optional[Tuple[source_trees.SourceTree, str]]:
  """``(tree, member)`` of the first of ``dir/name`` that is a file."""
  for d in dirs:
    for name in names:
      path = d / name
      if path.is_file():
        return source_trees.DirTree(path.parent), path.name
  return None


def _first_source(dirs, folder, archives) -> Optional[source_trees.SourceTree]:
  for d in dirs:
    tree = source_trees.find_source(d, folder=folder, archives=archives)
    if tree is not None:
      return tree
  return None


def _devkit_annos(dirs) -> Optional[Tuple[source_trees.SourceTree, str]]:
  found = _first_file(dirs, ("devkit/cars_train_annos.mat",
                             "cars_train_annos.mat"))
  if found is not None:
    return found
  for d in dirs:
    if (d / "car_devkit.tgz").is_file():
      tree = source_trees.open_tree(d / "car_devkit.tgz")
      if tree.exists("devkit/cars_train_annos.mat"):
        return tree, "devkit/cars_train_annos.mat"
  return None


def _pml_tree(dirs) -> Optional[Tuple[source_trees.SourceTree, str]]:
  """The mirror's folder or zip, and the prefix of its files in it."""
  for d in dirs:
    if all((d / name).is_file() for name in _PML_CSVS):
      return source_trees.DirTree(d), ""
  for d in dirs:
    for name in _PML_ZIPS:
      if (d / name).is_file() and zipfile.is_zipfile(d / name):
        tree = source_trees.ZipTree(d / name, extract_to=d)
        for prefix in ["", *sorted({n.split("/")[0] + "/"
                                    for n in tree.names() if "/" in n})]:
          if all(tree.exists(prefix + c) for c in _PML_CSVS):
            return tree, prefix
  return None


def _read_mat(tree, rel: str, path_field: str):
  """``(paths, class ids)`` of a Cars annotation ``.mat`` file."""
  try:
    mat = scipy.io.loadmat(io.BytesIO(tree.read_bytes(rel)), squeeze_me=True)
    ann = np.atleast_1d(mat["annotations"])
    paths = [str(p) for p in ann[path_field]]
    class_ids = np.asarray(ann["class"], dtype=np.int64)
  except Exception as e:  # scipy raises MatReadError, ValueError, ...
    raise ValueError(
        f"Cannot read {rel} in {tree.description} ({type(e).__name__}: {e}); "
        "expected a Stanford Cars annotation file with an 'annotations' "
        f"struct array (fields {path_field}, class, ...).") from e
  return paths, class_ids


def _read_csv(tree, rel: str) -> List[Tuple[str, int]]:
  """``[(fname, class id)]`` of the mirror's ``anno_{train,test}.csv``."""
  rows = []
  text = tree.read_bytes(rel).decode("utf-8")
  for n, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    parts = line.split(",")
    try:
      rows.append((parts[0].strip(), int(parts[-1])))
    except (IndexError, ValueError):
      raise ValueError(
          f"{rel} line {n} in {tree.description}: expected "
          f"'fname,x1,y1,x2,y2,class', got {line!r}.") from None
  return rows


class Cars196(base.EncodedImageBuilder, skip_registration=True):
  """Stanford Cars-196 (Krause et al. 2013), zero-shot split.

  Manual directory: any one of the three layouts of :data:`LAYOUTS` (see the
  module's docstring). Train: classes 1-98 (8,054 images); test: classes
  99-196 (8,131 images), from the train and test images of the
  classification benchmark together (its per-image split is not used).
  Records' ``path`` is the image's path in the layout read (``car_ims/
  000001.jpg``, ``cars_train/00001.jpg``, ``car_data/car_data/train/...``).
  """

  name = "cars196"
  HOMEPAGE = "https://ai.stanford.edu/~jkrause/cars/car_dataset.html"
  DESCRIPTION = "Stanford Cars-196, class-disjoint split 98/98."
  CITATION = ("@inproceedings{KrauseStarkDengFei-Fei_3DRR2013, title={3D "
              "Object Representations for Fine-Grained Categorization}, "
              "author={Krause, J. and Stark, M. and Deng, J. and Fei-Fei, L.},"
              " booktitle={3dRR workshop, ICCV}, year={2013}}")
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Put one of: car_ims.tgz (or car_ims/) and cars_annos.mat; "
      "cars_train.tgz, cars_test.tgz, the devkit (devkit/ or car_devkit.tgz) "
      "and cars_test_annos_withlabels.mat; or pytorch-metric-learning's "
      f"extracted Kaggle mirror, in the manual directory. Source: {_SOURCE}.")
  EXPECTED_FILES = LAYOUTS[0][1]
  EXPECTED_SIZES = {"train": 8054, "test": 8131}
  NUM_TRAIN_CLASSES = 98

  def _open_sources(self, manual_dir, dl_manager):
    dirs = _search_dirs(manual_dir)
    found = {
        "official": (
            _first_source(dirs, "car_ims", ("car_ims.tgz", "car_ims.tar.gz",
                                            "car_ims.tar")),
            _first_file(dirs, ("cars_annos.mat", "car_ims/cars_annos.mat"))),
        "tfds/torchvision": (
            _first_source(dirs, "cars_train", ("cars_train.tgz",
                                               "cars_train.tar.gz")),
            _first_source(dirs, "cars_test", ("cars_test.tgz",
                                              "cars_test.tar.gz")),
            _devkit_annos(dirs),
            _first_file(dirs, ("cars_test_annos_withlabels.mat",
                               "devkit/cars_test_annos_withlabels.mat"))),
        "pytorch-metric-learning": (_pml_tree(dirs),),
    }
    for layout, parts in found.items():
      if all(p is not None for p in parts):
        self._layout = layout
        return self._sources(layout, parts)
    # The layout closest to complete names what it misses; all are listed.
    name, files = max(LAYOUTS, key=lambda lf: sum(
        p is not None for p in found[lf[0]]) / len(lf[1]))
    missing = [f for f, p in zip(files, found[name]) if p is None]
    raise base.missing_files_error(self.name, manual_dir, files, missing,
                                   layouts=LAYOUTS)

  def _sources(self, layout, parts) -> Dict[str, source_trees.SourceTree]:
    if layout == "official":
      images, (annos, self._annos_name) = parts
      return {"images": images, "annos": annos}
    if layout == "tfds/torchvision":
      train, test, (train_annos, self._train_annos), (
          test_annos, self._test_annos) = parts
      return {"train": train, "test": test, "train_annos": train_annos,
              "test_annos": test_annos}
    (tree, self._prefix), = parts
    return {"mirror": tree}

  def _plan(self, sources):
    rows = []  # (source, member, class id)
    if self._layout == "official":
      paths, ids = _read_mat(sources["annos"], self._annos_name,
                             "relative_im_path")
      rows = [("images", p, c) for p, c in zip(paths, ids)]
    elif self._layout == "tfds/torchvision":
      for split, annos in (("train", self._train_annos),
                           ("test", self._test_annos)):
        paths, ids = _read_mat(sources[f"{split}_annos"], annos, "fname")
        rows += [(split, f"cars_{split}/{p}", c) for p, c in zip(paths, ids)]
    else:
      tree, prefix = sources["mirror"], self._prefix
      names = [line.strip() for line in tree.read_bytes(
          prefix + "names.csv").decode("utf-8").splitlines()]
      for split in ("train", "test"):
        for fname, c in _read_csv(tree, f"{prefix}anno_{split}.csv"):
          if not 1 <= c <= len(names):
            raise ValueError(
                f"{prefix}anno_{split}.csv in {tree.description}: class {c} "
                f"of {fname!r} is not one of the {len(names)} classes of "
                "names.csv; the copy is inconsistent.")
          folder = names[c - 1].replace("/", "-")
          rows.append(("mirror", f"{prefix}car_data/car_data/{split}/"
                       f"{folder}/{fname}", c))
    splits = {"train": [], "test": []}
    for source, member, class_id in rows:
      split = "train" if class_id <= self.NUM_TRAIN_CLASSES else "test"
      path = member
      if self._layout == "pytorch-metric-learning":
        path = member[len(self._prefix):]
      splits[split].append(base.PlannedImage(
          source=source, member=member, path=path, class_key=int(class_id)))
    return splits
