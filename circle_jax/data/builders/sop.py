"""Stanford Online Products with the official class-disjoint split."""

from __future__ import annotations

import tensorflow_datasets as tfds

from circle_jax.data.builders import base

_FOLDER = "Stanford_Online_Products"
_SOURCE = ("https://cvgl.stanford.edu/projects/lifted_struct/ "
           "(Stanford_Online_Products.zip, 2.9 GB)")


class Sop(base.EncodedImageBuilder, skip_registration=True):
  """Stanford Online Products (Oh Song et al. 2016), official split.

  Manual directory: ``Stanford_Online_Products.zip`` or its extracted
  ``Stanford_Online_Products/`` folder. ``Ebay_train.txt`` (11,318 classes,
  59,551 images) and ``Ebay_test.txt`` (11,316 classes, 60,502 images) list
  ``image_id class_id super_class_id path`` after a header line. The
  records keep ``super_class_id`` (1..12: bicycle, cabinet, ...) as
  ``super_label``, for :class:`circle_jax.data.samplers.HierarchicalSampler`
  (:func:`circle_jax.data.split_super_labels`).
  """

  name = "sop"
  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.0.0": "Initial release.",
                   "1.1.0": "Records keep super_class_id as super_label."}
  SUPER_LABELS = True
  HOMEPAGE = "https://cvgl.stanford.edu/projects/lifted_struct/"
  DESCRIPTION = "Stanford Online Products, official class-disjoint split."
  CITATION = ("@inproceedings{songCVPR16, title={Deep Metric Learning via "
              "Lifted Structured Feature Embedding}, author={Oh Song, H. and "
              "Xiang, Y. and Jegelka, S. and Savarese, S.}, booktitle={CVPR},"
              " year={2016}}")
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      f"Put Stanford_Online_Products.zip (or its extracted {_FOLDER}/ folder) "
      f"in the manual directory. Source: {_SOURCE}.")
  EXPECTED_FILES = (base.ExpectedFile(
      ("Stanford_Online_Products.zip",
       f"{_FOLDER}/Ebay_train.txt + Ebay_test.txt + image folders"), _SOURCE),)
  EXPECTED_SIZES = {"train": 59551, "test": 60502}

  def _open_sources(self, manual_dir, dl_manager):
    return self.single_source(
        manual_dir, "sop", folder=_FOLDER, marker="Ebay_train.txt",
        archives=("Stanford_Online_Products.zip",))

  def _plan(self, sources):
    tree = sources["sop"]
    return {split: _read_list(tree, f"{_FOLDER}/Ebay_{split}.txt")
            for split in ("train", "test")}


def _read_list(tree, rel):
  try:
    lines = tree.read_bytes(rel).decode("utf-8").splitlines()
  except KeyError:
    raise base.MissingDatasetFilesError(
        f"{rel} not found in {tree.description}; the copy of Stanford Online "
        f"Products is incomplete. Get it from {_SOURCE}.") from None
  header = lines[0].split() if lines else []
  if header[:2] != ["image_id", "class_id"]:
    raise ValueError(f"{rel}: expected the header 'image_id class_id "
                     f"super_class_id path', got {lines[:1]}.")
  out = []
  for n, line in enumerate(lines[1:], 2):
    if not line.strip():
      continue
    parts = line.split()
    if len(parts) != 4:
      raise ValueError(f"{rel} line {n}: expected 4 fields, got {line!r}.")
    path = parts[3]
    out.append(base.PlannedImage(source="sop", member=f"{_FOLDER}/{path}",
                                 path=path, class_key=int(parts[1]),
                                 super_label=int(parts[2])))
  return out
