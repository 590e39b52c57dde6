"""Split finalisation, record order and label metadata (source trees:
test_sources.py)."""

import numpy as np
import pytest

from circle_jax.data import builders
from circle_jax.data.builders import base
from tests.data import fixtures

def test_finalize_split_sorts_and_ranks():
  ims = [base.PlannedImage("s", p, p, k) for p, k in
         [("b", 7), ("a", 7), ("c", 3), ("d", 9)]]
  images, labels, keys = base.finalize_split(ims)
  assert [im.path for im in images] == ["c", "a", "b", "d"]
  np.testing.assert_array_equal(labels, [0, 1, 1, 2])
  assert keys == [3, 7, 9]
  _, labels, _ = base.finalize_split(ims, class_keys=[1, 3, 7, 9])
  np.testing.assert_array_equal(labels, [1, 2, 2, 3])


def test_keys_preserve_order_across_tfds_buckets():
  # Integer keys are spread over tfds' hash range: strictly increasing and
  # falling into increasing buckets of its 1000-bucket shuffler.
  from tensorflow_datasets.core import shuffle  # pylint: disable=g-import-not-at-top
  n = 120_000
  keys = [base._key(i, n) for i in range(0, n, 997)] + [base._key(n - 1, n)]
  assert keys == sorted(set(keys)) and keys[-1] < 2**128
  buckets = [shuffle.get_bucket_number(k, shuffle.BUCKETS_NUMBER) for k in keys]
  assert buckets == sorted(buckets) and buckets[-1] == shuffle.BUCKETS_NUMBER - 1


def test_split_labels_falls_back_to_reading_records():
  records = [{"label": 2}, {"label": 0}, {"label": 1}]
  np.testing.assert_array_equal(builders.split_labels(records), [2, 0, 1])


def test_check_image():
  base.check_image(fixtures.encode("PNG", 0), "ok.png")
  with pytest.raises(builders.CorruptImageError, match="bad.png"):
    base.check_image(b"\x89PNG\r\n\x1a\n garbage", "bad.png")
