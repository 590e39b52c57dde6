"""Omniglot: background alphabets for training, other alphabets for test."""

from __future__ import annotations

import hashlib
import pathlib
from typing import List

from circle_jax.data.builders import base
from circle_jax.data.builders import sources as source_trees

_URL = "https://github.com/brendenlake/omniglot/raw/master/python/{}.zip"
_REPO = "https://github.com/brendenlake/omniglot (python/{}.zip)"
_CITATION = ("@article{lake2015human, title={Human-level concept learning "
             "through probabilistic program induction}, author={Lake, B. M. "
             "and Salakhutdinov, R. and Tenenbaum, J. B.}, journal={Science}, "
             "volume={350}, number={6266}, pages={1332--1338}, year={2015}}")


def list_characters(tree, folder: str, *, alphabets=None,
                    source: str) -> List[base.PlannedImage]:
  """Images `<folder>/<alphabet>/<characterNN>/<id>_<drawer>.png` of a tree.

  The class of an image is its `(alphabet, character)` pair.
  """
  out = []
  for name in tree.names():
    parts = name.split("/")
    if len(parts) != 4 or parts[0] != folder or not name.endswith(".png"):
      continue
    if alphabets is not None and parts[1] not in alphabets:
      continue
    out.append(base.PlannedImage(source=source, member=name, path=name,
                                 class_key=(parts[1], parts[2])))
  return out


def alphabets_of(tree, folder: str):
  return {n.split("/")[1] for n in tree.names()
          if n.startswith(folder + "/") and n.count("/") >= 2}


class _OmniglotBase(base.EncodedImageBuilder, skip_registration=True):
  """Shared by the two Omniglot builders: finds or downloads the zips."""

  HOMEPAGE = "https://github.com/brendenlake/omniglot"
  CITATION = _CITATION
  FOLDERS = {}  # source key -> archive folder (zip name without .zip)
  DOWNLOADABLE = False

  def _open_sources(self, manual_dir, dl_manager):
    trees, missing = {}, []
    for key, folder in self.FOLDERS.items():
      tree = source_trees.find_source(manual_dir, folder=folder,
                              archives=(f"{folder}.zip",))
      if tree is None:
        missing.append((key, folder))
      trees[key] = tree
    if missing and self.DOWNLOADABLE and self.allow_download:
      if dl_manager is None:
        raise ValueError("Downloading needs a tfds download manager.")
      paths = dl_manager.download({k: _URL.format(f) for k, f in missing})
      for key, _ in missing:
        trees[key] = source_trees.open_tree(paths[key])
      missing = []
    if missing:
      hint = ("Pass download=True (circle_jax.data.load_split) to fetch them "
              "from GitHub." if self.DOWNLOADABLE else "")
      need = [f for f, (k, _) in zip(self.EXPECTED_FILES, self.FOLDERS.items())
              if k in dict(missing)]
      raise self.missing(manual_dir, need, hint)
    return trees


class Omniglot(_OmniglotBase, skip_registration=True):
  """Omniglot (Lake et al. 2015): 'background' train, 'evaluation' test.

  Train: the 30 background alphabets, 964 characters, 19,280 images; test:
  the 20 evaluation alphabets, 659 characters, 13,180 images. A class is one
  character of one alphabet. Files: ``images_background.zip`` and
  ``images_evaluation.zip`` (or their extracted folders) in the manual
  directory, otherwise downloaded from GitHub when downloading is allowed.
  Images are 105x105 black-on-white PNGs (stored as found).
  """

  name = "omniglot"
  DESCRIPTION = "Omniglot characters: background (train) / evaluation (test)."
  FOLDERS = {"background": "images_background",
             "evaluation": "images_evaluation"}
  DOWNLOADABLE = True
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Optional (downloaded from GitHub when online): images_background.zip "
      "and images_evaluation.zip from https://github.com/brendenlake/omniglot"
      "/tree/master/python.")
  EXPECTED_FILES = (
      base.ExpectedFile(("images_background.zip", "images_background/"),
                        _URL.format("images_background")),
      base.ExpectedFile(("images_evaluation.zip", "images_evaluation/"),
                        _URL.format("images_evaluation")),
  )
  EXPECTED_SIZES = {"train": 19280, "test": 13180}

  def _plan(self, sources):
    return {
        "train": list_characters(sources["background"], "images_background",
                                 source="background"),
        "test": list_characters(sources["evaluation"], "images_evaluation",
                                source="evaluation"),
    }


# The two official 'background small' zips (MIT licence), shipped with the
# package, and their md5 checksums.
BUNDLED_DIR = (pathlib.Path(__file__).resolve().parents[1] / "archives"
               / "omniglot_small")
BUNDLED_MD5 = {
    "images_background_small1.zip": "e704a628b5459e08445c13499850abc4",
    "images_background_small2.zip": "b75a71a51d3b13f821f212756fe481fd",
}


def check_bundled_archives(folder=BUNDLED_DIR):
  """Raises CorruptImageError if a bundled zip is missing or its md5 differs."""
  for name, want in BUNDLED_MD5.items():
    path = pathlib.Path(folder) / name
    if not path.exists():
      raise source_trees.CorruptImageError(
          f"Dataset 'omniglot_small': the bundled archive {path} is missing; "
          "reinstall circle_jax (or pass --config.dataset.manual_dir=<folder "
          "with the two zips>).")
    got = hashlib.md5(path.read_bytes()).hexdigest()
    if got != want:
      raise source_trees.CorruptImageError(
          f"Dataset 'omniglot_small': {path} has md5 {got}, expected {want} "
          "(corrupt or modified); restore it from the repository, or pass "
          "--config.dataset.manual_dir=<folder with the official zips>.")


class OmniglotSmall(_OmniglotBase, skip_registration=True):
  """Omniglot 'background small' archives, alphabet-disjoint.

  Train: all of ``images_background_small1.zip`` (5 alphabets, 136
  characters, 2,720 images). Test: the alphabets of
  ``images_background_small2.zip`` that are not in small1 (Greek and Latin
  appear in both): Japanese_(katakana), Sanskrit, Tagalog, 106 characters,
  2,120 images. Files: the two zips (or extracted folders) in the manual
  directory if one is given; otherwise the copies shipped with the package
  (:data:`BUNDLED_DIR`, md5-checked), so no download is ever needed.
  """

  name = "omniglot_small"
  DESCRIPTION = "Omniglot background-small: small1 (train) / new alphabets of small2 (test)."
  FOLDERS = {"small1": "images_background_small1",
             "small2": "images_background_small2"}
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Put images_background_small1.zip and images_background_small2.zip "
      "(https://github.com/brendenlake/omniglot/tree/master/python) in the "
      "manual directory.")
  EXPECTED_FILES = (
      base.ExpectedFile(("images_background_small1.zip",
                         "images_background_small1/"),
                        _REPO.format("images_background_small1")),
      base.ExpectedFile(("images_background_small2.zip",
                         "images_background_small2/"),
                        _REPO.format("images_background_small2")),
  )
  EXPECTED_SIZES = {"train": 2720, "test": 2120}

  def _open_sources(self, manual_dir, dl_manager):
    if manual_dir is None:
      check_bundled_archives()
      manual_dir = BUNDLED_DIR
    return super()._open_sources(manual_dir, dl_manager)

  def _plan(self, sources):
    seen = alphabets_of(sources["small1"], "images_background_small1")
    new = alphabets_of(sources["small2"], "images_background_small2") - seen
    return {
        "train": list_characters(sources["small1"], "images_background_small1",
                                 source="small1"),
        "test": list_characters(sources["small2"], "images_background_small2",
                                alphabets=new, source="small2"),
    }
