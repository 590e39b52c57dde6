"""Specification of circle_jax.evaluation.omniglot_oneshot.

The official runs are not shipped: each test writes a tiny copy in their
layout (3 runs of 4, 4 and 3 classes; synthetic 1-bit 105 x 105 glyphs) as a
folder or a zip. Some test images are exact copies of *another* class's
training image, so their 1-NN answer is wrong whatever the embedding: the
errors are known by construction, 0%, 25% and 66.7%.
"""

import io
import os
import zipfile

import numpy as np
import pytest
from PIL import Image, ImageDraw

from circle_jax.evaluation import omniglot_oneshot as oneshot

# run -> (number of classes, {test item position: class whose training image
# it copies instead of its own class's}).
RUNS = {"run01": (4, {}), "run02": (4, {2: 0}), "run03": (3, {0: 1, 1: 2})}
ERRORS = (0.0, 25.0, 200.0 / 3)


def _glyph(rng):
  """Three random strokes, black on white, 1-bit like the official PNGs."""
  im = Image.new("L", (105, 105), 255)
  draw = ImageDraw.Draw(im)
  for _ in range(3):
    draw.line([tuple(int(v) for v in rng.integers(10, 95, 2))
               for _ in range(3)], fill=0, width=4)
  return im.convert("1")


def _png(im):
  buf = io.BytesIO()
  im.save(buf, format="PNG")
  return buf.getvalue()


def make_runs(root, *, as_zip, top_folder, run_relative, seed=0):
  """Writes the runs; returns ``{run: [(test file, answer file)]}`` (paths
  relative to the run) and the path to give :func:`read_runs`."""
  rng = np.random.default_rng(seed)
  files, truth = {}, {}
  top = "all_runs/" if top_folder else ""
  for run, (n, wrong) in RUNS.items():
    glyphs = [_glyph(rng) for _ in range(n)]
    order = rng.permutation(n)  # test item i is of class order[i]
    lines, truth[run] = [], []
    for c, g in enumerate(glyphs):
      files[f"{top}{run}/training/class{c + 1:02d}.png"] = _png(g)
    for i, c in enumerate(order):
      if i in wrong:
        data = files[f"{top}{run}/training/class{wrong[i] + 1:02d}.png"]
      else:
        data = _png(_perturbed(glyphs[c], rng))
      test, answer = f"test/item{i + 1:02d}.png", f"training/class{c + 1:02d}.png"
      files[f"{top}{run}/{test}"] = data
      prefix = "" if run_relative else f"{run}/"
      lines.append(f"{prefix}{test} {prefix}{answer}")
      truth[run].append((test, answer))
    files[f"{top}{run}/class_labels.txt"] = ("\n".join(lines) + "\n").encode()
  if as_zip:
    path = os.path.join(root, "all_runs.zip")
    with zipfile.ZipFile(path, "w") as zf:
      for name, data in files.items():
        zf.writestr(name, data)
    return truth, path
  for name, data in files.items():
    os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
    with open(os.path.join(root, name), "wb") as f:
      f.write(data)
  return truth, str(root)


def _perturbed(glyph, rng):
  """The glyph with a few pixels flipped (another drawing of the class)."""
  x = np.array(glyph.convert("L"))
  for _ in range(3):
    i, j = rng.integers(20, 85, 2)
    x[i:i + 2, j:j + 2] = 255 - x[i:i + 2, j:j + 2]
  return Image.fromarray(x).convert("1")


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
