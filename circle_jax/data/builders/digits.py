"""scikit-learn's bundled 8x8 digits: digits 0-4 train, 5-9 test."""

from __future__ import annotations

import numpy as np

from circle_jax.data.builders import base
from circle_jax.data.builders import sources as source_trees


class Digits(base.EncodedImageBuilder, skip_registration=True):
  """The UCI optical digits bundled with scikit-learn (no files needed).

  1,797 8x8 grayscale images with values 0..16, rescaled to 0..255
  (``round(v * 255 / 16)``) and stored as PNG. Train: digits 0-4 (901
  images, labels 0-4); test: digits 5-9 (896 images, labels 0-4 for digits
  5-9). Paths are ``digits/<index in load_digits()>``.
  """

  name = "digits"
  DESCRIPTION = "scikit-learn digits, class-disjoint split 0-4 / 5-9."
  HOMEPAGE = ("https://archive.ics.uci.edu/dataset/80/optical+recognition+of"
              "+handwritten+digits")
  EXPECTED_SIZES = {"train": 901, "test": 896}

  def _open_sources(self, manual_dir, dl_manager):
    from sklearn import datasets  # pylint: disable=g-import-not-at-top
    d = datasets.load_digits()
    pixels = np.round(d.images * (255.0 / 16.0)).astype(np.uint8)
    return {"digits": _ArrayTree(pixels, d.target)}

  def _plan(self, sources):
    tree = sources["digits"]
    splits = {"train": [], "test": []}
    for i, t in enumerate(tree.targets):
      path = f"digits/{i:04d}"
      splits["train" if t < 5 else "test"].append(base.PlannedImage(
          source="digits", member=path, path=path, class_key=int(t)))
    return splits


class _ArrayTree(source_trees.SourceTree):
  """In-memory images, encoded to PNG on read."""

  description = "sklearn.datasets.load_digits()"

  def __init__(self, pixels, targets):
    self.pixels, self.targets = pixels, targets

  def names(self):
    return [f"digits/{i:04d}" for i in range(len(self.pixels))]

  def read_bytes(self, rel):
    return base.encode_png(self.pixels[int(rel.split("/")[1])])

  def iter_files(self, rels):
    for rel in rels:
      yield rel, self.read_bytes(rel)
