"""Stanford Cars-196 with the zero-shot split: classes 1-98 train, 99-196 test."""

from __future__ import annotations

import io

import numpy as np
import scipy.io

from circle_jax.data.builders import base

_SOURCE = ("the Stanford Cars page (https://ai.stanford.edu/~jkrause/cars/"
           "car_dataset.html, now offline; mirrors: search 'car_ims.tgz "
           "cars_annos.mat')")


class Cars196(base.EncodedImageBuilder, skip_registration=True):
  """Stanford Cars-196 (Krause et al. 2013), zero-shot split.

  Manual directory: ``car_ims.tgz`` (or its extracted ``car_ims/`` folder) and
  ``cars_annos.mat`` (the annotation file covering all 16,185 images; fields
  ``relative_im_path``, ``class`` 1..196, ``test``). Train: classes 1-98
  (8,054 images); test: classes 99-196 (8,131 images). The per-image
  ``test`` flag of the classification benchmark is not used.
  """

  name = "cars196"
  HOMEPAGE = "https://ai.stanford.edu/~jkrause/cars/car_dataset.html"
  DESCRIPTION = "Stanford Cars-196, class-disjoint split 98/98."
  CITATION = ("@inproceedings{KrauseStarkDengFei-Fei_3DRR2013, title={3D "
              "Object Representations for Fine-Grained Categorization}, "
              "author={Krause, J. and Stark, M. and Deng, J. and Fei-Fei, L.},"
              " booktitle={3dRR workshop, ICCV}, year={2013}}")
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Put car_ims.tgz (or the extracted car_ims/ folder) and cars_annos.mat "
      f"in the manual directory. Source: {_SOURCE}.")
  EXPECTED_FILES = (
      base.ExpectedFile(("car_ims.tgz", "car_ims/"), _SOURCE),
      base.ExpectedFile(("cars_annos.mat",), _SOURCE),
  )
  EXPECTED_SIZES = {"train": 8054, "test": 8131}
  NUM_TRAIN_CLASSES = 98

  def _open_sources(self, manual_dir, dl_manager):
    images = base.find_source(manual_dir, folder="car_ims",
                              archives=("car_ims.tgz", "car_ims.tar.gz",
                                        "car_ims.tar"))
    annos = None
    if manual_dir is not None:
      for cand in ("cars_annos.mat", "car_ims/cars_annos.mat"):
        path = manual_dir / cand
        if path.is_file():
          annos = base.DirTree(path.parent)
          self._annos_name = path.name
          break
    missing = [f for f, found in zip(self.EXPECTED_FILES, (images, annos))
               if found is None]
    if missing:
      raise self.missing(manual_dir, missing)
    return {"images": images, "annos": annos}

  def _plan(self, sources):
    tree = sources["annos"]
    where = f"cars_annos.mat in {tree.description}"
    try:
      mat = scipy.io.loadmat(io.BytesIO(tree.read_bytes(self._annos_name)),
                             squeeze_me=True)
      ann = np.atleast_1d(mat["annotations"])
      paths = [str(p) for p in ann["relative_im_path"]]
      class_ids = np.asarray(ann["class"], dtype=np.int64)
    except Exception as e:  # scipy raises MatReadError, ValueError, ...
      raise ValueError(
          f"Cannot read {where} ({type(e).__name__}: {e}); expected the "
          "official annotation file with an 'annotations' struct array "
          "(fields relative_im_path, class, ...).") from e
    splits = {"train": [], "test": []}
    for rel, class_id in zip(paths, class_ids):
      split = "train" if class_id <= self.NUM_TRAIN_CLASSES else "test"
      splits[split].append(base.PlannedImage(
          source="images", member=rel, path=rel, class_key=int(class_id)))
    return splits
