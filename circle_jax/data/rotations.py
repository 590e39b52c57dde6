"""Rotation classes: each train class and its rotated copies as new classes.

The standard few-shot practice on Omniglot (Vinyals et al., "Matching Networks
for One Shot Learning", NeurIPS 2016; Snell, Swersky, Zemel, "Prototypical
Networks for Few-shot Learning", NeurIPS 2017): a character rotated by 90,
180 or 270 degrees is a new character, which multiplies the train classes by
4. :class:`RotatedClasses` is a random-access view of a train source with
``R`` copies of every record, copy ``k`` rotated counter-clockwise by
``k * 360 / R`` degrees and labelled as class ``k * C + label``.

Mirror classes (``mirror=True``): a character flipped left to right is a new
character too, which doubles the classes again; with ``R = 4`` the copies are
the 8 symmetries of the square. Like a rotation, a mirrored character is
usually not a character of the alphabet, so it is a new class, not an
augmentation of its own.

Only the classes a model trains on are rotated: the trainer holds out the
validation characters first (:func:`circle_jax.data.split_classes`, so no
rotation of a held-out character is trained on) and wraps the kept ones;
validation and test characters are evaluated upright.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

from circle_jax.data import builders

ROTATIONS = (1, 2, 4)  # R: rotations by multiples of 360 / R degrees

# PIL's exact (lossless) counter-clockwise rotations by 0, 90, 180, 270 deg.
_TRANSPOSE = {1: Image.Transpose.ROTATE_90, 2: Image.Transpose.ROTATE_180,
              3: Image.Transpose.ROTATE_270}


def class_copies(rotations: int, mirror: bool = False) -> int:
  """How many classes each class becomes: ``R``, or ``2 R`` with mirror
  images (what :class:`RotatedClasses` makes of a source)."""
  return int(rotations) * (2 if mirror else 1)


def rotate_encoded(data: bytes, quarter_turns: int, *,
                   mirror: bool = False) -> bytes:
  """Encoded image bytes rotated counter-clockwise by ``90 * quarter_turns``
  (after a left-right flip with ``mirror``).

  ``quarter_turns % 4 == 0`` without ``mirror`` returns ``data`` itself;
  otherwise the image is decoded, transformed exactly (a permutation of the
  pixel grid, no resampling) and re-encoded as PNG (lossless), in its own
  mode.
  """
  quarter_turns %= 4
  if not quarter_turns and not mirror:
    return data
  with Image.open(io.BytesIO(bytes(data))) as im:
    im.load()
    rotated = im
    if mirror:
      rotated = rotated.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if quarter_turns:
      rotated = rotated.transpose(_TRANSPOSE[quarter_turns])
  out = io.BytesIO()
  rotated.save(out, format="PNG", compress_level=0)  # fast; never stored
  return out.getvalue()


class RotatedClasses:
  """Random-access view of a source with rotated (and mirrored) copies of
  each class.

  Record ``k * N + i`` (``N = len(source)``, ``0 <= k < M``, ``M = R`` or
  ``2 R`` with ``mirror``) is record ``i`` of `source`, flipped left to right
  when ``k >= R``, then rotated counter-clockwise by ``(k mod R) * 360 / R``
  degrees, with label ``k * C + label_i`` (``C`` = the source's class
  count): copy 0 is the source unchanged, with its labels. Supports what the
  pipelines use (``len``, ``source[i]``, ``source.__getitems__(indices)``,
  :attr:`labels`) and is picklable when the source is.

  Args:
    source: a random-access source of ``{'image': bytes, 'label', ...}``
      records with labels ``0 .. C-1``.
    rotations: ``R``, one of :data:`ROTATIONS` (1: no rotated copy).
    mirror: also the left-right mirror image of every rotated copy.

  Raises:
    ValueError: `rotations` is not one of :data:`ROTATIONS`.
  """

  def __init__(self, source: Any, rotations: int, *, mirror: bool = False):
    if rotations not in ROTATIONS:
      raise ValueError(f"`rotations` must be one of {ROTATIONS} (rotations by "
                       f"multiples of 90 degrees); got {rotations!r}.")
    base = builders.split_labels(source)
    self.source = source
    self.rotations = int(rotations)
    self.mirror = bool(mirror)
    self.copies = class_copies(self.rotations, self.mirror)
    self.num_base_records = len(base)
    self.num_base_classes = int(base.max()) + 1
    self.labels = np.concatenate(
        [base + k * self.num_base_classes for k in range(self.copies)])

  def __len__(self) -> int:
    return len(self.labels)

  def _locate(self, i: int):
    if not 0 <= i < len(self):
      raise IndexError(f"record {i} out of range for {len(self)} records.")
    return divmod(i, self.num_base_records)

  def _record(self, record, i: int, k: int):
    record = dict(record)
    record["image"] = rotate_encoded(
        record["image"], (k % self.rotations) * 4 // self.rotations,
        mirror=k >= self.rotations)
    record["label"] = self.labels[i]
    return record

  def __getitem__(self, i):
    i = int(i)
    k, base = self._locate(i)
    return self._record(self.source[base], i, k)

  def __getitems__(self, keys):
    keys = [int(key) for key in keys]
    located = [self._locate(key) for key in keys]
    getitems = getattr(self.source, "__getitems__", None)
    outer = [base for _, base in located]
    records = (getitems(outer) if getitems is not None
               else [self.source[b] for b in outer])
    return [self._record(r, key, k)
            for r, key, (k, _) in zip(records, keys, located)]
