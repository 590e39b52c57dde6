"""Preprocessing presets: exact values, geometry, randomness, errors."""

import io

import numpy as np
import pytest
from PIL import Image

from circle_jax import data
from circle_jax.data import augment


def png(array, mode=None):
  buf = io.BytesIO()
  Image.fromarray(np.asarray(array, np.uint8), mode).save(buf, format="PNG")
  return buf.getvalue()


SOLID = png(np.broadcast_to(np.uint8([10, 20, 30]), (260, 300, 3)))


@pytest.mark.parametrize("train", [False, True])
def test_bninception_is_bgr_times_255_minus_caffe_mean(train):
  p = data.get_preprocess("bninception", train=train)
  x = p(SOLID, np.random.default_rng(0))
  assert x.shape == (224, 224, 3) and x.dtype == np.float32
  np.testing.assert_allclose(x, np.broadcast_to([30 - 104., 20 - 117., 10 - 128.],
                                                x.shape), atol=1e-4)


@pytest.mark.parametrize("train", [False, True])
def test_imagenet_is_rgb_mean_std(train):
  p = data.get_preprocess("imagenet", train=train, image_size=227)
  x = p(SOLID, np.random.default_rng(0))
  assert x.shape == (227, 227, 3)
  want = (np.array([10, 20, 30]) / 255 - np.array([0.485, 0.456, 0.406])) / (
      np.array([0.229, 0.224, 0.225]))
  np.testing.assert_allclose(x, np.broadcast_to(want, x.shape), atol=1e-5)


def test_eval_geometry_resize_shorter_then_centre_crop():
  im = Image.new("RGB", (400, 300))
  assert augment.resize_shorter(im, 256).size == (341, 256)
  assert augment.resize_shorter(Image.new("RGB", (300, 400)), 256).size == (
      256, 341)
  a = np.arange(8 * 10, dtype=np.uint8).reshape(8, 10)  # h=8, w=10
  crop = np.asarray(augment.center_crop(Image.fromarray(a), 4))
  np.testing.assert_array_equal(crop, a[2:6, 3:7])
  # A red band on the left 40 of 400 columns is cropped away by
  # resize-256 + centre-crop-224 (it spans 34 of 341 columns, the crop
  # starts at column 58).
  arr = np.zeros((300, 400, 3), np.uint8)
  arr[:, :40] = [255, 0, 0]
  arr[:, 40:] = [0, 0, 255]
  x = data.get_preprocess("imagenet", train=False)(png(arr))
  red = (np.array([1., 0, 0]) - [0.485, 0.456, 0.406]) / [0.229, 0.224, 0.225]
  assert not np.isclose(x[..., 0], red[0], atol=0.1).any()


def test_train_ranges_and_determinism():
  rng = np.random.default_rng(0)
  photo = png(rng.integers(0, 256, (90, 120, 3)))
  for preset, lo, hi in (("bninception", -128, 255 - 104),
                         ("imagenet", -0.485 / 0.229, (1 - 0.406) / 0.225)):
    p = data.get_preprocess(preset, train=True, image_size=32)
    outs = [p(photo, np.random.default_rng(s)) for s in range(6)]
    for x in outs:
      assert x.shape == (32, 32, 3) and x.dtype == np.float32
      assert lo - 1e-3 <= x.min() and x.max() <= hi + 1e-3
    np.testing.assert_array_equal(outs[0], p(photo, np.random.default_rng(0)))
    assert not np.array_equal(outs[0], outs[1])


def test_random_resized_crop_box_respects_scale_and_ratio():
  rng = np.random.default_rng(0)
  for _ in range(300):
    l, t, r, b = augment.random_resized_crop_box(200, 150, rng, (0.16, 1.0))
    w, h = r - l, b - t
    assert 0 <= l < r <= 200 and 0 <= t < b <= 150
    assert 0.16 - 0.01 <= w * h / (200 * 150) <= 1.0
    assert 3 / 4 - 0.02 <= w / h <= 4 / 3 + 0.02
  # Fallback for an extreme aspect: centred crop with the ratio clamped.
  box = augment.random_resized_crop_box(1000, 10, rng, (0.9, 1.0))
  assert box == (493, 0, 506, 10)  # w = round(10 * 4/3) = 13


def test_flip_happens_about_half_the_time():
  a = np.zeros((16, 16, 3), np.uint8)
  a[:, :4] = 255  # bright left edge
  p = data.get_preprocess("bninception", train=True, image_size=16,
                          scale=(1.0, 1.0), ratio=(1.0, 1.0))
  lefts = [p(png(a), np.random.default_rng(s))[:, 0, 0].mean() > 0
           for s in range(40)]
  assert 8 < sum(lefts) < 32
  q = data.get_preprocess("bninception", train=True, image_size=16,
                          scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False)
  assert all(q(png(a), np.random.default_rng(s))[:, 0, 0].mean() > 0
             for s in range(10))


def test_grayscale():
  digit = np.zeros((8, 8), np.uint8)
  digit[2:6, 3:5] = 255
  p = data.get_preprocess("grayscale", train=False, image_size=16)
  x = p(png(digit))
  assert x.shape == (16, 16, 1) and x.dtype == np.float32
  assert x.min() >= 0 and x.max() <= 1 and x.max() > 0.9
  np.testing.assert_allclose(p(png(np.full((105, 105), 255))), 1.0)
  # RGB input is converted to one channel; size 105 keeps Omniglot as is.
  y = data.get_preprocess("grayscale", train=True, image_size=105)(
      SOLID, np.random.default_rng(0))
  assert y.shape == (105, 105, 1)


def test_palette_alpha_and_gray_inputs_become_rgb():
  p = data.get_preprocess("imagenet", train=False, image_size=8, resize_size=8)
  gray = png(np.full((10, 10), 128))
  pal = Image.new("P", (10, 10))
  buf = io.BytesIO()
  pal.save(buf, format="PNG")
  rgba = png(np.zeros((10, 10, 4)), "RGBA")  # transparent -> white
  for b in (gray, buf.getvalue(), rgba):
    assert p(b).shape == (8, 8, 3)
  np.testing.assert_allclose(
      p(rgba), np.broadcast_to((1 - np.array([0.485, 0.456, 0.406])) /
                               [0.229, 0.224, 0.225], (8, 8, 3)), atol=1e-5)


def test_errors():
  with pytest.raises(ValueError, match="bninception, imagenet, grayscale"):
    data.get_preprocess("vgg", train=True)
  with pytest.raises(ValueError, match="resize_size"):
    data.get_preprocess("imagenet", train=False, image_size=256,
                        resize_size=224)
  with pytest.raises(ValueError, match="scale"):
    data.get_preprocess("imagenet", train=True, scale=(0.5, 0.2))
  with pytest.raises(ValueError, match="rng"):
    data.get_preprocess("imagenet", train=True)(SOLID)
  with pytest.raises(data.ImageDecodeError, match="birds/0042.jpg"):
    data.get_preprocess("imagenet", train=False)(b"\xff\xd8garbage",
                                                 where="birds/0042.jpg")
