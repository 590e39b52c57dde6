"""Tests of circle_jax/evaluation/ks.py: the Recall@K cut-offs each
benchmark reports, read from the dataset registry on first use."""

import os
import subprocess
import sys

import pytest

from circle_jax.evaluation import DEFAULT_KS, default_ks


def test_default_ks():
  assert default_ks("sop") == (1, 10, 100, 1000)
  assert default_ks("Stanford_Online_Products") == (1, 10, 100, 1000)
  assert default_ks("inshop") == (1, 10, 20, 30, 40)
  assert default_ks("in-shop") == (1, 10, 20, 30, 40)
  assert default_ks("CUB200") == default_ks("cub_200_2011") == (1, 2, 4, 8)
  assert default_ks("cars196") == (1, 2, 4, 8)
  for name in ("omniglot", "omniglot_small", "digits"):
    assert default_ks(name) == (1, 2, 4, 8)
  assert default_ks("inaturalist2018") == (1, 4, 16, 32)
  assert set(DEFAULT_KS) == {"cub200", "cars196", "sop", "inshop", "omniglot",
                             "omniglot_small", "digits", "inaturalist2018"}
  with pytest.raises(ValueError, match="known datasets"):
    default_ks("imagenet")
  with pytest.raises(KeyError):
    DEFAULT_KS["imagenet"]


def test_importing_the_evaluation_does_not_load_the_dataset_registry():
  # DEFAULT_KS reads circle_jax.data (and tensorflow_datasets) on first use.
  code = ("import sys; from circle_jax import evaluation; "
          "assert 'tensorflow_datasets' not in sys.modules; "
          "assert evaluation.DEFAULT_KS['sop'] == (1, 10, 100, 1000); "
          "assert 'circle_jax.data.registry' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True,
                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
