"""DeepFashion In-shop Clothes Retrieval: train / query / gallery."""

from __future__ import annotations

import pathlib

from circle_jax.data.builders import base
from circle_jax.data.builders import sources as source_trees

_SOURCE = ("the DeepFashion In-shop Clothes Retrieval Benchmark "
           "(https://mmlab.ie.cuhk.edu.hk/projects/DeepFashion/InShopRetrieval"
           ".html; Google Drive folder 'In-shop Clothes Retrieval Benchmark')")


def _search_dirs(manual_dir):
  """manual_dir, and the benchmark's folder above it when manual_dir is its
  ``Img/`` or the extracted ``Img/img/`` (the partition is in ``Eval/``)."""
  if manual_dir is None:
    return []
  root = pathlib.Path(manual_dir)
  dirs = [root]
  if root.name == "img" and root.parent.name == "Img":
    dirs.append(root.parent.parent)
  elif root.name in ("Img", "img"):
    dirs.append(root.parent)
  return dirs


class Inshop(base.EncodedImageBuilder, skip_registration=True):
  """In-shop Clothes Retrieval (Liu et al. 2016), official evaluation split.

  Manual directory: ``list_eval_partition.txt`` (or ``Eval/...``) and the
  images as ``img/`` or ``Img/img/`` (extracted) or ``img.zip`` (or
  ``Img/img.zip``); an extracted folder is read before a zip beside it, and
  a password-protected zip is refused in one line that says to extract it
  there. ``manual_dir`` may also be the benchmark's ``Img/`` or ``Img/img/``
  folder (the partition file then in ``../Eval/``). The
  partition file has a count line, a header ``image_name item_id
  evaluation_status`` and one line per image. Train: 3,997 items, 25,882
  images; query 14,218 and gallery 12,612 images of 3,985 other items.
  Query and gallery share one label space (the sorted test item ids), so a
  query's label equals its matching gallery images' label.
  """

  name = "inshop"
  SPLITS = ("train", "query", "gallery")
  SHARED_LABELS = (("query", "gallery"),)
  HOMEPAGE = ("https://mmlab.ie.cuhk.edu.hk/projects/DeepFashion/"
              "InShopRetrieval.html")
  DESCRIPTION = "DeepFashion In-shop Clothes Retrieval, train/query/gallery."
  CITATION = ("@inproceedings{liuLQWTcvpr16DeepFashion, title={DeepFashion: "
              "Powering Robust Clothes Recognition and Retrieval with Rich "
              "Annotations}, author={Liu, Z. and Luo, P. and Qiu, S. and "
              "Wang, X. and Tang, X.}, booktitle={CVPR}, year={2016}}")
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Put list_eval_partition.txt (from Eval/) and img.zip (from Img/, or "
      f"its extracted img/ folder) in the manual directory. Source: {_SOURCE}.")
  EXPECTED_FILES = (
      base.ExpectedFile(("list_eval_partition.txt",
                         "Eval/list_eval_partition.txt"), _SOURCE),
      base.ExpectedFile(("img.zip", "Img/img.zip", "img/", "Img/img/"),
                        _SOURCE),
  )
  EXPECTED_SIZES = {"train": 25882, "query": 14218, "gallery": 12612}

  def _open_sources(self, manual_dir, dl_manager):
    part = images = None
    dirs = _search_dirs(manual_dir)
    for d in dirs:
      for cand in ("list_eval_partition.txt", "Eval/list_eval_partition.txt"):
        if part is None and (d / cand).is_file():
          part = source_trees.DirTree(d)
          self._partition = cand
    # Extracted folders first: an encrypted zip is read once extracted.
    for d in dirs:
      for root in (d, d / "Img"):
        if images is None:
          images = source_trees.find_source(root, folder="img", archives=())
    for d in dirs:
      for archive in ("img.zip", "Img/img.zip"):
        if images is None and (d / archive).is_file():
          images = source_trees.open_tree(d / archive,
                                  extract_to=(d / archive).parent / "img")
    missing = [f for f, found in zip(self.EXPECTED_FILES, (part, images))
               if found is None]
    if missing:
      raise self.missing(manual_dir, missing)
    return {"partition": part, "images": images}

  def _plan(self, sources):
    rel = self._partition
    lines = sources["partition"].read_bytes(rel).decode("utf-8").splitlines()
    if len(lines) < 2 or lines[1].split()[:3] != [
        "image_name", "item_id", "evaluation_status"]:
      raise ValueError(
          f"{rel}: expected a count line then the header 'image_name item_id "
          f"evaluation_status'; got {lines[:2]}.")
    splits = {s: [] for s in self.SPLITS}
    for n, line in enumerate(lines[2:], 3):
      if not line.strip():
        continue
      parts = line.split()
      if len(parts) != 3 or parts[2] not in splits:
        raise ValueError(
            f"{rel} line {n}: expected '<img/...> <item_id> train|query|"
            f"gallery', got {line!r}.")
      path, item, status = parts
      splits[status].append(base.PlannedImage(
          source="images", member=path, path=path, class_key=item))
    declared = int(lines[0].split()[0])
    found = sum(len(v) for v in splits.values())
    if declared != found:
      raise ValueError(f"{rel}: the first line declares {declared} images but "
                       f"{found} are listed; the file is truncated.")
    return splits
