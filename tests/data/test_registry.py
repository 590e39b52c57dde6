"""Dataset names, their metadata, and load_split's argument checks."""

import pytest

from circle_jax import data
from circle_jax.data import builders

NAMES = ("cub200", "cars196", "sop", "inshop", "omniglot", "omniglot_small",
         "digits", "inaturalist2018")


def test_every_name_has_a_builder_and_consistent_sizes():
  assert tuple(data.DATASETS) == NAMES
  for name in NAMES:
    spec = data.get_dataset_info(name)
    builder = builders.BUILDERS[name]
    assert builder.name == name
    assert tuple(builder.SPLITS) == spec.splits
    assert spec.num_images == builder.EXPECTED_SIZES   # read from there
    with pytest.raises(TypeError):
      spec.num_images["train"] = 0                       # read-only
    p = spec.get_preprocess(train=False)
    assert p.channels == spec.channels and not p.train
    assert spec.get_preprocess(train=True, image_size=32).image_size == 32
    assert spec.ks_name == name and spec.ks[0] == 1


def test_class_counts_split_sizes_and_ks_of_the_official_splits():
  info = {n: data.get_dataset_info(n) for n in NAMES}
  assert [(info[n].num_train_classes, info[n].num_test_classes) for n in NAMES
          ] == [(100, 100), (98, 98), (11318, 11316), (3997, 3985), (964, 659),
                (136, 106), (5, 5), (5690, 2452)]
  assert [dict(info[n].num_images) for n in NAMES] == [
      {"train": 5864, "test": 5924}, {"train": 8054, "test": 8131},
      {"train": 59551, "test": 60502},
      {"train": 25882, "query": 14218, "gallery": 12612},
      {"train": 19280, "test": 13180}, {"train": 2720, "test": 2120},
      {"train": 901, "test": 896}, {"train": 325846, "test": 136093}]
  assert info["inshop"].eval_splits == ("query", "gallery")
  assert info["sop"].ks == (1, 10, 100, 1000)
  assert info["inshop"].ks == (1, 10, 20, 30, 40)
  assert info["inaturalist2018"].ks == (1, 4, 16, 32)
  assert info["omniglot"].channels == 1 and info["cub200"].channels == 3
  assert info["cub200"].eval_preprocess_name == "bninception"
  assert not info["digits"].needs_files


def test_evaluation_defaults_are_the_registry_ks():
  from circle_jax import evaluation  # pylint: disable=g-import-not-at-top
  assert dict(evaluation.DEFAULT_KS) == {n: data.DATASETS[n].ks for n in NAMES}
  for name in NAMES:
    assert evaluation.default_ks(data.get_dataset_info(name).ks_name) is (
        data.get_dataset_info(name).ks)


def test_unknown_names_and_splits(tmp_path):
  with pytest.raises(ValueError, match="cub200, cars196, sop, inshop"):
    data.get_dataset_info("cub")
  with pytest.raises(ValueError, match="Unknown dataset"):
    data.load_split("imagenet", "train", data_dir=tmp_path)
  with pytest.raises(ValueError, match="train, query, gallery"):
    data.load_split("inshop", "test", data_dir=tmp_path)


_PREPARE = """
import os, sys, time
from circle_jax import data
go = sys.argv[2]
open(go + "." + str(os.getpid()), "w").close()  # imported: ready
while not os.path.exists(go):
  time.sleep(0.005)
src = data.load_split(sys.argv[3], "train", data_dir=sys.argv[1])
test = data.load_split(sys.argv[3], "test", data_dir=sys.argv[1])
print(len(src), len(test), data.split_labels(src).sum())
"""


@pytest.mark.slow  # CI, not the fast tier (CONTRIBUTING.md)
def test_jobs_sharing_a_data_dir_prepare_a_dataset_once(tmp_path):
  """Two real processes start preparing the same dataset at the same
  instant: one prepares, the other waits for the lock and reads the result
  (tfds alone made the second fail renaming its incomplete folder onto the
  first's result: FileExistsError)."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  go, name = tmp_path / "go", "digits"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen(
      [sys.executable, "-c", _PREPARE, str(tmp_path / "d"), str(go), name],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for _ in range(2)]
  deadline = time.time() + 240
  while (len(list(tmp_path.glob("go.*"))) < 2 and time.time() < deadline
         and all(p.poll() is None for p in procs)):
    time.sleep(0.05)
  go.touch()  # both imported and polling: they start at the same instant
  outs = [p.communicate(timeout=300) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  assert outs[0][0] == outs[1][0] and outs[0][0].split()[:2] == ["901", "896"]
  left = sorted(os.listdir(tmp_path / "d" / name))
  assert left == ["1.0.0"], left          # no incomplete.* folder remains
  assert (tmp_path / "d" / f"{name}.lock").exists()
