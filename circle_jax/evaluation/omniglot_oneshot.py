"""The official Omniglot 20-way one-shot classification runs (Lake et al. 2015).

The Omniglot repository's ``python/one-shot-classification/all_runs.zip``
holds 20 runs ``run01`` .. ``run20``; each has ``training/class01.png`` ..
``class20.png`` (one image of each of 20 characters), ``test/item01.png`` ..
``item20.png`` (another drawer's image of each) and ``class_labels.txt``, one
line per test image naming its training image, with paths relative to the
folder that holds the runs::

  run01/test/item01.png run01/training/class17.png

Each test image is classified among its run's training images; the run's
error is the percentage of test images classified to another class, and the
benchmark's number is the mean over the 20 runs (the paper's Fig. 2 reports
people at 4.5% error). Here the classifier is 1-nearest neighbour by cosine
similarity of the embeddings of a trained model (ties go to the first training
image in sorted file order, the order of the repository's demo).

:func:`official_runs` reads the copy of ``all_runs.zip`` shipped with the
package (``circle_jax/data/archives/omniglot_oneshot``, MIT, checked by md5).
For model selection, which must not look at the evaluation alphabets,
:func:`within_alphabet_runs` draws runs by the same protocol from an Omniglot
images archive: each run takes 20 characters of one alphabet, one drawer's
image of each as the training images and another drawer's as the test
images. On the alphabets that the ``omniglot_small`` model never saw (small2
without small1's alphabets) they are a stand-in for the official runs, not
the official runs: other alphabets, other drawer pairs.
:func:`ensemble_embedder` makes one 1-NN classifier of several models.

:func:`read_runs` accepts the extracted folder or the zip, with or without the
top-level ``all_runs/`` folder, and ``class_labels.txt`` paths relative to the
runs' folder (the repository's format) or to the run's own folder.
:func:`oneshot_errors` classifies runs with any embedding function and
:func:`evaluate_run` with a restored run's model and its eval preprocessing
(:func:`circle_jax.train.restore.restore_run`;
``experiments/tools/omniglot_oneshot.py`` is the command line).

References:
  Lake, Salakhutdinov, Tenenbaum, "Human-level concept learning through
  probabilistic program induction", Science 2015
  (https://github.com/brendenlake/omniglot).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import re
import tarfile
import zipfile
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax.numpy as jnp
import numpy as np

from circle_jax import ops
from circle_jax.data.builders import base as builders_base
from circle_jax.data.builders import omniglot as omniglot_builder
from circle_jax.data.builders import sources as builders_sources
from circle_jax.errors import UserError
from circle_jax.evaluation import embedding as embedding_lib

LABELS_FILE = "class_labels.txt"
# The official runs, shipped with the package (MIT), and their md5.
OFFICIAL_RUNS = (pathlib.Path(__file__).resolve().parents[1] / "data"
                 / "archives" / "omniglot_oneshot" / "all_runs.zip")
OFFICIAL_RUNS_MD5 = "e8996daecdf12afeeb4a53a179f06b19"
_RUN = re.compile(r"^(.*?)(run\d+)/" + re.escape(LABELS_FILE) + "$")


class OneShotRunsError(UserError, ValueError):
  """The runs' folder or zip is missing, incomplete or not in the layout."""


@dataclasses.dataclass(frozen=True)
class OneShotRun:
  """One classification run.

  Attributes:
    name: ``run01`` ...
    training: the training images' paths in the runs' tree, sorted.
    test: the test images' paths, in ``class_labels.txt`` order.
    answers: ``[len(test)]`` for each test image, the index in ``training``
      of its class's image.
    training_images, test_images: the encoded images (PNG bytes).
  """

  name: str
  training: Tuple[str, ...]
  test: Tuple[str, ...]
  answers: Tuple[int, ...]
  training_images: Tuple[bytes, ...]
  test_images: Tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class OneShotResult:
  """Errors of :func:`oneshot_errors`.

  Attributes:
    runs: the runs' names.
    errors: the error of each run in % (0 to 100).
    mean_error: their mean, the benchmark's number, in %.
    predictions: for each run, the index in ``training`` chosen for each test
      image.
  """

  runs: Tuple[str, ...]
  errors: Tuple[float, ...]
  mean_error: float
  predictions: Tuple[Tuple[int, ...], ...]


def _resolve(names: set, prefix: str, run: str, path: str, where: str) -> str:
  for candidate in (prefix + path, f"{prefix}{run}/{path}"):
    if candidate in names:
      return candidate
  raise OneShotRunsError(
      f"{where} names {path!r}, which is not in the runs' files (looked for "
      f"{prefix + path!r} and {prefix}{run}/{path!r}); the copy is "
      "incomplete: extract all_runs.zip again.")


def read_runs(path: str) -> List[OneShotRun]:
  """Reads the one-shot runs of a folder or zip in the official layout.

  Args:
    path: ``all_runs.zip``, or a folder holding ``run01`` ... (or holding
      ``all_runs/``).

  Returns:
    The runs, sorted by name.

  Raises:
    OneShotRunsError: no runs, a malformed ``class_labels.txt`` or a file it
      names that is missing (one line naming the file).
  """
  if not os.path.exists(path):
    raise OneShotRunsError(
        f"--runs: {path!r} does not exist; give all_runs.zip of the Omniglot "
        "repository (python/one-shot-classification) or its extracted folder.")
  if os.path.isfile(path) and not (zipfile.is_zipfile(path)
                                   or tarfile.is_tarfile(path)):
    raise OneShotRunsError(
        f"--runs: {path!r} is neither a folder nor a zip archive; give "
        "all_runs.zip of the Omniglot repository or its extracted folder.")
  tree = builders_sources.open_tree(path)
  names = set(tree.names())
  found = sorted((m.group(2), m.group(1)) for m in map(_RUN.match, names) if m)
  if not found:
    raise OneShotRunsError(
        f"--runs: no run*/{LABELS_FILE} in {tree.description}; give "
        "all_runs.zip of the Omniglot repository or its extracted folder.")
  runs = []
  for run, prefix in found:
    where = f"{prefix}{run}/{LABELS_FILE} in {tree.description}"
    pairs = []
    for i, line in enumerate(tree.read_bytes(f"{prefix}{run}/{LABELS_FILE}")
                             .decode("utf-8").splitlines()):
      if not line.strip():
        continue
      fields = line.split()
      if len(fields) != 2:
        raise OneShotRunsError(
            f"{where}, line {i + 1}: expected 'test/itemNN.png "
            f"training/classNN.png', got {line.strip()!r}.")
      pairs.append(tuple(_resolve(names, prefix, run, f, where)
                         for f in fields))
    training = sorted(n for n in names if n.startswith(f"{prefix}{run}/"
                                                       "training/")
                      and n.lower().endswith(".png"))
    test = [t for t, _ in pairs]
    if not pairs or len(set(test)) != len(test):
      raise OneShotRunsError(
          f"{where} must list each test image once; got {len(pairs)} lines "
          f"for {len(set(test))} images.")
    for _, answer in pairs:
      if answer not in training:
        raise OneShotRunsError(
            f"{where} names {answer!r} as an answer, which is not one of the "
            f"run's training images ({prefix}{run}/training/*.png).")
    images = dict(tree.iter_files(sorted(set(training) | set(test))))
    for name, data in images.items():
      builders_base.check_image(data, f"{name!r} ({tree.description})")
    runs.append(OneShotRun(
        name=run, training=tuple(training), test=tuple(test),
        answers=tuple(training.index(a) for _, a in pairs),
        training_images=tuple(images[n] for n in training),
        test_images=tuple(images[n] for n in test)))
  return runs


def official_runs(path: Optional[str] = None) -> List[OneShotRun]:
  """The 20 official runs, from the copy shipped with the package.

  Args:
    path: another copy of ``all_runs.zip`` to check and read (default:
      :data:`OFFICIAL_RUNS`).

  Returns:
    :func:`read_runs` of the archive, ``run01`` .. ``run20``.

  Raises:
    OneShotRunsError: the archive is missing or its md5 is not the official
      archive's (one line naming the fix).
  """
  path = pathlib.Path(path or OFFICIAL_RUNS)
  if not path.is_file():
    raise OneShotRunsError(
        f"the official one-shot runs {path} are missing; reinstall circle_jax "
        "or pass --runs <all_runs.zip of the Omniglot repository>.")
  got = hashlib.md5(path.read_bytes()).hexdigest()
  if got != OFFICIAL_RUNS_MD5:
    raise OneShotRunsError(
        f"{path} has md5 {got}, not the official all_runs.zip's "
        f"{OFFICIAL_RUNS_MD5} (corrupt or modified); restore it from the "
        "repository, or pass --runs <folder or zip> for other runs.")
  return read_runs(str(path))


def _unit(x: np.ndarray) -> np.ndarray:
  norms = np.linalg.norm(x, axis=-1, keepdims=True)
  return x / np.where(norms > 0, norms, 1.0)


def aligned_similarity(test: np.ndarray, train: np.ndarray) -> np.ndarray:
  """Similarity by alignment of ``M`` models' views: ``[t, n]``.

  For one model, with ``e(x)`` an image's unit embedding and ``v_1(x) ..
  v_V(x)`` the unit embeddings of its views (small shifts and rotations,
  :func:`circle_jax.evaluation.embedding.affine_views`)::

    sim(q, s) = ( max_j e(q) . v_j(s)  +  max_j e(s) . v_j(q) ) / 2

  each image against the best-matching pose of the other, both ways, so
  that ``sim(q, s) = sim(s, q)``. With ``M`` models, the mean of their
  ``sim``. A test image whose stroke sits a few pixels or degrees off its
  class's training image is matched in the pose where they overlap, as
  Lake et al.'s people and Bayesian program learning compare characters
  after aligning them (their distance is invariant to small motions); the
  model's own test-time shift only averages them.

  Args:
    test: ``[t, M, 1 + V, D]``: for each image and model, ``e`` then the
      ``V`` views.
    train: ``[n, M, 1 + V, D]``, likewise.

  Returns:
    ``[t, n]`` float64 similarities in ``[-1, 1]``.
  """
  test, train = (_unit(np.asarray(x, np.float64)) for x in (test, train))
  if (test.ndim != 4 or train.shape[1:] != test.shape[1:]
      or test.shape[2] < 2):
    raise ValueError(
        "aligned_similarity takes [t, M, 1 + V, D] and [n, M, 1 + V, D] "
        f"embeddings with V >= 1; got {test.shape} and {train.shape}.")
  one = np.einsum("tmd,nmvd->tnmv", test[:, :, 0], train[:, :, 1:]).max(-1)
  two = np.einsum("nmd,tmvd->tnmv", train[:, :, 0], test[:, :, 1:]).max(-1)
  return ((one + two) / 2).mean(-1)


def oneshot_errors(embed: Callable[[Sequence[bytes]], np.ndarray],
                   runs: Sequence[OneShotRun]) -> OneShotResult:
  """Classifies each run's test images by 1-NN among its training images.

  Args:
    embed: ``embed(list of encoded images)`` -> ``[n, D]`` float
      embeddings, compared by cosine; or ``[n, M, 1 + V, D]`` (an
      embedder with ``config.oneshot.align``), compared by
      :func:`aligned_similarity`.
    runs: from :func:`read_runs`.

  Returns:
    A :class:`OneShotResult` (errors in %).
  """
  # Each distinct image is embedded once: runs drawn from the same
  # alphabets (several stand-in draws) share most of their images.
  images = list(dict.fromkeys(
      im for r in runs for im in r.training_images + r.test_images))
  emb = np.asarray(embed(images), np.float64)
  if (emb.ndim not in (2, 4) or len(emb) != len(images)
      or not np.all(np.isfinite(emb))):
    raise ValueError(f"`embed` must return finite [{len(images)}, D] or "
                     f"[{len(images)}, M, 1 + V, D] embeddings; got shape "
                     f"{emb.shape}.")
  if emb.ndim == 2:
    emb = _unit(emb)
    similarity = lambda test, train: test @ train.T  # noqa: E731
  else:
    similarity = aligned_similarity
  row = {im: i for i, im in enumerate(images)}
  errors, predictions = [], []
  for r in runs:
    train = emb[[row[im] for im in r.training_images]]
    test = emb[[row[im] for im in r.test_images]]
    pred = np.argmax(similarity(test, train), axis=1)
    predictions.append(tuple(int(p) for p in pred))
    errors.append(100.0 * float(np.mean(pred != np.asarray(r.answers))))
  return OneShotResult(runs=tuple(r.name for r in runs), errors=tuple(errors),
                       mean_error=float(np.mean(errors)),
                       predictions=tuple(predictions))


def comparison(configs: Sequence) -> str:
  """How :func:`run_embedder` with these runs' configs compares images, in
  words: ``cosine``, or ``aligned cosine: views shifted up to 3 px, rotated
  -10, 0, 10 deg``; several distinct ways joined by `` / `` (``cosine``
  for no config)."""
  ways = []
  for config in configs:
    o = config.oneshot
    angles = ", ".join(f"{a:g}" for a in o.align_angles)
    ways.append("cosine" if not o.align else
                f"aligned cosine: views shifted up to {o.align_shift} px, "
                f"rotated {angles} deg")
  return " / ".join(dict.fromkeys(ways)) or "cosine"


def run_embedder(run) -> Callable[[Sequence[bytes]], np.ndarray]:
  """``embed(images)`` with a restored run's model and eval preprocessing.

  Returns ``[n, D]`` embeddings (with the run's ``config.eval_shift``), or
  with ``config.oneshot.align``, ``[n, 1, 1 + V, D]``: each image's
  embedding, then its ``V`` views' (``config.oneshot.align_shift`` and
  ``align_angles``), for :func:`aligned_similarity`.

  Args:
    run: a :class:`circle_jax.train.restore.Run` (``restore_run``).
  """
  oneshot = run.config.oneshot
  apply_fn = None
  if oneshot.align:
    plain = embedding_lib.eval_apply(run.config, run.model)
    views = embedding_lib.views_apply(run.model, shift=oneshot.align_shift,
                                      angles=tuple(oneshot.align_angles))

    def apply_fn(variables, images):
      e = ops.l2_normalize(plain(variables, images))[:, None]
      return jnp.concatenate([e, views(variables, images)], axis=1)[:, None]

  def embed(images: Sequence[bytes]) -> np.ndarray:
    source = [{"image": data, "label": 0, "path": f"one-shot image {i}"}
              for i, data in enumerate(images)]
    return run.embed_split(source=source, apply_fn=apply_fn)[0]
  return embed


def evaluate_run(run, runs: Sequence[OneShotRun]
                 ) -> Tuple[OneShotResult, Dict[str, object]]:
  """The one-shot errors of a restored run's model.

  Args:
    run: a :class:`circle_jax.train.restore.Run`
      (``circle_jax.train.restore.restore_run(workdir, which)``).
    runs: from :func:`read_runs`.

  Returns:
    ``(result, {'workdir', 'which', 'step', 'dataset'})``.
  """
  result = oneshot_errors(run_embedder(run), runs)
  return result, {"workdir": run.workdir, "which": run.which,
                  "step": run.step, "dataset": run.config.dataset.name}


def within_alphabet_runs(path: str, *, way: int = 20, num_runs: int = 20,
                         seed: int = 0,
                         exclude_alphabets: Sequence[str] = (),
                         alphabets: Optional[Sequence[str]] = None
                         ) -> List[OneShotRun]:
  """One-shot runs drawn by the official protocol from an images archive.

  Lake et al. (2015) built each run from one alphabet: ``way`` characters,
  one drawer's image of each as the training images, another drawer's image
  of each as the test images. Run ``r`` here takes the ``r``-th alphabet in
  turn among those with at least ``way`` characters (sorted by name), then
  ``way`` of its characters and two distinct drawers at random; the test
  images come in a random order.

  Args:
    path: an Omniglot images archive or its folder, in the official layout
      ``<top>/<alphabet>/characterNN/<id>_<drawer>.png``
      (``images_background_small2.zip``).
    way: characters per run (20 in the benchmark).
    num_runs: how many runs (20 in the benchmark).
    seed: the draw's seed.
    exclude_alphabets: alphabets left out (those a model trained on).
    alphabets: only these alphabets (default: every alphabet not excluded).

  Returns:
    The runs ``run01`` ..., as :func:`read_runs` gives them.

  Raises:
    OneShotRunsError: no alphabet with ``way`` characters (one line).
  """
  tree = builders_sources.open_tree(path)
  images: Dict[Tuple[str, str], Dict[str, str]] = {}
  for top in sorted({n.split("/")[0] for n in tree.names()}):
    for im in omniglot_builder.list_characters(tree, top, source=top):
      stem = im.member.rsplit("/", 1)[1][:-len(".png")]
      if "_" in stem:  # <id>_<drawer>.png
        images.setdefault(im.class_key, {})[stem.rsplit("_", 1)[1]] = im.member
  chars: Dict[str, List[str]] = {}
  for alphabet, character in sorted(images):
    if alphabet in exclude_alphabets or (alphabets is not None
                                         and alphabet not in alphabets):
      continue
    chars.setdefault(alphabet, []).append(character)
  eligible = sorted(a for a, c in chars.items() if len(c) >= way)
  if not eligible or way < 2 or num_runs < 1:
    raise OneShotRunsError(
        f"no alphabet of {tree.description} has {way} characters (after "
        f"leaving out {sorted(exclude_alphabets)}); give an images archive "
        "in the official layout or a smaller `way` (>= 2).")
  rng = np.random.default_rng(seed)
  runs = []
  for r in range(num_runs):
    alphabet = eligible[r % len(eligible)]
    picked = sorted(rng.choice(chars[alphabet], way, replace=False))
    drawers = sorted(set.intersection(
        *(set(images[alphabet, c]) for c in picked)))
    first, second = rng.choice(drawers, 2, replace=False)
    training = [images[alphabet, c][first] for c in picked]
    order = rng.permutation(way)
    test = [images[alphabet, picked[i]][second] for i in order]
    data = dict(tree.iter_files(training + test))
    runs.append(OneShotRun(
        name=f"run{r + 1:02d}", training=tuple(training), test=tuple(test),
        answers=tuple(int(i) for i in order),
        training_images=tuple(data[n] for n in training),
        test_images=tuple(data[n] for n in test)))
  return runs


def stand_in_runs(seed: int = 0, folder: Optional[str] = None
                  ) -> List[OneShotRun]:
  """:func:`within_alphabet_runs` on the alphabets ``omniglot_small`` tests
  on: ``images_background_small2`` without small1's alphabets (those with 20
  characters: Japanese_(katakana) and Sanskrit; Tagalog has 17).

  Args:
    seed: the draw's seed.
    folder: where the two zips are (default: the copies in the package).
  """
  folder = str(folder or omniglot_builder.BUNDLED_DIR)
  small1 = builders_sources.open_tree(
      os.path.join(folder, "images_background_small1.zip"))
  return within_alphabet_runs(
      os.path.join(folder, "images_background_small2.zip"), seed=seed,
      exclude_alphabets=sorted(omniglot_builder.alphabets_of(
          small1, "images_background_small1")))


def cached_embedder(embed: Callable[[Sequence[bytes]], np.ndarray]
                    ) -> Callable[[Sequence[bytes]], np.ndarray]:
  """``embed`` that remembers its last answer: scoring a model alone and
  then inside an ensemble on the same images embeds them once."""
  last = functools.lru_cache(maxsize=1)(lambda images: embed(list(images)))
  return lambda images: last(tuple(images))


def ensemble_embedder(embedders: Sequence[Callable[[Sequence[bytes]],
                                                    np.ndarray]]
                      ) -> Callable[[Sequence[bytes]], np.ndarray]:
  """One embedding of several models for 1-NN.

  ``[n, D_m]`` embeddings (cosine) are L2-normalised, concatenated and
  divided by ``sqrt(M)``: the cosine similarity of two ensemble embeddings
  is the mean of the ``M`` models' cosine similarities. ``[n, 1, 1 + V, D]``
  embeddings (alignment) are stacked on their model axis into ``[n, M, 1 +
  V, D]``: :func:`aligned_similarity` averages the models'.

  Args:
    embedders: ``embed(images)`` functions (:func:`run_embedder`), all of
      one kind.
  """
  if not embedders:
    raise ValueError("ensemble_embedder needs at least one model.")

  def embed(images: Sequence[bytes]) -> np.ndarray:
    parts = [_unit(np.asarray(fn(images), np.float64)) for fn in embedders]
    if len({p.ndim for p in parts}) != 1 or parts[0].ndim not in (2, 4):
      raise ValueError(
          "ensemble_embedder: the members must all return [n, D] (cosine) or "
          "all [n, 1, 1 + V, D] (config.oneshot.align) embeddings; got "
          f"shapes {[p.shape for p in parts]}.")
    if parts[0].ndim == 4:
      return np.concatenate(parts, axis=1)
    return np.concatenate(parts, axis=1) / np.sqrt(len(parts))
  return embed
