"""A tiny copy of the official Omniglot one-shot runs, and a trained workdir.

3 runs of 4, 4 and 3 classes of synthetic 1-bit 105 x 105 glyphs, in the
layout of the Omniglot repository's ``all_runs.zip`` (as a folder or a zip,
with or without the top-level ``all_runs/``). Some test images are exact
copies of *another* class's training image, so their 1-NN answer is wrong
whatever the embedding: the errors are known by construction, 0%, 25% and
66.7%; the other test images are their class's glyph with a few pixels
flipped.
"""

import io
import os
import zipfile

import numpy as np
from PIL import Image, ImageDraw

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


def train_tiny_workdir(root) -> str:
  """A digits run of 2 steps in ``root/run`` (its eval preprocessing reads
  any PNG); returns the workdir."""
  from circle_jax.train import loop  # pylint: disable=g-import-not-at-top
  from tests.train import helpers  # pylint: disable=g-import-not-at-top
  c = helpers.digits_config(**{
      "dataset.data_dir": os.path.join(root, "tfds"),
      "dataset.num_threads": 2, "num_train_steps": 2, "eval_at_init": False,
      "eval_clustering": False, "eval_every_steps": 0,
      "checkpoint_every_steps": 0})
  loop.train_and_evaluate(c, os.path.join(root, "run"))
  return os.path.join(root, "run")
