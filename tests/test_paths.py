"""Every path a user gives fails in one line when it is the wrong kind.

``--workdir`` (an existing file, or a path under one), ``--out`` (a folder,
or under a file), ``--images`` (a file), ``--runs`` (a file that is no
archive), ``dataset.manual_dir`` (a file); ``model.pretrained`` is in
tests/models/test_weights_errors.py.
"""

import os
import subprocess
import sys

import pytest

from circle_jax import data as data_lib
from circle_jax import paths
from circle_jax.evaluation import omniglot_oneshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def a_file(tmp_path):
  path = tmp_path / "a_file"
  path.write_text("not a folder")
  return str(path)


def test_make_folder_names_the_option_and_the_file_in_the_way(a_file,
                                                              tmp_path):
  with pytest.raises(paths.PathError) as e:
    paths.make_folder(a_file, "--workdir")
  assert str(e.value) == (
      f"--workdir: {a_file!r} is a file; it must be a folder (give a new or "
      "existing folder).")
  with pytest.raises(paths.PathError) as e:
    paths.make_folder(os.path.join(a_file, "run", "x"), "--workdir")
  assert f"cannot be a folder: {a_file!r} is a file" in str(e.value)
  new = str(tmp_path / "new" / "run")
  assert paths.make_folder(new, "--workdir") == new and os.path.isdir(new)
  assert paths.make_folder(new, "--workdir") == new   # exists: fine


def test_output_file_refuses_a_folder_and_a_path_under_a_file(a_file,
                                                              tmp_path):
  with pytest.raises(paths.PathError, match="is a folder; give a file name"):
    paths.output_file(str(tmp_path), "--out")
  with pytest.raises(paths.PathError,
                     match=f"cannot be written: {a_file!r} is a file"):
    paths.output_file(os.path.join(a_file, "e.npz"), "--out")
  out = str(tmp_path / "sub" / "e.npz")
  assert paths.output_file(out, "--out") == out
  assert os.path.isdir(tmp_path / "sub")


def _tool(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr[-2000:]
  return lines[0]


@pytest.mark.slow  # the tools in subprocesses
def test_a_workdir_that_is_a_file_is_one_line(a_file):
  line = _tool("experiments.main", "--config=experiments/configs/digits.py",
               f"--workdir={a_file}")
  assert line == (f"error: --workdir: {a_file!r} is a file; it must be a "
                  "folder (give a new or existing folder).")


@pytest.mark.slow  # the tools in subprocesses
def test_embed_paths_are_one_line_each(a_file, tmp_path):
  images = tmp_path / "images"
  images.mkdir()
  common = ["circle_jax.embed", f"--workdir={tmp_path}"]
  line = _tool(*common, f"--images={images}", f"--out={images}")
  assert line == f"error: --out: {str(images)!r} is a folder; give a file name."
  line = _tool(*common, f"--images={images}",
               f"--out={os.path.join(a_file, 'e.npz')}")
  assert line.startswith("error: --out: ") and "is a file" in line
  line = _tool(*common, f"--images={a_file}", f"--out={tmp_path / 'e.npz'}")
  assert line == (f"error: --images: {a_file!r} is not a folder; pass the "
                  "folder that holds the images.")


def test_runs_that_is_no_archive_is_one_line(a_file):
  with pytest.raises(omniglot_oneshot.OneShotRunsError) as e:
    omniglot_oneshot.read_runs(a_file)
  assert str(e.value) == (
      f"--runs: {a_file!r} is neither a folder nor a zip archive; give "
      "all_runs.zip of the Omniglot repository or its extracted folder.")


def test_a_manual_dir_that_is_a_file_is_one_line(a_file, tmp_path):
  with pytest.raises(data_lib.MissingDatasetFilesError) as e:
    data_lib.load_split("cub200", "train", data_dir=str(tmp_path / "tfds"),
                        manual_dir=a_file)
  assert str(e.value) == (
      f"Dataset 'cub200': manual_dir '{a_file}' is a file; give the folder "
      "that holds the official files (--config.dataset.manual_dir).")
