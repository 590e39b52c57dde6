"""``python -m circle_jax.search`` end to end on a short digits run."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from circle_jax.search import build
from circle_jax.search import index as index_lib
from circle_jax.train import loop
from tests.evaluation import test_knn
from tests.experiments import test_main

# Slow (trains two digits runs and starts the command line): not in the fast tier (CONTRIBUTING.md); CI runs it.
pytestmark = pytest.mark.slow

REPO = test_main.REPO


def _cli(*args, wait=True):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=REPO)
  cmd = [sys.executable, "-m", "circle_jax.search", *map(str, args)]
  if not wait:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
  return subprocess.run(cmd, env=env, capture_output=True, text=True,
                        timeout=300)


def _train(workdir, data_dir, seed):
  c = test_main.parse("--config.num_train_steps=3",
                      "--config.eval_at_init=false",
                      "--config.eval_clustering=false",
                      f"--config.seed={seed}",
                      f"--config.dataset.data_dir={data_dir}")
  loop.train_and_evaluate(c, str(workdir))
  return str(workdir)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("search")
  data_dir = root / "tfds"
  runs = [_train(root / f"run{s}", data_dir, s) for s in (0, 1)]
  digits = load_digits()
  for name, rows in (("gallery", range(0, 400)), ("queries", range(400, 460)),
                     ("big", range(0, 1797))):
    for i in rows:
      label = int(digits.target[i])
      if label < 5:
        continue
      folder = root / name / str(label)
      folder.mkdir(parents=True, exist_ok=True)
      Image.fromarray((digits.images[i] * 16).clip(0, 255).astype(
          np.uint8)).save(folder / f"{i}.png")
  return root, runs


def _one_line_error(proc, *words):
  assert proc.returncode == 1, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
  for w in words:
    assert w in lines[0], lines[0]


def test_the_training_run_draws_its_retrievals(setup):
  _, runs = setup
  with Image.open(os.path.join(runs[0], "retrievals.png")) as im:
    assert im.size[0] > 300 and im.size[1] > 300


def test_build_query_calibrate_match_info(setup):
  root, runs = setup
  idx = root / "index.npz"
  proc = _cli("build", "--workdir", runs[0], "--images", root / "gallery",
              "--index", idx)
  assert proc.returncode == 0, proc.stderr[-3000:]
  index = index_lib.load(str(idx))
  assert len(index) == len(index.ids) > 100
  assert set(index.labels.tolist()) == {"5", "6", "7", "8", "9"}
  assert index.model.run == runs[0] and index.model.embedding_dim == 4
  assert index.metadata[0]["path"].startswith(str(root / "gallery"))

  proc = _cli("query", "--index", idx, "--images", root / "queries",
              "--k", 3, "--grid", root / "grid.png")
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.strip().splitlines()
  assert lines[0].split() == ["query", "rank", "id", "label", "score"]
  table = [line.split() for line in lines[1:]]
  # The same neighbours as NumPy brute force on the same embeddings.
  run, _ = build.restore(runs[0])
  names, q, _ = build.embed_images(run, str(root / "queries"))
  _, ref = test_knn.brute_force(q, index.embeddings, 3)
  assert len(table) == 3 * len(names)
  for row in table:
    qi, rank = names.index(row[0]), int(row[1]) - 1
    assert row[2] == index.ids[ref[qi, rank]]
    assert row[3] == row[2].split("/")[0]
  assert os.path.getsize(root / "grid.png") > 1000

  proc = _cli("calibrate", "--index", idx, "--images", root / "queries")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "best_f1" in proc.stdout and "OPIS" in proc.stdout
  cuts = index_lib.load(str(idx)).cutpoints
  assert "best_f1" in cuts
  proc = _cli("match", "--index", idx, "--images", root / "queries")
  assert proc.returncode == 0, proc.stderr[-3000:]
  answers = [line.split()[1] for line in proc.stdout.splitlines()[1:]]
  assert set(answers) <= {"5", "6", "7", "8", "9", "unknown"}
  assert len(answers) == len(names)
  proc = _cli("match", "--index", idx, "--images", root / "queries",
              "--threshold", 1.01)
  assert {line.split()[1] for line in proc.stdout.splitlines()[1:]} == {
      "unknown"}
  proc = _cli("info", "--index", idx)
  assert proc.returncode == 0 and "cut-point best_f1" in proc.stdout


def test_bad_files_and_another_models_embeddings_are_one_line(setup):
  root, runs = setup
  idx = root / "index2.npz"
  assert _cli("build", "--workdir", runs[0], "--images", root / "gallery",
              "--index", idx).returncode == 0
  # Another run's embeddings (same size, other weights) are refused.
  other = root / "other.npz"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=REPO)
  subprocess.run([sys.executable, "-m", "circle_jax.embed", "--workdir",
                  runs[1], "--images", str(root / "queries"), "--out",
                  str(other)], env=env, check=True, capture_output=True)
  with np.load(other) as z:
    assert json.loads(str(z["model"]))["run"] == runs[1]
  _one_line_error(_cli("query", "--index", idx, "--embeddings", other),
                  "another model")
  # The index's own run's embeddings are accepted.
  own = root / "own.npz"
  subprocess.run([sys.executable, "-m", "circle_jax.embed", "--workdir",
                  runs[0], "--images", str(root / "queries"), "--out",
                  str(own)], env=env, check=True, capture_output=True)
  assert _cli("query", "--index", idx, "--embeddings", own).returncode == 0
  # A damaged index file.
  bad = root / "damaged.npz"
  bad.write_bytes(idx.read_bytes()[:5000])
  _one_line_error(_cli("query", "--index", bad, "--embeddings", own),
                  str(bad))
  _one_line_error(_cli("info", "--index", root / "nothing.npz"),
                  "nothing.npz")


def test_sigterm_while_building_leaves_the_previous_index(setup):
  root, runs = setup
  idx = root / "index3.npz"
  assert _cli("build", "--workdir", runs[0], "--images", root / "gallery",
              "--index", idx).returncode == 0
  before = idx.read_bytes()
  proc = _cli("build", "--workdir", runs[0], "--images", root / "big",
              "--index", idx, "--verbose", wait=False)
  # SIGTERM once it has restored the run and starts embedding (its INFO
  # log says so): the embedding of ~900 images and the save are ahead.
  for line in proc.stderr:
    if "Embedding" in line:
      break
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  if proc.returncode == 0:
    pytest.skip("the build finished before SIGTERM arrived")
  assert proc.returncode == 143, err[-2000:]
  assert f"{idx} was not changed" in err
  assert idx.read_bytes() == before
  assert sorted(os.listdir(root)) == sorted(
      f for f in os.listdir(root) if not f.endswith(".tmp"))


def test_add_and_remove_items(setup):
  root, runs = setup
  idx = root / "index4.npz"
  assert _cli("build", "--workdir", runs[0], "--images", root / "queries",
              "--index", idx).returncode == 0
  n = len(index_lib.load(str(idx)))
  proc = _cli("add", "--index", idx, "--images", root / "queries",
              "--prefix", "again")
  assert proc.returncode == 0, proc.stderr[-2000:]
  index = index_lib.load(str(idx))
  assert len(index) == 2 * n and index.ids[n].startswith("again/")
  np.testing.assert_allclose(index.embeddings[:n], index.embeddings[n:],
                             atol=1e-6)  # batches padded otherwise
  _one_line_error(_cli("add", "--index", idx, "--images", root / "queries"),
                  "already in the index")
  proc = _cli("remove", "--index", idx, "--ids", index.ids[0], index.ids[-1])
  assert proc.returncode == 0 and len(index_lib.load(str(idx))) == 2 * n - 2
  _one_line_error(_cli("remove", "--index", idx, "--ids", "nope"),
                  "'nope' is not in the index")
