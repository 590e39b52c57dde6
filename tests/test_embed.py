"""Tests of circle_jax/embed.py: embedding a folder of images with a run.

The run is a workdir written without training (``helpers.write_run``), whose
best and latest checkpoints differ, so the tests see which one was used. Its
bad paths (``--out`` a folder, ``--images`` a file) are in tests/test_paths.py.
"""

import os

from absl import flags
import numpy as np
import pytest
from PIL import Image

from circle_jax import config_facts
from circle_jax import data as data_lib
from circle_jax import embed
from circle_jax.train import restore as restore_lib
from circle_jax.train import run as run_lib
from circle_jax.train import state as state_lib
from tests.train import helpers


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """``(workdir, trees)``: latest step 4, best step 2 (parameters + 0.5)."""
  root = tmp_path_factory.mktemp("embed")
  config = helpers.digits_config(**{"dataset.data_dir": str(root / "tfds")})
  workdir = str(root / "run")
  return workdir, helpers.write_run(config, workdir)


def _digit_images(folder, picks):
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  d = load_digits()
  for i in picks:
    Image.fromarray((d.images[i] * 255 / 16).astype(np.uint8)).save(
        folder / f"{i}.png")


def test_list_images_walks_the_folder_sorted(tmp_path):
  (tmp_path / "b" / "c").mkdir(parents=True)
  for name in ("z.PNG", "a.jpeg", "b/c/x.tiff", "b/y.webp", "notes.txt",
               "b/readme", "model.npz"):
    (tmp_path / name).write_bytes(b"")
  assert embed.list_images(str(tmp_path)) == [
      "a.jpeg", "b/c/x.tiff", "b/y.webp", "z.PNG"]
  assert embed.list_images(str(tmp_path / "b" / "c")) == ["x.tiff"]
  with pytest.raises(embed.EmbedError, match="is not a folder"):
    embed.list_images(str(tmp_path / "a.jpeg"))


@pytest.mark.slow  # CI, not the fast tier (CONTRIBUTING.md)
def test_embed_tool_uses_best_checkpoint_and_eval_preprocessing(saved,
                                                                tmp_path):
  workdir, trees = saved
  folder = tmp_path / "images"
  (folder / "sub").mkdir(parents=True)
  picks = [0, 1, 2]
  _digit_images(folder, picks)
  Image.open(folder / "0.png").save(folder / "sub" / "copy.png")
  (folder / "notes.txt").write_text("not an image")
  out = tmp_path / "emb"  # the tool adds .npz, as np.savez would
  flags.FLAGS(["embed", f"--workdir={workdir}", f"--images={folder}",
               f"--out={out}", "--batch_size=2"])
  try:
    embed.main(["embed"])
  finally:
    flags.FLAGS.unparse_flags()
  got = np.load(str(out) + ".npz")
  assert list(got["paths"]) == ["0.png", "1.png", "2.png", "sub/copy.png"]
  assert list(got["skipped"]) == []
  e = got["embeddings"]
  assert e.shape == (4, helpers.digits_config().model.embedding_dim)
  assert e.dtype == np.float32
  np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(e[0], e[3])
  # The model applied by hand to the eval preprocessing, best weights; the
  # latest ones give other embeddings.
  config = embed.load_run_config(workdir)
  info = data_lib.get_dataset_info("digits")
  pre = config_facts.eval_preprocess(config, info)
  model = run_lib.build_model(config)
  x = np.stack([pre((folder / f"{i}.png").read_bytes()) for i in picks])
  for which, close in (("best", True), ("latest", False)):
    want = np.asarray(model.apply(state_lib.model_variables(trees[which]), x,
                                  train=False))
    assert np.allclose(e[:3], want, atol=1e-5) == close, which
  _, latest, _ = embed.embed_folder(workdir, str(folder), which="latest")
  np.testing.assert_allclose(latest[:3], np.asarray(model.apply(
      state_lib.model_variables(trees["latest"]), x, train=False)), atol=1e-5)


def test_embed_tool_refuses_an_empty_folder_and_skips_corrupt_images(
    saved, tmp_path):
  workdir, _ = saved
  empty = tmp_path / "empty"
  (empty / "sub").mkdir(parents=True)
  (empty / "notes.txt").write_text("no images here")
  with pytest.raises(embed.EmbedError, match="no image files under"):
    embed.embed_folder(workdir, str(empty))
  folder = tmp_path / "mixed"
  folder.mkdir()
  Image.fromarray(np.full((8, 8), 200, np.uint8)).save(folder / "a.png")
  (folder / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
  Image.fromarray(np.full((8, 8), 50, np.uint8)).save(folder / "c.png")
  paths, e, skipped = embed.embed_folder(workdir, str(folder), batch_size=4)
  assert paths == ["a.png", "c.png"] and e.shape == (2, 4)
  assert [p for p, _ in skipped] == ["b.png"]
  assert "b.png" in skipped[0][1]
  with pytest.raises(data_lib.ImageDecodeError, match="b.png"):
    embed.embed_folder(workdir, str(folder), strict=True)
  with pytest.raises(restore_lib.RunError, match="no latest checkpoint yet"):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.json").write_text(
        open(os.path.join(workdir, "config.json")).read())
    embed.embed_folder(str(fresh), str(folder))
