"""digits: scikit-learn's bundled digits, 0-4 train / 5-9 test."""

import io

import numpy as np
from PIL import Image
from sklearn import datasets

from circle_jax import data


def test_digits_splits_and_pixels(digits_dir):
  d = datasets.load_digits()
  for split, digits in (("train", range(5)), ("test", range(5, 10))):
    src = data.load_split("digits", split, data_dir=digits_dir)
    assert len(src) == int(np.isin(d.target, digits).sum())
    labels = data.split_labels(src)
    np.testing.assert_array_equal(np.unique(labels), np.arange(5))
    for i in range(0, len(src), 37):
      r = src[i]
      index = int(r["path"].decode().split("/")[1])
      assert d.target[index] == digits[r["label"]] == digits[labels[i]]
      pixels = np.asarray(Image.open(io.BytesIO(r["image"])))
      np.testing.assert_array_equal(
          pixels, np.round(d.images[index] * 255 / 16).astype(np.uint8))
  assert len(data.load_split("digits", "train", data_dir=digits_dir)) == 901
  assert len(data.load_split("digits", "test", data_dir=digits_dir)) == 896
