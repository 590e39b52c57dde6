"""CUB-200-2011 with the zero-shot split: classes 1-100 train, 101-200 test."""

from __future__ import annotations

from circle_jax.data.builders import base

_FOLDER = "CUB_200_2011"
_SOURCE = ("https://www.vision.caltech.edu/datasets/cub_200_2011/ "
           "(CUB_200_2011.tgz, 1.1 GB)")


class Cub200(base.EncodedImageBuilder, skip_registration=True):
  """Caltech-UCSD Birds-200-2011 (Wah et al. 2011), zero-shot split.

  Manual directory: ``CUB_200_2011.tgz`` or its extracted ``CUB_200_2011/``
  folder (``images.txt``, ``image_class_labels.txt``, ``images/``). Train:
  classes 1-100 (5,864 images); test: classes 101-200 (5,924 images), as in
  Oh Song et al. 2016 and every paper since. The official
  ``train_test_split.txt`` (a per-image split) is not used.
  """

  name = "cub200"
  HOMEPAGE = "https://www.vision.caltech.edu/datasets/cub_200_2011/"
  DESCRIPTION = "CUB-200-2011 birds, class-disjoint split 100/100."
  CITATION = ("@techreport{WahCUB_200_2011, title={The Caltech-UCSD "
              "Birds-200-2011 Dataset}, author={Wah, C. and Branson, S. and "
              "Welinder, P. and Perona, P. and Belongie, S.}, year={2011}, "
              "institution={California Institute of Technology}}")
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      f"Put CUB_200_2011.tgz (or its extracted {_FOLDER}/ folder) in the "
      f"manual directory. Source: {_SOURCE}.")
  EXPECTED_FILES = (base.ExpectedFile(
      ("CUB_200_2011.tgz", f"{_FOLDER}/images.txt + image_class_labels.txt "
       "+ images/"), _SOURCE),)
  EXPECTED_SIZES = {"train": 5864, "test": 5924}
  NUM_TRAIN_CLASSES = 100

  def _open_sources(self, manual_dir, dl_manager):
    return self.single_source(
        manual_dir, "cub", folder=_FOLDER, marker="images.txt",
        archives=("CUB_200_2011.tgz", "CUB_200_2011.tar.gz",
                  "CUB_200_2011.tar"))

  def _plan(self, sources):
    tree = sources["cub"]
    images = _read_table(tree, f"{_FOLDER}/images.txt")
    classes = _read_table(tree, f"{_FOLDER}/image_class_labels.txt")
    splits = {"train": [], "test": []}
    for image_id, rel in images.items():
      if image_id not in classes:
        raise ValueError(
            f"{_FOLDER}/image_class_labels.txt in {tree.description} has no "
            f"class for image id {image_id} ({rel}); the copy is inconsistent.")
      class_id = int(classes[image_id])
      split = "train" if class_id <= self.NUM_TRAIN_CLASSES else "test"
      splits[split].append(base.PlannedImage(
          source="cub", member=f"{_FOLDER}/images/{rel}",
          path=f"images/{rel}", class_key=class_id))
    return splits


def _read_table(tree, rel):
  """Reads an `<id> <value>` text file into a dict."""
  try:
    text = tree.read_bytes(rel).decode("utf-8")
  except KeyError:
    raise base.MissingDatasetFilesError(
        f"{rel} not found in {tree.description}; the copy of CUB-200-2011 is "
        f"incomplete. Get it from {_SOURCE}.") from None
  table = {}
  for n, line in enumerate(text.splitlines(), 1):
    if not line.strip():
      continue
    parts = line.split(maxsplit=1)
    if len(parts) != 2:
      raise ValueError(f"{rel} line {n}: expected '<id> <value>', got {line!r}.")
    table[int(parts[0])] = parts[1].strip()
  return table
