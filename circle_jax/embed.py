"""Embeds a folder of images with a trained run's best checkpoint.

  python -m circle_jax.embed --workdir DIR --images FOLDER --out FILE.npz

Reads ``DIR/config.json`` (written by the main job), rebuilds the model,
restores the best checkpoint (the latest one if the run kept no best), applies
the run's *eval* preprocessing to every image file under ``FOLDER``
(recursively; ``.png .jpg .jpeg .bmp .gif .webp .tif .tiff .pgm .ppm``,
sorted by relative path) and saves ``paths`` (relative to ``FOLDER``, str),
``embeddings`` (``[N, embedding_dim]`` float32, unit norm) and ``skipped``
(the files that could not be decoded, with the reason) to ``FILE.npz``.

A folder with no image file is an error; an unreadable image is skipped with
a warning naming it (``--strict`` makes it an error instead).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import ml_collections
import numpy as np

from circle_jax.errors import UserError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif",
                    ".tiff", ".pgm", ".ppm")


class EmbedError(UserError):
  """Bad input of the embedding tool (folder, workdir)."""


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
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise EmbedError(
        f"{path} not found: --workdir must be the folder of a run of "
        "experiments.main.")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def embed_folder(workdir: str, images: str, *, batch_size: int = 64,
                 which: Optional[str] = None, strict: bool = False):
  """``(paths, embeddings, skipped)`` of the images under ``images``.

  Args:
    workdir: the run's folder.
    images: the folder of images.
    batch_size: images per forward pass.
    which: ``best`` or ``latest`` checkpoint (default: best if any).
    strict: raise on the first image that cannot be decoded instead of
      skipping it.

  Returns:
    The relative paths of the embedded images, a float32 ``[N, D]`` array,
    and ``[(path, reason)]`` of the skipped files.

  Raises:
    EmbedError: no image file under ``images``, or a bad workdir.
    circle_jax.data.ImageDecodeError: an unreadable image with ``strict``.
  """
  # Imported here: building the model needs the run's config first.
  from circle_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from circle_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from circle_jax.train import loop  # pylint: disable=g-import-not-at-top
  from circle_jax.train import state as state_lib  # pylint: disable=g-import-not-at-top
  from circle_jax.train import step as step_lib  # pylint: disable=g-import-not-at-top

  paths = list_images(images)
  if not paths:
    raise EmbedError(
        f"--images: no image files under {images!r} (looked for "
        f"{' '.join(IMAGE_EXTENSIONS)}, recursively).")
  config = load_run_config(workdir)
  info = data_lib.get_dataset_info(config.dataset.name)
  preprocess = loop.eval_preprocess(config, info)
  model = loop.build_model(config, "none")
  state, _, _, _ = loop.init_state(config, model, info, preprocess.output_shape)
  template = step_lib.to_host(state_lib.state_to_tree(state), mode="none")
  ckpts = ckpt_lib.Checkpoints(
      os.path.join(workdir, "checkpoints"),
      best_metric=config.get("best_metric") or None,
      best_mode=config.get("best_mode", "max"))
  if which is None:
    which = "best" if ckpts.best_step() is not None else "latest"
  step = ckpts.best_step() if which == "best" else ckpts.latest_step()
  if step is None:
    ckpts.close()
    raise EmbedError(f"{workdir} has no {which} checkpoint yet; train it "
                     "first with experiments.main.")
  tree, _, meta = ckpts.restore(template, which=which)
  ckpts.close()
  loop.check_restored(tree, template, step, ckpts.directory)
  logging.info("Embedding with the %s checkpoint (step %s).", which,
               meta.get("step"))
  variables = {"params": tree["params"]["model"]}
  if tree["batch_stats"]:
    variables["batch_stats"] = tree["batch_stats"]
  embed = step_lib.embed_fn(model.apply)
  decoded, kept, skipped = [], [], []
  for p in paths:
    try:
      with open(os.path.join(images, p), "rb") as f:
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
  paths, embeddings, skipped = embed_folder(
      _WORKDIR.value, _IMAGES.value, batch_size=_BATCH.value,
      which=_WHICH.value, strict=_STRICT.value)
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  np.savez(_OUT.value, paths=np.asarray(paths, dtype=str),
           embeddings=embeddings,
           skipped=np.asarray([f"{p}: {r}" for p, r in skipped], dtype=str))
  for p, r in skipped:
    print(f"skipped {p}: {r}", file=sys.stderr)
  print(f"{len(paths)} embeddings of dimension {embeddings.shape[1]} -> "
        f"{_OUT.value}" + (f" ({len(skipped)} unreadable file(s) skipped)"
                           if skipped else ""))


def main(argv: Sequence[str]):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  for flag in (_WORKDIR, _IMAGES, _OUT):
    if not flag.value:
      raise app.UsageError(f"--{flag.name} is required.")
  from circle_jax.train import console  # pylint: disable=g-import-not-at-top
  console.configure_logging(_VERBOSE.value)
  status = console.run_tool(_run, verbose=_VERBOSE.value)
  if status:
    sys.exit(status)


if __name__ == "__main__":
  app.run(main)
