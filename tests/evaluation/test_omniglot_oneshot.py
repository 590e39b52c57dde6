"""Specification of circle_jax.evaluation.omniglot_oneshot.

Most tests write a tiny copy of the runs in their layout
(``tests/evaluation/oneshot_fixture.py``), whose errors are known by
construction; the official runs shipped with the package are read back
against a naive reader of their archive and against the Omniglot
repository's own published baseline (Modified Hausdorff Distance, 38.8 %).
"""

import hashlib
import io
import os
import shutil
import zipfile

import numpy as np
import pytest
from PIL import Image

from circle_jax import config_facts
from circle_jax.evaluation import embedding as embedding_lib
from circle_jax.evaluation import omniglot_oneshot as oneshot
from tests.evaluation.oneshot_fixture import (
    ERRORS,
    RUNS,
    make_runs,
    train_tiny_workdir,
)

# Slow (a restored run, the official runs): not in the fast tier.
pytestmark = pytest.mark.slow


def pixels(images):
  """A stub model: the decoded pixels as the embedding."""
  return np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("L"),
                              np.float32).ravel() for b in images])


@pytest.mark.parametrize("as_zip,top_folder,run_relative", [
    (False, True, False), (True, True, False), (True, False, True),
    (False, False, True)], ids=["folder_official", "zip_official",
                                "zip_bare_run_relative", "folder_bare"])
def test_layouts_and_errors(tmp_path, as_zip, top_folder, run_relative):
  truth, path = make_runs(tmp_path, as_zip=as_zip, top_folder=top_folder,
                          run_relative=run_relative)
  runs = oneshot.read_runs(path)
  assert [r.name for r in runs] == list(RUNS)
  for r in runs:
    n = RUNS[r.name][0]
    assert [os.path.basename(t) for t in r.training] == [
        f"class{c + 1:02d}.png" for c in range(n)]
    # Each test image's answer, read independently of class_labels' parser.
    want = [int(a[len("training/class"):-len(".png")]) - 1
            for _, a in truth[r.name]]
    assert list(r.answers) == want
    assert [t.split("/", 1 if not top_folder else 2)[-1] for t in r.test] == [
        t for t, _ in truth[r.name]]
  result = oneshot.oneshot_errors(pixels, runs)
  assert result.runs == tuple(RUNS)
  np.testing.assert_allclose(result.errors, ERRORS)
  assert result.mean_error == pytest.approx(np.mean(ERRORS))
  for r, pred in zip(runs, result.predictions):
    for i, wrong in RUNS[r.name][1].items():
      assert pred[i] == wrong


def test_errors_match_a_naive_nearest_neighbour(tmp_path):
  """Another embedding (4 x 4 block means): the 1-NN predictions equal a loop
  over the files written, in float64."""
  truth, path = make_runs(tmp_path, as_zip=True, top_folder=True,
                          run_relative=False, seed=1)

  def blocks(images):
    x = pixels(images).reshape(-1, 105, 105)[:, :104, :104]
    return x.reshape(-1, 26, 4, 26, 4).mean(axis=(2, 4)).reshape(len(x), -1)

  result = oneshot.oneshot_errors(blocks, oneshot.read_runs(path))
  with zipfile.ZipFile(path) as zf:
    for run, errors in zip(RUNS, result.errors):
      n = RUNS[run][0]
      train = [blocks([zf.read(f"all_runs/{run}/training/class{c + 1:02d}.png")
                       ])[0] for c in range(n)]
      wrong = 0
      for test, answer in truth[run]:
        q = blocks([zf.read(f"all_runs/{run}/{test}")])[0]
        sims = [q @ t / np.linalg.norm(q) / np.linalg.norm(t) for t in train]
        wrong += f"training/class{int(np.argmax(sims)) + 1:02d}.png" != answer
      assert errors == pytest.approx(100.0 * wrong / len(truth[run]))


def _one_line(match, fn):
  with pytest.raises(oneshot.OneShotRunsError, match=match) as e:
    fn()
  assert "\n" not in str(e.value)


def test_bad_runs(tmp_path):
  _one_line("does not exist", lambda: oneshot.read_runs(
      str(tmp_path / "nothing.zip")))
  (tmp_path / "empty").mkdir()
  _one_line(r"no run\*/class_labels.txt", lambda: oneshot.read_runs(
      str(tmp_path / "empty")))
  _, path = make_runs(tmp_path / "a", as_zip=False, top_folder=True,
                      run_relative=False)
  os.remove(os.path.join(path, "all_runs/run02/test/item03.png"))
  _one_line(r"run02/class_labels.txt .* names 'run02/test/item03.png', which "
            "is not in the runs' files", lambda: oneshot.read_runs(path))
  _, path = make_runs(tmp_path / "b", as_zip=False, top_folder=False,
                      run_relative=True)
  with open(os.path.join(path, "run01/class_labels.txt"), "a") as f:
    f.write("test/item01.png\n")
  _one_line(r"run01/class_labels.txt .*, line 5: expected", lambda:
            oneshot.read_runs(path))


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory):
  return train_tiny_workdir(str(tmp_path_factory.mktemp("oneshot_run")))


def test_workdir_model_errors(trained_workdir, tmp_path):
  """The workdir's model: the errors equal a 1-NN over the model applied
  directly to each preprocessed image; the copied images are wrong."""
  from circle_jax.train import restore as restore_lib  # pylint: disable=g-import-not-at-top
  _, path = make_runs(tmp_path, as_zip=True, top_folder=True,
                      run_relative=False)
  run = restore_lib.restore_run(trained_workdir, "latest")
  result, info = oneshot.evaluate_run(run, oneshot.read_runs(path))
  assert (info["which"], info["step"], info["dataset"]) == ("latest", 2,
                                                            "digits")
  preprocess = config_facts.eval_preprocess(run.config, run.info)

  def direct(images):
    x = np.stack([preprocess(b, None, "image") for b in images])
    return np.array(run.model.apply(run.variables, x, train=False))

  for r, errors, pred in zip(oneshot.read_runs(path), result.errors,
                             result.predictions):
    train, test = direct(r.training_images), direct(r.test_images)
    train /= np.linalg.norm(train, axis=1, keepdims=True)
    test /= np.linalg.norm(test, axis=1, keepdims=True)
    want = [int(np.argmax([q @ t for t in train])) for q in test]
    assert list(pred) == want
    assert errors == pytest.approx(
        100.0 * np.mean(np.asarray(want) != np.asarray(r.answers)))
    for i, wrong in RUNS[r.name][1].items():
      assert pred[i] == wrong
  assert result.mean_error == pytest.approx(np.mean(result.errors))
  # With config.oneshot.align: each image's plain embedding, then its
  # views, each the model applied to the shifted and rotated image.
  run.config.oneshot.update(align=True, align_shift=1, align_angles=(5.0,))
  images = list(oneshot.read_runs(path)[0].test_images[:3])
  got = oneshot.run_embedder(run)(images)
  assert got.shape == (3, 1, 10, direct(images).shape[1])
  plain = direct(images)
  np.testing.assert_allclose(
      got[:, 0, 0], plain / np.linalg.norm(plain, axis=1, keepdims=True),
      rtol=1e-5, atol=1e-6)
  x = np.stack([preprocess(b, None, "image") for b in images])
  turned = embedding_lib.affine_views(x, shift=1, angles=(5.0,))[8]  # (1, 1)
  out = np.array(run.model.apply(run.variables, turned, train=False))
  np.testing.assert_allclose(
      got[:, 0, 9], out / np.linalg.norm(out, axis=1, keepdims=True),
      rtol=1e-4, atol=1e-5)


def _archive(root, sizes, drawers=4):
  """An images archive in Omniglot's layout: ``sizes`` = {alphabet: number
  of characters}; each image's pixels name its (alphabet, character, drawer)
  in a small header, so the draw can be read back from the bytes."""
  path = os.path.join(root, "images_x.zip")
  with zipfile.ZipFile(path, "w") as zf:
    for a, (alphabet, n) in enumerate(sorted(sizes.items())):
      for c in range(n):
        for d in range(1, drawers + 1):
          im = np.full((105, 105), 255, np.uint8)
          im[0, :3] = (a, c, d)
          buf = io.BytesIO()
          Image.fromarray(im).save(buf, format="PNG")
          zf.writestr(f"images_x/{alphabet}/character{c + 1:02d}/"
                      f"{a}{c:02d}_{d:02d}.png", buf.getvalue())
  return path


def _header(data):
  return tuple(int(v) for v in np.asarray(Image.open(io.BytesIO(data)))[0, :3])


def test_within_alphabet_runs_follow_the_official_protocol(tmp_path):
  """Each run: one alphabet with enough characters (taken in turn), `way`
  distinct characters, one drawer for the training images and another for
  the test images; the answers pair each test image with its character."""
  path = _archive(tmp_path, {"Aa": 5, "Bb": 3, "Cc": 2, "Dd": 4})
  runs = oneshot.within_alphabet_runs(path, way=3, num_runs=6, seed=3,
                                      exclude_alphabets=["Dd"])
  assert [r.name for r in runs] == [f"run{i:02d}" for i in range(1, 7)]
  for r, want_alphabet in zip(runs, [0, 1] * 3):  # Aa, Bb; Cc too small
    train = [_header(b) for b in r.training_images]
    test = [_header(b) for b in r.test_images]
    assert {t[0] for t in train + test} == {want_alphabet}
    assert len({t[1] for t in train}) == 3 and len({t[2] for t in train}) == 1
    assert len({t[2] for t in test}) == 1 and test[0][2] != train[0][2]
    assert [train[a][1] for a in r.answers] == [t[1] for t in test]
  again = oneshot.within_alphabet_runs(path, way=3, num_runs=6, seed=3,
                                       exclude_alphabets=["Dd"])
  assert [r.test for r in again] == [r.test for r in runs]
  other = oneshot.within_alphabet_runs(path, way=3, num_runs=6, seed=4,
                                       exclude_alphabets=["Dd"])
  assert [r.test for r in other] != [r.test for r in runs]
  _one_line("no alphabet of .* has 6 characters", lambda:
            oneshot.within_alphabet_runs(path, way=6))


def test_stand_in_runs_use_only_the_held_out_alphabets():
  runs = oneshot.stand_in_runs(seed=0)
  assert len(runs) == 20
  alphabets = {p.split("/")[1] for r in runs for p in r.training + r.test}
  assert alphabets == {"Japanese_(katakana)", "Sanskrit"}
  for r in runs:
    assert len(r.training) == len(set(r.training)) == 20
    drawers = {p.rsplit("_", 1)[1] for p in r.training}, {
        p.rsplit("_", 1)[1] for p in r.test}
    assert len(drawers[0]) == len(drawers[1]) == 1 and drawers[0] != drawers[1]


def test_ensemble_cosine_is_the_members_mean_cosine():
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(5, 3)), rng.normal(size=(5, 7)) * 10
  embed = oneshot.ensemble_embedder([lambda _: a, lambda _: b])
  e = embed([b""] * 5)

  def cos(x):
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    return x @ x.T
  np.testing.assert_allclose(e @ e.T, (cos(a) + cos(b)) / 2, atol=1e-12)
  with pytest.raises(ValueError, match="at least one model"):
    oneshot.ensemble_embedder([])


def _naive_aligned(test, train):
  """Loops, float64: per model, each image's embedding against the other's
  best view, both ways, averaged; then the mean over the models."""
  def unit(v):
    return np.asarray(v, np.float64) / np.linalg.norm(v)
  out = np.zeros((len(test), len(train)))
  for i, q in enumerate(test):
    for j, s in enumerate(train):
      per_model = []
      for m in range(q.shape[0]):
        one = max(unit(q[m, 0]) @ unit(v) for v in s[m, 1:])
        two = max(unit(s[m, 0]) @ unit(v) for v in q[m, 1:])
        per_model.append((one + two) / 2)
      out[i, j] = np.mean(per_model)
  return out


def test_aligned_similarity_matches_loops_and_is_symmetric():
  rng = np.random.default_rng(5)
  test, train = rng.normal(size=(4, 2, 6, 3)), rng.normal(size=(5, 2, 6, 3))
  got = oneshot.aligned_similarity(test, train)
  np.testing.assert_allclose(got, _naive_aligned(test, train), atol=1e-12)
  np.testing.assert_allclose(oneshot.aligned_similarity(train, test), got.T,
                             atol=1e-12)
  # One view equal to the embedding itself: the plain cosine.
  e = rng.normal(size=(4, 3))
  one = np.stack([e, e], axis=1)[:, None]
  unit = e / np.linalg.norm(e, axis=1, keepdims=True)
  np.testing.assert_allclose(oneshot.aligned_similarity(one, one),
                             unit @ unit.T, atol=1e-12)
  with pytest.raises(ValueError, match=r"\[t, M, 1 \+ V, D\]"):
    oneshot.aligned_similarity(test[:, :, :1], train[:, :, :1])
  with pytest.raises(ValueError, match=r"\[t, M, 1 \+ V, D\]"):
    oneshot.aligned_similarity(test, train[:, :1])


def test_aligned_errors_and_ensembles(tmp_path):
  """4-D embeddings are classified by alignment (equal to the loops); an
  ensemble of aligned members stacks them on the model axis; members of
  both kinds are refused."""
  _, path = make_runs(tmp_path, as_zip=True, top_folder=True,
                      run_relative=False, seed=2)
  runs = oneshot.read_runs(path)
  tables = {}

  def views(seed):
    def embed(images):
      for im in images:
        if im not in tables:
          tables[im] = np.random.default_rng(len(tables) + seed).normal(
              size=(1, 4, 5))
      return np.stack([tables[im] for im in images])
    return embed
  one, two = views(0), views(100)
  for embed in (one, oneshot.ensemble_embedder([one, two])):
    result = oneshot.oneshot_errors(embed, runs)
    for r, pred, error in zip(runs, result.predictions, result.errors):
      sims = _naive_aligned(embed(r.test_images), embed(r.training_images))
      assert list(pred) == list(np.argmax(sims, axis=1))
      assert error == pytest.approx(
          100 * np.mean(np.argmax(sims, axis=1) != np.asarray(r.answers)))
  assert oneshot.ensemble_embedder([one, two])([runs[0].test[0]]).shape == (
      1, 2, 4, 5)
  with pytest.raises(ValueError, match="all return"):
    oneshot.ensemble_embedder([one, pixels])(list(runs[0].test_images))
  with pytest.raises(ValueError, match=r"M, 1 \+ V, D\] embeddings; got "
                     r"shape \(19, 2, 3\)"):
    oneshot.oneshot_errors(lambda ims: np.zeros((len(ims), 2, 3)), runs)


# ---------------------------------------------------- the official runs --


def test_official_runs_are_the_archives_runs():
  """20 runs of 20 classes; each test image's answer is the training image
  that a naive reading of its run's class_labels.txt names."""
  runs = oneshot.official_runs()
  assert [r.name for r in runs] == [f"run{i:02d}" for i in range(1, 21)]
  with zipfile.ZipFile(oneshot.OFFICIAL_RUNS) as zf:
    for r in runs:
      assert len(r.training) == len(r.test) == 20
      assert sorted(r.answers) == list(range(20))
      labels = zf.read(f"{r.name}/class_labels.txt").decode()
      want = {}
      for line in labels.split("\n"):
        if line.strip():
          test, train = line.split()
          want[test] = train
      assert {t: r.training[a] for t, a in zip(r.test, r.answers)} == want
      for name, data in zip(r.training + r.test,
                            r.training_images + r.test_images):
        assert data == zf.read(name)


def _inked_points(data):
  """The repository demo's LoadImgAsPoints: black pixels, centred."""
  pixels = np.asarray(Image.open(io.BytesIO(data)).convert("L"))
  rows, cols = np.nonzero(pixels == 0)
  points = np.stack([rows, cols], axis=1).astype(np.float64)
  return points - points.mean(axis=0)


def _modified_hausdorff(a, b):
  """Dubuisson and Jain (ICPR 1994), the demo's cost; ``a``, ``b``:
  ``(points, their k-d tree)``."""
  return max(b[1].query(a[0])[0].mean(), a[1].query(b[0])[0].mean())


def test_official_runs_reproduce_the_repositorys_baseline():
  """The Omniglot repository's demo_classification.py states that Modified
  Hausdorff Distance 1-NN gives 38.8 % error on these runs; through our
  reader (answers, image order) it gives the same."""
  from scipy.spatial import cKDTree  # pylint: disable=g-import-not-at-top
  errors = []
  for r in oneshot.official_runs():
    train, test = ([(p, cKDTree(p)) for p in map(_inked_points, images)]
                   for images in (r.training_images, r.test_images))
    pred = [int(np.argmin([_modified_hausdorff(q, t) for t in train]))
            for q in test]
    errors.append(100.0 * np.mean(np.asarray(pred) != np.asarray(r.answers)))
  assert round(float(np.mean(errors)), 1) == 38.8


def test_official_runs_refuse_a_missing_or_modified_copy(tmp_path):
  with pytest.raises(oneshot.OneShotRunsError,
                     match="are missing; reinstall circle_jax"):
    oneshot.official_runs(str(tmp_path / "all_runs.zip"))
  copy = tmp_path / "copy.zip"
  shutil.copy(oneshot.OFFICIAL_RUNS, copy)
  assert len(oneshot.official_runs(str(copy))) == 20
  data = bytearray(copy.read_bytes())
  data[len(data) // 2] ^= 0xFF  # one flipped byte inside an image
  copy.write_bytes(bytes(data))
  got = hashlib.md5(bytes(data)).hexdigest()
  with pytest.raises(oneshot.OneShotRunsError,
                     match=f"has md5 {got}, not the official"):
    oneshot.official_runs(str(copy))
