"""Embeds a folder of images with a trained run's best checkpoint.

  python -m circle_jax.embed --workdir DIR --images FOLDER --out FILE.npz

Reads ``DIR/config.json`` (written by the main job), rebuilds the model,
restores the best checkpoint (the latest one if the run kept no best), applies
the run's *eval* preprocessing to every image file under ``FOLDER``
(recursively; ``.png .jpg .jpeg .bmp .gif .webp .tif .tiff .pgm .ppm``,
sorted by relative path) and saves ``paths`` (relative to ``FOLDER``, str)
and ``embeddings`` (``[N, embedding_dim]`` float32, unit norm) to ``FILE.npz``.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import ml_collections
import numpy as np

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif",
                    ".tiff", ".pgm", ".ppm")


def list_images(folder: str) -> list:
  """Relative paths of the image files under ``folder``, sorted."""
  if not os.path.isdir(folder):
    raise FileNotFoundError(f"--images: {folder!r} is not a folder.")
  out = []
  for root, _, files in os.walk(folder):
    for name in files:
      if name.lower().endswith(IMAGE_EXTENSIONS):
        out.append(os.path.relpath(os.path.join(root, name), folder))
  return sorted(out)


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"{path} not found: --workdir must be the folder of a run of "
        "experiments.main.")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def embed_folder(workdir: str, images: str, *, batch_size: int = 64,
                 which: Optional[str] = None):
  """``(paths, embeddings)`` of every image under ``images``.

  Args:
    workdir: the run's folder.
    images: the folder of images.
    batch_size: images per forward pass.
    which: ``best`` or ``latest`` checkpoint (default: best if any).

  Returns:
    A list of relative paths and a float32 ``[N, D]`` array.
  """
  # Imported here: building the model needs the run's config first.
  from circle_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from circle_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from circle_jax.train import loop  # pylint: disable=g-import-not-at-top
  from circle_jax.train import state as state_lib  # pylint: disable=g-import-not-at-top
  from circle_jax.train import step as step_lib  # pylint: disable=g-import-not-at-top

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
  tree, _, meta = ckpts.restore(template, which=which)
  ckpts.close()
  logging.info("Embedding with the %s checkpoint (step %s).", which,
               meta.get("step"))
  variables = {"params": tree["params"]["model"]}
  if tree["batch_stats"]:
    variables["batch_stats"] = tree["batch_stats"]
  embed = step_lib.embed_fn(model.apply)
  paths = list_images(images)
  out = []
  for start in range(0, len(paths), batch_size):
    chunk = paths[start:start + batch_size]
    batch = []
    for p in chunk:
      with open(os.path.join(images, p), "rb") as f:
        batch.append(preprocess(f.read(), None, p))
    x = np.stack(batch)
    pad = batch_size - len(chunk)  # one compiled shape for every batch
    if pad:
      x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
    out.append(np.asarray(embed(variables, x))[:len(chunk)])
  dim = config.model.embedding_dim
  embeddings = (np.concatenate(out) if out else np.zeros((0, dim), np.float32))
  return paths, embeddings.astype(np.float32)


_WORKDIR = flags.DEFINE_string("workdir", None, "The run's folder.")
_IMAGES = flags.DEFINE_string("images", None, "Folder of images to embed.")
_OUT = flags.DEFINE_string("out", None, "Output .npz file.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Images per forward pass.")
_WHICH = flags.DEFINE_enum("checkpoint", None, ["best", "latest"],
                           "Checkpoint to use (default: best if any).")


def main(argv: Sequence[str]):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  for flag in (_WORKDIR, _IMAGES, _OUT):
    if not flag.value:
      raise app.UsageError(f"--{flag.name} is required.")
  paths, embeddings = embed_folder(_WORKDIR.value, _IMAGES.value,
                                   batch_size=_BATCH.value, which=_WHICH.value)
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  np.savez(_OUT.value, paths=np.asarray(paths, dtype=str),
           embeddings=embeddings)
  logging.info("Wrote %d embeddings of dimension %d to %s.", len(paths),
               embeddings.shape[1], _OUT.value)
  print(f"{len(paths)} embeddings -> {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
