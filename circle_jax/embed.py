"""Embeds a folder of images with a trained run's best checkpoint.

  python -m circle_jax.embed --workdir DIR --images FOLDER --out FILE.npz

Restores the run (:func:`circle_jax.train.restore.restore_run`: its
``config.json``, the model, the best checkpoint or the latest one if the run
kept no best), applies
the run's *eval* preprocessing to every image file under ``FOLDER``
(recursively; ``.png .jpg .jpeg .bmp .gif .webp .tif .tiff .pgm .ppm``,
sorted by relative path) and saves ``paths`` (relative to ``FOLDER``, str),
``embeddings`` (``[N, embedding_dim]`` float32, unit norm) and ``skipped``
(the files that could not be decoded, with the reason) and ``model`` (the
model's record as JSON, :class:`circle_jax.search.index.ModelRecord`, by
which ``python -m circle_jax.search query --embeddings`` refuses another
model's embeddings) to ``FILE.npz``.

A folder with no image file is an error; an unreadable image is skipped with
a warning naming it (``--strict`` makes it an error instead).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import ml_collections
import numpy as np

from circle_jax import config_facts
from circle_jax import hostenv
from circle_jax import paths as paths_lib
from circle_jax.errors import UserError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif",
                    ".tiff", ".pgm", ".ppm")


class EmbedError(UserError):
  """Bad input of the embedding tool (the image folder).

  A bad workdir raises :class:`circle_jax.train.restore.RunError` or
  ``CheckpointError``.
  """


def list_images(folder: str) -> list:
  """Relative paths of the image files under ``folder``, sorted."""
  if not os.path.isdir(folder):
    raise EmbedError(f"--images: {folder!r} is not a folder; pass the folder "
                     "that holds the images.")
  out = []
  for root, _, files in os.walk(folder):
    for name in files:
      if name.lower().endswith(IMAGE_EXTENSIONS):
        out.append(os.path.relpath(os.path.join(root, name), folder))
  return sorted(out)


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config of a workdir's run
  (:func:`circle_jax.train.restore.load_config`)."""
  from circle_jax.train import restore as restore_lib  # pylint: disable=g-import-not-at-top
  return restore_lib.load_config(workdir)


def embed_folder(workdir: str, images: str, *, batch_size: int = 64,
                 which: Optional[str] = None, strict: bool = False,
                 record: Optional[list] = None):
  """``(paths, embeddings, skipped)`` of the images under ``images``.

  Args:
    workdir: the run's folder.
    images: the folder of images.
    batch_size: images per forward pass.
    which: ``best`` or ``latest`` checkpoint (default: best if any).
    strict: raise on the first image that cannot be decoded instead of
      skipping it.
    record: a list to append the model's
      :class:`circle_jax.search.index.ModelRecord` to (the search tools
      refuse queries of another model by it).

  Returns:
    The relative paths of the embedded images, a float32 ``[N, D]`` array,
    and ``[(path, reason)]`` of the skipped files.

  Raises:
    EmbedError: no image file under ``images``, or a bad workdir.
    circle_jax.data.ImageDecodeError: an unreadable image with ``strict``.
  """
  # Imported here: building the model needs the run's config first.
  from circle_jax import parallel  # pylint: disable=g-import-not-at-top
  from circle_jax.train import restore as restore_lib  # pylint: disable=g-import-not-at-top

  paths = list_images(images)
  if not paths:
    raise EmbedError(
        f"--images: no image files under {images!r} (looked for "
        f"{' '.join(IMAGE_EXTENSIONS)}, recursively).")
  # One device: the batches of a folder need not divide over the devices.
  run = restore_lib.restore_run(workdir, which,
                                placement=parallel.SingleDevice())
  logging.info("Embedding with the %s checkpoint (step %s).", run.which,
               run.step)
  if record is not None:
    from circle_jax.search import index as index_lib  # pylint: disable=g-import-not-at-top
    record.append(index_lib.ModelRecord.of_run(run))
  return embed_files(run, images, paths, batch_size=batch_size,
                     strict=strict)


def embed_files(run, folder: str, paths: Sequence[str], *,
                batch_size: int = 64, strict: bool = False,
                on_batch: Optional[Callable[[int], None]] = None):
  """``(paths, embeddings, skipped)`` of image files with a restored run.

  Args:
    run: a :class:`circle_jax.train.restore.Run` (its placement runs the
      forward pass: one device, so any batch count fits).
    folder: the folder the ``paths`` are relative to.
    paths: the image files (relative paths).
    batch_size: images per forward pass.
    strict: raise on the first image that cannot be decoded.
    on_batch: called with the number of images embedded after each batch.

  Returns:
    As :func:`embed_folder`.
  """
  from circle_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from circle_jax.evaluation import embedding as embedding_lib  # pylint: disable=g-import-not-at-top

  config, placement = run.config, run.placement
  preprocess = config_facts.eval_preprocess(config, run.info)
  embed = placement.embed_fn(embedding_lib.eval_apply(run.config, run.model))
  variables = placement.replicate(run.variables)
  decoded, kept, skipped = [], [], []
  for p in paths:
    try:
      with open(os.path.join(folder, p), "rb") as f:
        decoded.append(preprocess(f.read(), None, p))
      kept.append(p)
    except (data_lib.ImageDecodeError, OSError) as e:
      if strict:
        raise
      reason = str(e).splitlines()[0] if str(e) else type(e).__name__
      logging.warning("Skipping %s: %s", p, reason)
      skipped.append((p, reason))
  out = []
  for start in range(0, len(kept), batch_size):
    x = np.stack(decoded[start:start + batch_size])
    n = len(x)
    pad = batch_size - n  # one compiled shape for every batch
    if pad:
      x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
    out.append(np.asarray(embed(variables, x))[:n])
    if on_batch is not None:
      on_batch(start + n)
  dim = config.model.embedding_dim
  embeddings = (np.concatenate(out) if out else np.zeros((0, dim), np.float32))
  return kept, embeddings.astype(np.float32), skipped


_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder.")
_IMAGES = flags.DEFINE_string("images", None, "Folder of images to embed.")
_OUT = flags.DEFINE_string("out", None, "Output .npz file.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Images per forward pass.")
_WHICH = flags.DEFINE_enum("checkpoint", None, ["best", "latest"],
                           "Checkpoint to use (default: best if any).")
_STRICT = flags.DEFINE_bool("strict", False,
                            "Stop at an unreadable image instead of skipping.")
_VERBOSE = flags.DEFINE_bool("verbose", False,
                             "Library INFO logs and full tracebacks.")


def _run():
  paths_lib.output_file(_OUT.value, "--out")
  # np.savez adds ".npz" to a name without it: name the file it writes.
  out = _OUT.value if _OUT.value.endswith(".npz") else _OUT.value + ".npz"
  record = []
  paths, embeddings, skipped = embed_folder(
      _WORKDIR.value, _IMAGES.value, batch_size=_BATCH.value,
      which=_WHICH.value, strict=_STRICT.value, record=record)
  np.savez(out, paths=np.asarray(paths, dtype=str),
           embeddings=embeddings,
           model=np.asarray(json.dumps(record[0].to_dict())),
           skipped=np.asarray([f"{p}: {r}" for p, r in skipped], dtype=str))
  for p, r in skipped:
    print(f"skipped {p}: {r}", file=sys.stderr)
  print(f"{len(paths)} embeddings of dimension {embeddings.shape[1]} -> "
        f"{out}" + (f" ({len(skipped)} unreadable file(s) skipped)"
                    if skipped else ""))


def main(argv: Sequence[str]):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  for flag in (_WORKDIR, _IMAGES, _OUT):
    if not flag.value:
      raise app.UsageError(f"--{flag.name} is required.")
  from circle_jax.train import console  # pylint: disable=g-import-not-at-top
  console.configure_logging(_VERBOSE.value)
  hostenv.enable_compilation_cache()
  status = console.run_tool(_run, verbose=_VERBOSE.value)
  if status:
    sys.exit(status)


if __name__ == "__main__":
  app.run(main)
