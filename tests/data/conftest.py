"""Fixtures of the data tests: builds into temporary directories."""

import pytest
import tensorflow_datasets as tfds

tfds.disable_progress_bar()


@pytest.fixture(scope="session")
def omniglot_small_dir(tmp_path_factory):
  """`omniglot_small` built once per session from the bundled real archives
  (no manual_dir: the builder finds the zips shipped with the package)."""
  from circle_jax import data  # pylint: disable=g-import-not-at-top
  data_dir = tmp_path_factory.mktemp("omniglot_small_data")
  data.load_split("omniglot_small", "train", data_dir=data_dir)
  return data_dir


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory):
  """`digits` built once per session (no files needed)."""
  from circle_jax import data  # pylint: disable=g-import-not-at-top
  data_dir = tmp_path_factory.mktemp("digits_data")
  data.load_split("digits", "train", data_dir=data_dir)
  return data_dir
