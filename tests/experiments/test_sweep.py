"""Specification of experiments/sweep.py: the vmapped grid on digits, results."""

import json
import os

import jax
import numpy as np
import pytest
from PIL import Image

from circle_jax import losses
from circle_jax.train import grid as grid_lib
from experiments import sweep
from experiments.configs import digits

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """digits ArrayRecords, prepared once for this module (no files needed)."""
  return str(tmp_path_factory.mktemp("tfds"))


def tiny_config(data_dir):
  """A digits run small enough to compile in a few seconds on 2 cores.

  SGD, not Adam: Adam turns the rounding noise of a zero gradient (a conv
  bias before BatchNorm) into steps of the learning rate's size, so two
  float32 runs would differ there by ~lr (see the results' note).
  """
  c = digits.get_config()
  c.dataset.data_dir = data_dir
  c.dataset.num_threads = 2
  c.model.kwargs.width = 8
  c.model.kwargs.num_blocks = 2
  c.batch.classes_per_batch = 5
  c.batch.images_per_class = 4
  c.batch.eval_batch_size = 512
  c.optim.name = "sgd"
  c.optim.momentum = 0.9
  c.optim.learning_rate = 0.05
  c.num_train_steps = 3
  return c


# ----------------------------------------------------------------------------
# The vmapped grid on digits (the package's parts: tests/train/test_grid.py).
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_setup(data_dir):
  grid = grid_lib.parse_grid(["gamma=16,64", "margin=0.25"])
  s = sweep.setup(tiny_config(data_dir), grid)
  return s, jax.device_put(sweep.read_batches(s, 3))


@pytest.fixture(scope="module")
def sequential_run(tiny_setup):
  s, batches = tiny_setup
  return grid_lib.train_sequential(s, batches)


@pytest.mark.parametrize("conv", grid_lib.CONVS)
def test_vmapped_grid_equals_one_model_at_a_time(tiny_setup, sequential_run,
                                                 conv):
  s, batches = tiny_setup
  states, history, timings = grid_lib.train_vmapped(s, batches, conv=conv)
  seq_states, seq_history, seq_timings = sequential_run
  assert set(timings) == {"compile_s", "train_s"}
  assert len(seq_timings["per_model"]) == 2
  assert history["loss"].shape == (3, 2) and history["finite"].all()
  np.testing.assert_array_equal(states.step, [3, 3])
  np.testing.assert_allclose(history["loss"], seq_history["loss"], rtol=1e-5)
  diffs = grid_lib.leaf_differences(states.params, seq_states.params)
  assert max(diffs.values()) < 2e-5, diffs
  stats = grid_lib.leaf_differences(states.batch_stats, seq_states.batch_stats)
  assert max(stats.values()) < 2e-5, stats
  # The grid points really differ: another loss from the first step on, and
  # other parameters.
  assert abs(history["loss"][0, 0] - history["loss"][0, 1]) > 1.0
  kernel = states.params["model"]["head"]["embedding"]["kernel"]
  assert np.max(np.abs(kernel[0] - kernel[1])) > 1e-4


def test_first_step_loss_is_the_plain_loss_call(tiny_setup):
  """Model i's step-0 loss is the plain loss call with grid point i.

  That is, the registered loss called with the point's Python constants on
  the initial model's training-mode embeddings.
  """
  s, batches = tiny_setup
  step = grid_lib.make_sweep_step(s.entry, s.fixed_hyper, base_key=s.base_key,
                               donate=False)
  _, metrics = step(grid_lib.stacked_state(s.state, s.grid.size),
                    jax.device_put(s.grid.arrays()), batches[0])
  variables = {"params": s.state.params["model"],
               "batch_stats": s.state.batch_stats}
  emb, _ = s.model.apply(variables, batches[0]["image"], train=True,
                         mutable=["batch_stats"])
  # (the regularizers' fields are the step's, unset here: no regularizer)
  fixed = {k: v for k, v in s.fixed_hyper.items()
           if k not in losses.regularizers.FIELDS}
  assert not any(v for k, v in s.fixed_hyper.items()
                 if k.endswith("_regularizer"))
  for i, point in enumerate(s.grid.points()):
    want = s.entry.apply(emb, batches[0]["label"], None, **fixed, **point)
    np.testing.assert_allclose(metrics["loss"][i], want, rtol=1e-5)


def test_run_sweep_end_to_end_writes_results(data_dir, tmp_path):
  grid = grid_lib.parse_grid(["gamma=16,64"])
  result = sweep.run_sweep(tiny_config(data_dir), grid, num_steps=2,
                           compare_sequential=True, conv="unrolled",
                           command="pytest", log=lambda *_: None)
  assert result["num_models"] == 2 and result["steps"] == 2
  assert result["test_images"] == 896
  for m in result["models"]:
    assert m["finite"] and len(m["loss_history"]) == 2
    assert 0.0 <= m["metrics"]["map@r"] <= m["metrics"]["recall@1"] <= 1.0
  check = result["sequential_check"]
  assert check["max_param_diff"] < 2e-5
  assert check["max_embedding_diff"] < 1e-3
  assert check["first_step_apart"] is None
  assert check["max_map_diff"] < 1e-3
  sweep.write_results(str(tmp_path), result)
  md = (tmp_path / "results.md").read_text()
  assert "| gamma | 16 | 64 |" in md and "Speed-up" in md
  json.loads((tmp_path / "results.json").read_text())


# ----------------------------------------------------------------------------
# Output.
# ----------------------------------------------------------------------------


def fake_result(grid, *, with_sequential=True):
  rng = np.random.default_rng(0)
  models = []
  for point in grid.points():
    r1 = float(rng.uniform(0.3, 0.7))
    models.append({"hyper": point, "finite": True, "final_loss": 1.0,
                   "loss_history": [2.0, 1.0],
                   "metrics": {"recall@1": r1, "recall@2": r1 + 0.1,
                               "precision@1": r1, "r_precision": 0.2,
                               "map@r": r1 / 3}})
  models[-1]["finite"] = False
  models[-1]["metrics"] = {k: float("nan") for k in models[0]["metrics"]}
  seq = {"compile_s": 20.0, "train_s": 40.0, "per_model": []}
  return {
      "command": "python -m experiments.sweep ...", "dataset": "digits",
      "loss": "circle", "model": "conv4 (4-d)", "optimizer": "adam",
      "seed": 0, "batch_size": 40, "steps": 2, "test_images": 896,
      "conv": "unrolled",
      "grid": {"names": list(grid.names),
               "values": [list(v) for v in grid.values]},
      "num_models": grid.size, "fixed_hyper": {}, "init_metrics":
      {"recall@1": 0.4, "map@r": 0.1}, "models": models,
      "timings": {"read_batches_s": 0.1, "eval_s": 1.0,
                  "vmapped": {"compile_s": 5.0, "train_s": 20.0},
                  **({"sequential": seq} if with_sequential else {})},
      "sequential_check": None, "machine": "Machine: test.",
  }


@pytest.mark.parametrize("specs", [["gamma=16,32,64", "margin=0.1,0.4"],
                                   ["gamma=16,32"]])
def test_write_results_heatmaps_and_markdown(tmp_path, specs):
  grid = grid_lib.parse_grid(specs)
  result = fake_result(grid)
  sweep.write_results(str(tmp_path), result)
  for name in ("map_at_r.png", "recall_at_1.png"):
    with Image.open(tmp_path / name) as im:
      assert im.format == "PNG" and im.size[0] > 100
  md = (tmp_path / "results.md").read_text()
  r1 = result["models"][0]["metrics"]["recall@1"]
  assert f"{r1:.4f}" in md and "non-finite" in md and "nan" in md
  assert "Speed-up of the vmapped grid: 2.00x on the training steps, " \
         "2.40x with compilation." in md
  if len(specs) == 2:
    assert "| gamma \\ margin | 0.1 | 0.4 |" in md
  assert os.path.exists(tmp_path / "results.json")


def test_markdown_without_sequential_run_says_so():
  md = sweep.results_markdown(fake_result(grid_lib.parse_grid(["gamma=1,2"]),
                                          with_sequential=False))
  assert "not run" in md and "Speed-up" not in md
