"""The grayscale_affine preset: hand-checked maps, identity, determinism."""

import io

import numpy as np
import pytest
from PIL import Image

from circle_jax import data
from circle_jax.data import augment


def png(array):
  buf = io.BytesIO()
  Image.fromarray(np.asarray(array, np.uint8)).save(buf, format="PNG")
  return buf.getvalue()


def stroke_image(size=20):
  """A black 'L' stroke on white paper, like an Omniglot character."""
  a = np.full((size, size), 255, np.uint8)
  a[4:15, 6:9] = 0
  a[12:15, 6:14] = 0
  return a


def test_integer_shift_by_hand():
  a = np.zeros((5, 6), np.uint8)
  a[1, 2] = 200
  a[3, 4] = 100
  im = Image.fromarray(a)
  moved = np.asarray(augment.affine_transform(im, shift=(1, 2), fill=7))
  want = np.full((5, 6), 7, np.uint8)   # right 1, down 2; the rest is fill
  want[2:, 1:] = a[:3, :5]
  np.testing.assert_array_equal(moved, want)
  assert moved[3, 3] == 200 and moved[0, 0] == 7
  back = np.asarray(augment.affine_transform(im, shift=(-2, 0), fill=0))
  np.testing.assert_array_equal(back[:, :4], a[:, 2:])
  np.testing.assert_array_equal(back[:, 4:], 0)


def test_quarter_turn_and_identity_by_hand():
  a = np.arange(16, dtype=np.uint8).reshape(4, 4) * 10
  im = Image.fromarray(a)
  np.testing.assert_array_equal(np.asarray(augment.affine_transform(im)), a)
  # 90 degrees counter-clockwise about the centre of a 4x4 grid = rot90.
  np.testing.assert_array_equal(
      np.asarray(augment.affine_transform(im, degrees=90)), np.rot90(a))
  # Scale 2 about the centre: the centre 2x2 block fills the image.
  b = np.zeros((4, 4), np.uint8)
  b[1:3, 1:3] = 255
  up = np.asarray(augment.affine_transform(Image.fromarray(b), scale=2.0))
  assert up.min() > 0 and up[1:3, 1:3].min() == 255


def test_border_mode_is_the_paper():
  assert augment.border_mode(Image.fromarray(stroke_image())) == 255
  assert augment.border_mode(Image.fromarray(np.zeros((4, 4), np.uint8))) == 0


def test_zero_ranges_are_the_grayscale_preset():
  img = png(stroke_image(30))
  plain = data.get_preprocess("grayscale", train=False, image_size=28)
  still = data.get_preprocess("grayscale_affine", train=True, image_size=28,
                              affine_shift=0, affine_degrees=0,
                              affine_scale=(1, 1), affine_shear=0)
  for s in range(3):
    np.testing.assert_array_equal(still(img, np.random.default_rng(s)),
                                  plain(img))
  # The eval variant is the plain preset, whatever the ranges.
  ev = data.get_preprocess("grayscale_affine", train=False, image_size=28)
  np.testing.assert_array_equal(ev(img), plain(img))


def test_train_variant_is_random_deterministic_and_in_range():
  img = png(stroke_image(30))
  p = data.get_preprocess("grayscale_affine", train=True, image_size=28)
  assert (p.affine_shift, p.affine_degrees, p.affine_scale, p.affine_shear) == (
      0.1, 10.0, (0.9, 1.1), 10.0)
  plain = data.get_preprocess("grayscale", train=False, image_size=28)(img)
  outs = [p(img, np.random.default_rng([0, 1, 5, j])) for j in range(4)]
  for x in outs:
    assert x.shape == (28, 28, 1) and x.dtype == np.float32
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert x[0, 0, 0] == 1.0   # the fill is the white paper
    # The stroke stays in view, about as large.
    assert 0.6 < (x < 0.5).sum() / (plain < 0.5).sum() < 1.6
  np.testing.assert_array_equal(outs[2],
                                p(img, np.random.default_rng([0, 1, 5, 2])))
  assert not np.array_equal(outs[0], outs[1])
  assert not any(np.array_equal(x, plain) for x in outs)
  with pytest.raises(ValueError, match="needs `rng`"):
    p(img)


def test_random_shift_only_moves_by_the_drawn_amount():
  a = stroke_image(20)
  im = Image.fromarray(a)
  rng = np.random.default_rng(3)
  out = augment.random_affine(im, rng, shift=0.25, degrees=0.0,
                              scale=(1.0, 1.0), shear=0.0)
  u = np.random.default_rng(3).uniform(-1.0, 1.0, size=2) * 0.25 * 20
  want = augment.affine_transform(im, shift=tuple(u), fill=255)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  # The stroke's centre of mass moves by the drawn shift.
  mass = lambda x: np.array(np.nonzero(np.asarray(x) < 128)).mean(1)[::-1]
  np.testing.assert_allclose(mass(out) - mass(a), u, atol=0.6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(affine_shift=0.6), "affine_shift"),
    (dict(affine_degrees=-1), "affine_degrees"),
    (dict(affine_scale=(1.2, 1.1)), "affine_scale"),
    (dict(affine_shear=90), "affine_shear"),
    (dict(elastic_alpha=-1.0), "elastic_alpha"),
    (dict(elastic_alpha=8.0, elastic_sigma=0.0), "elastic_sigma"),
])
def test_bad_ranges(kwargs, match):
  with pytest.raises(ValueError, match=match):
    data.get_preprocess("grayscale_affine", train=True, **kwargs)


def test_affine_ranges_only_for_grayscale_affine():
  with pytest.raises(ValueError, match="only apply to the 'grayscale_affine'"):
    data.get_preprocess("grayscale", train=True, affine_shift=0.1)
  assert data.get_preprocess("grayscale", train=True).affine_shift == 0.0
  with pytest.raises(ValueError, match="only apply to the 'grayscale_affine'"):
    data.get_preprocess("grayscale", train=True, elastic_alpha=8.0)


def test_config_checks_name_the_preprocess_field():
  from circle_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from circle_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  c = config_lib.base_config()
  c.dataset.name = "omniglot_small"
  c.dataset.preprocess.preset = "grayscale_affine"
  config_checks.check_config(c, device_count=1)
  c.dataset.preprocess.affine_degrees = 200.0
  with pytest.raises(config_checks.ConfigError,
                     match=r"^config\.dataset\.preprocess: `affine_degrees` "
                           r"must be in \[0, 180\]; got 200.0"):
    config_checks.check_config(c, device_count=1)
  c.dataset.preprocess.preset = "grayscale"
  c.dataset.preprocess.affine_degrees = 5.0
  with pytest.raises(config_checks.ConfigError,
                     match="only apply to the 'grayscale_affine' preset"):
    config_checks.check_config(c, device_count=1)


def _naive_elastic(x, d, alpha, sigma, fill):
  """float64 loops: output (i, j) samples x bilinearly at (i + dy, j + dx)."""
  from scipy import ndimage  # pylint: disable=g-import-not-at-top
  dx = ndimage.gaussian_filter(d[0], sigma, mode="constant") * alpha
  dy = ndimage.gaussian_filter(d[1], sigma, mode="constant") * alpha
  h, w = x.shape
  at = lambda i, j: x[i, j] if 0 <= i < h and 0 <= j < w else fill
  out = np.zeros((h, w))
  for i in range(h):
    for j in range(w):
      y, xx = i + dy[i, j], j + dx[i, j]
      i0, j0 = int(np.floor(y)), int(np.floor(xx))
      fy, fx = y - i0, xx - j0
      out[i, j] = ((1 - fy) * (1 - fx) * at(i0, j0) + (1 - fy) * fx
                   * at(i0, j0 + 1) + fy * (1 - fx) * at(i0 + 1, j0)
                   + fy * fx * at(i0 + 1, j0 + 1))
  return out


def test_elastic_distortion_against_naive_sampling():
  x = stroke_image(12).astype(np.float64) / 255.0
  out = augment.elastic_distort(x, np.random.default_rng(5), alpha=6.0,
                                sigma=2.0, fill=1.0)
  d = np.random.default_rng(5).uniform(-1.0, 1.0, size=(2, 12, 12))
  np.testing.assert_allclose(out, _naive_elastic(x, d, 6.0, 2.0, 1.0),
                             atol=1e-9)
  assert not np.allclose(out, x)
  # alpha 0: the image itself, nothing drawn.
  rng = np.random.default_rng(1)
  assert augment.elastic_distort(x, rng, alpha=0.0, sigma=4.0, fill=1.0) is x
  assert rng.uniform() == np.random.default_rng(1).uniform()
  # Blank paper stays blank.
  np.testing.assert_allclose(augment.elastic_distort(
      np.ones((9, 9)), np.random.default_rng(0), alpha=30.0, sigma=3.0,
      fill=1.0), 1.0)


def test_elastic_preset_is_deterministic_train_only_and_in_range():
  data_bytes = png(stroke_image(40))
  pre = data.get_preprocess("grayscale_affine", train=True, image_size=20,
                            elastic_alpha=16.0)
  plain = data.get_preprocess("grayscale_affine", train=True, image_size=20)
  a = pre(data_bytes, np.random.default_rng(3))
  np.testing.assert_array_equal(a, pre(data_bytes, np.random.default_rng(3)))
  assert a.shape == (20, 20, 1) and a.dtype == np.float32
  assert 0.0 <= a.min() and a.max() <= 1.0
  # The affine draw comes first, so without elasticity it is the same image
  # before the distortion.
  b = plain(data_bytes, np.random.default_rng(3))
  assert not np.allclose(a, b)
  assert abs(float(a.mean()) - float(b.mean())) < 0.05  # ink moved, not made
  ev = data.get_preprocess("grayscale_affine", train=False, image_size=20,
                           elastic_alpha=16.0)
  np.testing.assert_array_equal(
      ev(data_bytes), data.get_preprocess("grayscale", train=False,
                                          image_size=20)(data_bytes))
