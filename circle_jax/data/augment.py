"""Image preprocessing presets of the deep-metric-learning papers (PIL/numpy).

A preset turns encoded image bytes into a float32 ``[H, W, C]`` array. It runs
in the input pipeline's worker threads/processes (:mod:`.pipeline`), with an
explicit ``numpy.random.Generator`` for the random parts, so every augmented
image is a deterministic function of ``(seed, step, position in the batch)``.

Presets (``get_preprocess(name, train=...)``):

``imagenet``
  RGB in [0, 1], then ``(x - mean) / std`` with the ImageNet statistics
  mean = (0.485, 0.456, 0.406), std = (0.229, 0.224, 0.225) (ResNet-50).
``bninception``
  BGR channel order, values x255 (0..255), minus mean (104, 117, 128), std 1:
  the Caffe BN-Inception convention used by the Multi-Similarity, Circle and
  Proxy-Anchor code.
``grayscale``
  One channel in [0, 1] (white = 1), resized to ``image_size`` (e.g. 28 or
  105 for Omniglot); for Omniglot and digits.

Train / eval variants (the torchvision transforms of the papers' code):

* train (RGB presets): random-resized-crop to ``image_size`` (area fraction
  ``scale``, default (0.08, 1) as in Proxy-Anchor; the MS code uses
  (0.16, 1)), aspect ratio in ``ratio`` = (3/4, 4/3), then a horizontal flip
  with probability 1/2.
* eval (RGB presets): resize the shorter side to ``resize_size`` (256)
  then centre-crop ``image_size`` (224, or 227 for the MS/Circle setting).
* grayscale: resize to ``image_size`` x ``image_size`` in both variants (no
  random augmentation unless ``flip=True`` is asked for).

Resizing uses PIL's bilinear filter, which antialiases when downsampling
(the behaviour of torchvision's PIL backend the papers used).
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Optional, Tuple

import numpy as np
from PIL import Image

from circle_jax.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
BNINCEPTION_MEAN_BGR = (104.0, 117.0, 128.0)

PRESETS = ("bninception", "imagenet", "grayscale")


class ImageDecodeError(UserError, ValueError):
  """An encoded image could not be decoded; the message names the file."""


def decode(data: bytes, mode: str, where: str = "<image>") -> Image.Image:
  """Decodes encoded image bytes to a PIL image in `mode` ('RGB' or 'L')."""
  try:
    with Image.open(io.BytesIO(bytes(data))) as im:
      im.load()
      if im.mode in ("RGBA", "LA", "P") and mode == "RGB":
        im = im.convert("RGBA")
        background = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(background, im)
      return im.convert(mode)
  except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, ...
    raise ImageDecodeError(
        f"Cannot decode image {where}: {type(e).__name__}: {e}") from e


def random_resized_crop_box(width: int, height: int, rng: np.random.Generator,
                            scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
  """Samples a crop box ``(left, top, right, bottom)`` like torchvision.

  Ten tries to draw an area fraction uniformly in `scale` and a log-uniform
  aspect ratio in `ratio` that fit in the image; otherwise the largest
  centred crop with the aspect ratio clamped to `ratio`.
  """
  area = width * height
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(10):
    target_area = area * rng.uniform(scale[0], scale[1])
    aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
    w = int(round(math.sqrt(target_area * aspect)))
    h = int(round(math.sqrt(target_area / aspect)))
    if 0 < w <= width and 0 < h <= height:
      top = int(rng.integers(0, height - h + 1))
      left = int(rng.integers(0, width - w + 1))
      return left, top, left + w, top + h
  in_ratio = width / height
  if in_ratio < min(ratio):
    w, h = width, int(round(width / min(ratio)))
  elif in_ratio > max(ratio):
    h, w = height, int(round(height * max(ratio)))
  else:
    w, h = width, height
  top, left = (height - h) // 2, (width - w) // 2
  return left, top, left + w, top + h


def resize_shorter(im: Image.Image, size: int) -> Image.Image:
  """Resizes so the shorter side is `size`, keeping the aspect ratio."""
  w, h = im.size
  if w <= h:
    new = (size, max(1, int(size * h / w)))
  else:
    new = (max(1, int(size * w / h)), size)
  return im if new == (w, h) else im.resize(new, Image.BILINEAR)


def center_crop(im: Image.Image, size: int) -> Image.Image:
  """Centre crop to ``size x size`` (padding with black if the image is smaller)."""
  w, h = im.size
  if w < size or h < size:
    canvas = Image.new(im.mode, (max(w, size), max(h, size)))
    canvas.paste(im, ((max(w, size) - w) // 2, (max(h, size) - h) // 2))
    im, (w, h) = canvas, canvas.size
  top = int(round((h - size) / 2.0))
  left = int(round((w - size) / 2.0))
  return im.crop((left, top, left + size, top + size))


@dataclasses.dataclass(frozen=True)
class Preprocess:
  """A preprocessing function ``(bytes, rng) -> float32 [H, W, C]``.

  Build with :func:`get_preprocess`. Instances are immutable and picklable
  (they are sent to multiprocessing workers).

  Attributes:
    preset: 'bninception', 'imagenet' or 'grayscale'.
    train: train (random) or eval (deterministic) variant.
    image_size: output height and width.
    resize_size: eval RGB presets: shorter side before the centre crop.
    scale: train RGB presets: area fraction range of the random crop.
    ratio: train RGB presets: aspect-ratio range of the random crop.
    flip: whether the train variant flips horizontally with probability 1/2.
  """

  preset: str
  train: bool
  image_size: int
  resize_size: int
  scale: Tuple[float, float]
  ratio: Tuple[float, float]
  flip: bool

  @property
  def channels(self) -> int:
    return 1 if self.preset == "grayscale" else 3

  @property
  def output_shape(self) -> Tuple[int, int, int]:
    return (self.image_size, self.image_size, self.channels)

  def __call__(self, data: bytes, rng: Optional[np.random.Generator] = None,
               where: str = "<image>") -> np.ndarray:
    """Decodes and preprocesses one encoded image.

    Args:
      data: encoded image bytes (JPEG, PNG, ...).
      rng: random generator; required by the train variant.
      where: the image's name, used in error messages.

    Returns:
      float32 array ``[image_size, image_size, channels]``.
    """
    if self.train and rng is None:
      raise ValueError("The train variant of a preset needs `rng` "
                       "(a numpy.random.Generator).")
    size = self.image_size
    if self.preset == "grayscale":
      im = decode(data, "L", where)
      if im.size != (size, size):
        im = im.resize((size, size), Image.BILINEAR)
      if self.train and self.flip and rng.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
      x = np.asarray(im, np.float32)[..., None] * np.float32(1.0 / 255.0)
      return x
    im = decode(data, "RGB", where)
    if self.train:
      box = random_resized_crop_box(im.size[0], im.size[1], rng,
                                    self.scale, self.ratio)
      im = im.resize((size, size), Image.BILINEAR, box=box)
      if self.flip and rng.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    else:
      im = center_crop(resize_shorter(im, self.resize_size), size)
    x = np.asarray(im, np.float32)
    if self.preset == "imagenet":
      x = (x * np.float32(1.0 / 255.0) - np.float32(IMAGENET_MEAN)) / (
          np.float32(IMAGENET_STD))
    else:  # bninception: BGR, 0..255, minus the Caffe mean.
      x = x[..., ::-1] - np.float32(BNINCEPTION_MEAN_BGR)
    return np.ascontiguousarray(x, np.float32)


def get_preprocess(preset: str, *, train: bool, image_size: Optional[int] = None,
                   resize_size: Optional[int] = None,
                   scale: Tuple[float, float] = (0.08, 1.0),
                   ratio: Tuple[float, float] = (3 / 4, 4 / 3),
                   flip: Optional[bool] = None) -> Preprocess:
  """Returns a preprocessing preset by name.

  Args:
    preset: 'bninception', 'imagenet' or 'grayscale'.
    train: the random train variant or the deterministic eval variant.
    image_size: output size (default 224 for RGB presets, 28 for grayscale;
      use 227 for the MS/Circle BN-Inception setting, 105 for full-size
      Omniglot).
    resize_size: eval RGB presets: shorter side before the centre crop
      (default 256).
    scale: random-resized-crop area range (default (0.08, 1) as in
      Proxy-Anchor; (0.16, 1) as in Multi-Similarity).
    ratio: random-resized-crop aspect-ratio range.
    flip: random horizontal flip in the train variant (default True for RGB
      presets, False for grayscale: a mirrored character is another glyph).

  Returns:
    A :class:`Preprocess`.

  Raises:
    ValueError: for an unknown preset or invalid sizes/ranges.
  """
  if preset not in PRESETS:
    raise ValueError(f"Unknown preprocessing preset {preset!r}; known presets: "
                     f"{', '.join(PRESETS)}.")
  rgb = preset != "grayscale"
  image_size = int(image_size or (224 if rgb else 28))
  resize_size = int(resize_size or (256 if rgb else image_size))
  if image_size <= 0:
    raise ValueError(f"`image_size` must be positive; got {image_size}.")
  if rgb and resize_size < image_size:
    raise ValueError(f"`resize_size` ({resize_size}) must be >= `image_size` "
                     f"({image_size}) for the centre crop.")
  scale = (float(scale[0]), float(scale[1]))
  ratio = (float(ratio[0]), float(ratio[1]))
  if not 0 < scale[0] <= scale[1] <= 1:
    raise ValueError(f"`scale` must satisfy 0 < min <= max <= 1; got {scale}.")
  if not 0 < ratio[0] <= ratio[1]:
    raise ValueError(f"`ratio` must satisfy 0 < min <= max; got {ratio}.")
  if flip is None:
    flip = rgb
  return Preprocess(preset=preset, train=bool(train), image_size=image_size,
                    resize_size=resize_size, scale=scale, ratio=ratio,
                    flip=bool(flip))
