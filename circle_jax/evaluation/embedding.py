"""The evaluation's forward pass and its one embedding loop.

The trainer's evaluator (:mod:`circle_jax.train.evaluate`), a restored run
(:mod:`circle_jax.train.restore`), the embedding tool
(:mod:`circle_jax.embed`) and the experiment scripts embed through these
functions, so every evaluation sees the model the same way:

* :func:`eval_apply`: the model in eval mode, with the test-time shifts of
  ``config.eval_shift`` (:func:`model_apply`, :func:`shifted_views`);
* :func:`embed_split`: a whole split in padded, masked batches on a
  placement (:mod:`circle_jax.parallel`), returned in record order. It takes
  any ``apply_fn``, e.g. a ``vmap`` over a stack of models;
* :func:`views_apply`: each image's unit embeddings under a set of small
  shifts and rotations (:func:`affine_views`), for matching by alignment
  (:func:`circle_jax.evaluation.omniglot_oneshot.aligned_similarity`).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from circle_jax import data as data_lib
from circle_jax import ops
from circle_jax import parallel


def shifted_views(images: jax.Array, shift: int) -> jax.Array:
  """``[5, b, H, W, C]``: the images, then shifted by ``shift`` pixels down,
  up, right and left; the uncovered border repeats the edge pixels."""
  s = int(shift)
  h, w = images.shape[1:3]
  padded = jnp.pad(images, ((0, 0), (s, s), (s, s), (0, 0)), mode="edge")
  offsets = ((0, 0), (-s, 0), (s, 0), (0, -s), (0, s))
  return jnp.stack([padded[:, s + dy:s + dy + h, s + dx:s + dx + w]
                    for dy, dx in offsets])


def affine_views(images: jax.Array, *, shift: int,
                 angles: Sequence[float] = (0.0,)) -> jax.Array:
  """``[V, b, H, W, C]``: each image rotated by each of ``angles`` (degrees,
  counter-clockwise about the image centre) and shifted by every ``(dy, dx)``
  in ``[-shift, shift]^2`` (pixels, down and right): ``V = len(angles) *
  (2 shift + 1)^2`` views, ordered angle, then ``dy``, then ``dx``.

  Pixels are resampled bilinearly; positions outside the image take the
  nearest edge pixel, as in :func:`shifted_views`. Angle 0 with integer
  shifts moves pixels exactly.
  """
  s = int(shift)
  h, w = images.shape[1:3]
  yy, xx = jnp.meshgrid(jnp.arange(h, dtype=jnp.float32),
                        jnp.arange(w, dtype=jnp.float32), indexing="ij")
  cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
  views = []
  for angle in angles:
    t = np.deg2rad(float(angle))
    cos, sin = float(np.cos(t)), float(np.sin(t))
    for dy in range(-s, s + 1):
      for dx in range(-s, s + 1):
        # Output (y, x) reads the input where the inverse motion sends it:
        # undo the shift, then rotate back about the centre.
        y0, x0 = yy - cy - dy, xx - cx - dx
        coords = [cos * y0 + sin * x0 + cy, -sin * y0 + cos * x0 + cx]
        views.append(jax.vmap(jax.vmap(
            lambda im, c=coords: jax.scipy.ndimage.map_coordinates(
                im, c, order=1, mode="nearest"),
            in_axes=-1, out_axes=-1))(images))
  return jnp.stack(views)


def model_apply(model, shift: int = 0) -> Callable:
  """``apply_fn(variables, images)``: the model in eval mode.

  With ``shift > 0`` (``config.eval_shift``), test-time augmentation: the
  mean of the L2-normalised outputs of the 5 :func:`shifted_views` of each
  image, run as one batch of ``5 b``. Its norm is at most 1; cosine
  similarities ignore it.

  A model whose head does not normalise (``normalize=False``: a loss on the
  Poincaré ball) is evaluated on the L2-normalised features, by cosine like
  every other: the ball's clipping puts features longer than ``r`` on one
  sphere, and the Poincaré distance from any query to candidates of one
  norm is an increasing function of their angle, so both rank the
  candidates alike (exactly, when every candidate is clipped).
  """
  apply = functools.partial(model.apply, train=False)
  if not getattr(model, "normalize", True):
    raw = apply

    def apply(variables, images):  # pylint: disable=function-redefined
      return ops.l2_normalize(raw(variables, images))
  if not shift:
    return apply

  def apply_shifted(variables, images):
    # Image-major [b, 5, ...] -> [5 b, ...]: each image's views stay next to
    # it, so a batch sharded over devices stays sharded through the reshape.
    # View-major [5, b] -> [5 b] made XLA's partitioner run the whole batch
    # on every device (8 devices: 7x the single-device time).
    views = jnp.swapaxes(shifted_views(images, shift), 0, 1)
    out = apply(variables, views.reshape((-1,) + images.shape[1:]))
    out = out.reshape(views.shape[:2] + out.shape[1:])
    return ops.l2_normalize(out).mean(axis=1)

  return apply_shifted


def views_apply(model, *, shift: int, angles: Sequence[float] = (0.0,)
                ) -> Callable:
  """``apply_fn(variables, images) -> [b, V, D]``: the unit embedding of each
  of an image's :func:`affine_views`, by the model in eval mode
  (:func:`model_apply` without test-time shift).

  The views are embedded one after the other (``lax.map``), each as one
  batch of ``b``: memory stays that of one batch for any number of views.
  """
  apply = model_apply(model)

  def apply_views(variables, images):
    views = affine_views(images, shift=shift, angles=angles)
    out = jax.lax.map(lambda v: ops.l2_normalize(apply(variables, v)), views)
    return jnp.swapaxes(out, 0, 1)

  return apply_views


def eval_apply(config, model) -> Callable:
  """The evaluation's ``apply_fn``: :func:`model_apply` with the config's
  ``eval_shift``."""
  return model_apply(model, config.eval_shift)


def embed_split(variables, apply_fn: Callable, source, preprocess, *,
                placement: parallel.Placement, batch_size: int,
                num_threads: int) -> Tuple[np.ndarray, np.ndarray]:
  """Embeds a whole split as the evaluation does.

  Args:
    variables: host (numpy) variables of ``apply_fn``, identical on every
      process.
    apply_fn: ``apply_fn(variables, images [b, H, W, C]) -> [b, ...]`` in
      eval mode (:func:`model_apply`; any trailing shape).
    source: a random-access source (``circle_jax.data.load_split``).
    preprocess: the eval preset (e.g.
      :func:`circle_jax.config_facts.eval_preprocess`).
    placement: where the forward pass runs (the run's placement).
    batch_size: global batch size (a multiple of the devices).
    num_threads: decoding threads.

  Returns:
    ``(outputs [N, ...] float32, labels [N])`` in record order, on every
    process.
  """
  embed = placement.embed_fn(apply_fn)
  variables = placement.replicate(variables)
  embs, labels, index = [], [], []
  for batch in data_lib.eval_iterator(source, preprocess=preprocess,
                                      batch_size=batch_size,
                                      num_threads=num_threads):
    out = placement.gather(embed(variables,
                                 placement.shard_batch(batch["image"])))
    rest = {k: batch[k] for k in ("label", "mask", "index")}
    if jax.process_count() > 1:
      rest = {k: multihost_utils.process_allgather(v, tiled=True)
              for k, v in rest.items()}
    mask = np.asarray(rest["mask"], bool)
    embs.append(out[mask])
    labels.append(np.asarray(rest["label"])[mask])
    index.append(np.asarray(rest["index"])[mask])
  order = np.argsort(np.concatenate(index), kind="stable")
  return np.concatenate(embs)[order], np.concatenate(labels)[order]
