"""iNaturalist 2018 with the Smooth-AP retrieval split (PML's
``datasets.INaturalist2018``)."""

from __future__ import annotations

import json
import pathlib

from circle_jax.data.builders import base
from circle_jax.data.builders import sources as source_trees

_SOURCE = ("https://github.com/visipedia/inat_comp/tree/master/2018 "
           "(train_val2018.tar.gz, train2018.json.tar.gz, "
           "val2018.json.tar.gz) and the split lists of "
           "https://github.com/Andrew-Brown1/Smooth_AP (Inat_dataset_splits)")
_SPLIT_LIST = "Inat_dataset_splits/Inaturalist_{}_set1.txt"


class INaturalist2018(base.EncodedImageBuilder, skip_registration=True):
  """iNaturalist 2018 (Van Horn et al. 2018) as Brown et al.'s Smooth-AP
  retrieval benchmark: class-disjoint train and test lists.

  Manual directory, as PML 2.9's dataset reads it (extracted): the
  official ``train2018.json`` and ``val2018.json`` (their ``images``' ``id``
  and ``file_name``, their ``annotations``' ``image_id`` and
  ``category_id``), the image folder ``train_val2018/``, and Smooth-AP's
  ``Inat_dataset_splits/Inaturalist_{train,test}_set1.txt`` (one image path
  per line, relative to the folder). A class is a ``category_id``.
  """

  name = "inaturalist2018"
  HOMEPAGE = "https://github.com/visipedia/inat_comp/tree/master/2018"
  DESCRIPTION = ("iNaturalist 2018, the Smooth-AP class-disjoint retrieval "
                 "split.")
  CITATION = ("@inproceedings{vanhorn2018inaturalist, title={The iNaturalist "
              "Species Classification and Detection Dataset}, author={Van "
              "Horn, G. and Mac Aodha, O. and Song, Y. and Cui, Y. and Sun, "
              "C. and Shepard, A. and Adam, H. and Perona, P. and Belongie, "
              "S.}, booktitle={CVPR}, year={2018}}")
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Put train2018.json, val2018.json, train_val2018/ and "
      f"Inat_dataset_splits/ in the manual directory. Source: {_SOURCE}.")
  EXPECTED_FILES = tuple(base.ExpectedFile((rel,), _SOURCE) for rel in (
      "train2018.json", "val2018.json", _SPLIT_LIST.format("train"),
      _SPLIT_LIST.format("test"), "train_val2018/"))
  # Smooth-AP's counts (Brown et al. 2020, Sec. 5): 5,690 train classes,
  # 2,452 test classes.
  EXPECTED_SIZES = {"train": 325846, "test": 136093}

  def _open_sources(self, manual_dir, dl_manager):
    root = None if manual_dir is None else pathlib.Path(manual_dir)
    needed = ("train2018.json", "val2018.json", _SPLIT_LIST.format("train"),
              _SPLIT_LIST.format("test"))
    if root is None or not all((root / n).is_file() for n in needed):
      raise self.missing(manual_dir, self.EXPECTED_FILES)
    return {"inat": source_trees.DirTree(root)}

  def _plan(self, sources):
    tree = sources["inat"]
    path_to_id, id_to_label = {}, {}
    for rel in ("val2018.json", "train2018.json"):
      meta = json.loads(tree.read_bytes(rel))
      path_to_id.update({im["file_name"]: im["id"] for im in meta["images"]})
      id_to_label.update({a["image_id"]: a["category_id"]
                          for a in meta["annotations"]})
    plan = {}
    for split in ("train", "test"):
      rel = _SPLIT_LIST.format(split)
      paths = [p.strip() for p in tree.read_bytes(rel).decode().splitlines()
               if p.strip()]
      unknown = [p for p in paths if p not in path_to_id]
      if unknown:
        raise ValueError(f"{rel}: {len(unknown)} paths are not in the JSONs' "
                         f"images (first: {unknown[0]!r}); the lists and "
                         "the JSONs are of different releases.")
      plan[split] = [base.PlannedImage(
          source="inat", member=p, path=p,
          class_key=int(id_to_label[path_to_id[p]])) for p in paths]
    return plan
