"""Hyperparameter sensitivity as one compiled program: a vmapped grid of models.

Trains one model per point of a grid of loss hyperparameters (e.g. Circle's
``gamma x margin``; Sun et al., "Circle Loss: A Unified Perspective of Pair
Similarity Optimization", CVPR 2020, section 4.5) as a *single* program,
``jax.jit(jax.vmap(train_step))`` over stacked ``TrainState`` s with the
swept hyperparameters as traced arrays (:mod:`circle_jax.train.grid`), all
models from the config's initialisation, on the same batches. The test split is
embedded once per batch for all models with a vmapped embedding function,
then Recall@K / MAP@R are computed per model with
``circle_jax.evaluation.retrieval_metrics``.

``--compare_sequential`` also trains the same grid one model at a time with
the unvmapped step (one compilation per point, the hyperparameters as Python
constants), on the same batches, and reports the wall times (compilation and
training separately) and how far the two sets of models are apart (float32
rounding). ``--conv``: how the vmapped program runs the model's convolutions
(``unrolled``, the CPU default, or ``native`` grouped convolutions; see
:func:`circle_jax.train.grid.unrolled_conv`).

Like the benchmarks, the script re-executes itself with huge-page malloc
(``circle_jax/hostenv.py``; ``CIRCLE_JAX_NO_HUGEPAGES=1`` keeps the default):
on the 2-core machine it made both ways' training steps ~30% faster (4 models,
50 steps of omniglot_small).

The batches of all steps are read once from the config's pipeline
(``circle_jax.data.train_iterator``, a function of ``(seed, step)``) and kept on
the device, so the timings of both ways measure compilation and training only;
the time to read the data is reported once.

Usage::

  python -m experiments.sweep --config experiments/configs/omniglot_small.py \\
      --grid gamma=16,32,64,128 --grid margin=0.1,0.2,0.3,0.4 --steps 300 \\
      --compare_sequential --out experiments/results/sweep_circle_omniglot_small

Any config field can be overridden as in ``experiments.main``
(``--config.loss.name=ranked_proxy_anchor --config.optim.learning_rate=3e-4``).
Writes ``OUT/results.md`` (tables and timings), ``OUT/results.json``,
``OUT/map_at_r.png`` and ``OUT/recall_at_1.png`` (heatmaps over the grid).
The results are the test-split metrics of the last step: no model selection.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence


import jax
import numpy as np

from circle_jax import config_flag
from circle_jax import config_facts
from circle_jax import data as data_lib
from circle_jax import hostenv
from circle_jax.train import grid as grid_lib
# The command line's names.
from circle_jax.train.grid import CONVS, Grid, parse_grid  # noqa: F401
from circle_jax.train import config_checks
from circle_jax.evaluation import embedding as embedding_lib
from circle_jax.train import run as run_lib
from circle_jax.train import state as state_lib

# Metrics of the heatmaps: (key of retrieval_metrics, file name, title).
HEATMAPS = (("map@r", "map_at_r.png", "MAP@R"),
            ("recall@1", "recall_at_1.png", "R@1"))


# ----------------------------------------------------------------------------
# The experiment.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Setup(grid_lib.GridProblem):
  """Everything built from a config before training.

  Besides :class:`circle_jax.train.grid.GridProblem`'s fields (the grid, the
  loss, the fixed hyperparameters, the initial state from
  ``run.init_state`` and the loss key):

  Attributes:
    config: the run's config.
    info: the dataset's ``DatasetSpec``.
    model: the Flax model.
    train_source: the train split.
    test_source: the test split.
  """

  config: Any = None
  info: Any = None
  model: Any = None
  train_source: Any = None
  test_source: Any = None


def setup(config, grid: Grid) -> Setup:
  """Builds the data sources, the model and the initial state of a sweep.

  Raises:
    ValueError: a config the sweep does not support (validation split,
      multi-split evaluation) or a bad grid
      (:func:`circle_jax.train.grid.check_grid`).
  """
  config_checks.check_config(config, device_count=1, process_count=1)
  if config.dataset.validation_fraction:
    raise ValueError("The sweep reports the test metrics of the last step and "
                     "trains on all train classes; set "
                     "--config.dataset.validation_fraction=0.")
  info = data_lib.get_dataset_info(config.dataset.name)
  if len(info.eval_splits) != 1:
    raise ValueError(f"The sweep evaluates one test split; {info.name} has "
                     f"{info.eval_splits}.")
  train_source = run_lib.load_split(config, info, info.train_split)
  test_source = run_lib.load_split(config, info, info.eval_splits[0])
  model = run_lib.build_model(config, grid_lib.PLACEMENT)
  train_pre = config_facts.train_preprocess(config, info)
  state, entry, hyper, base_key = run_lib.init_state(config, model, info,
                                                     train_pre.output_shape)
  grid_lib.check_grid(entry, grid, hyper,
                      embedding_dim=config.model.embedding_dim,
                      num_classes=config_facts.num_classes(config, info))
  fixed = {k: v for k, v in hyper.items() if k not in grid.names}
  return Setup(grid, entry, fixed, state, base_key, config=config, info=info,
               model=model, train_source=train_source,
               test_source=test_source)


def read_batches(s: Setup, num_steps: int) -> List[dict]:
  """The batches of steps ``0 .. num_steps - 1`` (numpy), from one pipeline."""
  config = s.config
  it = data_lib.train_iterator(
      s.train_source, sampler=run_lib.make_sampler(config, s.train_source),
      preprocess=config_facts.train_preprocess(config, s.info),
      num_workers=config.dataset.num_workers,
      num_threads=config.dataset.num_threads)
  try:
    return [{"image": b["image"], "label": b["label"]}
            for b in (next(it) for _ in range(num_steps))]
  finally:
    it.close()


def embed_test_split(s: Setup, states: state_lib.TrainState, *,
                     conv: str = "native"):
  """``(embeddings [N, M, D], labels [N])`` of the test split for all models."""
  return embedding_lib.embed_split(
      state_lib.model_variables(states),
      grid_lib.make_sweep_embed(s.model.apply, conv=conv), s.test_source,
      config_facts.eval_preprocess(s.config, s.info),
      placement=grid_lib.PLACEMENT,
      batch_size=s.config.batch.eval_batch_size,
      num_threads=s.config.dataset.num_threads)


def evaluate(s: Setup, states: state_lib.TrainState, *,
             conv: str = "native"):
  """Test-split retrieval metrics of every model.

  Returns:
    ``(metrics per model, embeddings [N, M, D], wall seconds)``.
  """
  t0 = time.perf_counter()
  emb, labels = embed_test_split(s, states, conv=conv)
  ks = tuple(s.config.eval_ks or s.info.ks)
  metrics = grid_lib.retrieval_per_model(emb, labels, ks)
  return metrics, emb, time.perf_counter() - t0


# ----------------------------------------------------------------------------
# Output: heatmaps and the results file.
# ----------------------------------------------------------------------------


def _grid_table(grid: Grid, values: Sequence[float]) -> List[str]:
  mat = grid.matrix(values)
  if len(grid.names) == 2:
    head = f"| {grid.names[0]} \\ {grid.names[1]} | " + " | ".join(
        f"{c:g}" for c in grid.values[1]) + " |"
    rows = [f"| {r:g} | " + " | ".join(f"{v:.4f}" for v in mat[i]) + " |"
            for i, r in enumerate(grid.values[0])]
  else:
    head = f"| {grid.names[0]} | " + " | ".join(
        f"{c:g}" for c in grid.values[0]) + " |"
    rows = ["| | " + " | ".join(f"{v:.4f}" for v in mat[0]) + " |"]
  return [head, "|" + " --- |" * (mat.shape[1] + 1)] + rows


def _seconds(x: float) -> str:
  return f"{x:.1f} s"


def results_markdown(result: Mapping[str, Any]) -> str:
  """The results file in Markdown.

  Setup, metric tables over the grid, per-model rows, timings and the
  vmapped-vs-sequential check (when present).
  """
  grid = Grid(tuple(result["grid"]["names"]),
              tuple(tuple(v) for v in result["grid"]["values"]))
  models = result["models"]
  lines = [f"# Sweep: {result['loss']} on {result['dataset']} "
           f"({' x '.join(grid.names)})", ""]
  lines += [f"Command: `{result['command']}`", ""]
  lines += [f"{result['num_models']} models trained as one vmapped program, "
            f"{result['steps']} steps each on the same batches (global batch "
            f"{result['batch_size']}), from the same initialisation (seed "
            f"{result['seed']}); fixed loss hyperparameters "
            f"{result['fixed_hyper']}; model {result['model']}; optimiser "
            f"{result['optimizer']}; vmapped convolutions "
            f"`{result.get('conv', 'native')}`. Metrics: the test split "
            f"({result['test_images']} images) at the last step, no model "
            "selection.", ""]
  if result.get("init_metrics"):
    init = result["init_metrics"]
    lines += [f"At initialisation (all models): R@1 {init['recall@1']:.4f}, "
              f"MAP@R {init['map@r']:.4f}.", ""]
  for key, fname, title in HEATMAPS:
    lines += [f"## {title}", "", f"![{title}]({fname})", ""]
    lines += _grid_table(grid, [m["metrics"][key] for m in models]) + [""]
  ks = [k for k in models[0]["metrics"] if k.startswith("recall@")]
  cols = list(grid.names) + ["final loss"] + ks + ["map@r", "r_precision"]
  lines += ["## Every model", "",
            "final loss: mean of the last 10 steps' training loss.", "",
            "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
  for m in models:
    vals = [f"{m['hyper'][n]:g}" for n in grid.names]
    vals.append(f"{m['final_loss']:.4f}" if m["finite"] else "non-finite")
    vals += [f"{m['metrics'][k]:.4f}" for k in ks + ["map@r", "r_precision"]]
    lines.append("| " + " | ".join(vals) + " |")
  lines.append("")
  t = result["timings"]
  lines += ["## Timings", "", result["machine"], "",
            "| what | vmapped (all models) | one model at a time (sum) |",
            "| --- | --- | --- |"]
  seq = t.get("sequential")
  vm = t["vmapped"]

  def row(name, key):
    other = _seconds(seq[key]) if seq else "not run"
    return f"| {name} | {_seconds(vm[key])} | {other} |"

  lines += [row("compilation", "compile_s"), row("training steps", "train_s")]
  if seq:
    lines.append(
        f"| compilation + steps | {_seconds(vm['compile_s'] + vm['train_s'])} "
        f"| {_seconds(seq['compile_s'] + seq['train_s'])} |")
  lines += ["", f"Reading the {result['steps']} batches once (shared by both): "
            f"{_seconds(t['read_batches_s'])}; evaluating all models "
            f"(vmapped embedding + metrics): {_seconds(t['eval_s'])}."]
  if seq:
    total = ((seq["compile_s"] + seq["train_s"]) /
             (vm["compile_s"] + vm["train_s"]))
    lines += ["", f"Speed-up of the vmapped grid: "
              f"{seq['train_s'] / vm['train_s']:.2f}x on the training steps, "
              f"{total:.2f}x with compilation."]
  check = result.get("sequential_check")
  if check:
    leaves = sorted(check["param_leaf_diffs"].items(), key=lambda kv: -kv[1])
    apart = check.get("first_step_apart")
    apart = "none" if apart is None else f"step {apart}"
    worst = ", ".join(f"`{k}` {v:.2g}" for k, v in leaves[:3])
    lines += ["", "## Vmapped vs one at a time", "",
              "The same grid trained both ways, in float32 (vmapped with "
              f"`{result.get('conv', 'native')}` convolutions, one at a time "
              "with the model's own):", "",
              f"- largest |parameter difference|: {worst} (median over the "
              f"leaves {np.median([v for _, v in leaves]):.2g}; largest "
              f"|parameter| {check['max_param_abs']:.3g});",
              f"- BatchNorm statistics: {check['max_batch_stats_diff']:.3g};",
              f"- training loss, every step and model: "
              f"{check['max_loss_diff']:.3g}; first step where a model's "
              f"two losses differ by more than 1e-3 (relative): "
              f"{apart};",
              f"- test embeddings: {check['max_embedding_diff']:.3g};",
              f"- MAP@R {check['max_map_diff']:.3g}, R@1 "
              f"{check['max_r1_diff']:.3g}.", "",
              "Differences of float32 rounding (here: grouped or unrolled "
              "against plain convolutions, traced against constant "
              "hyperparameters) grow during training where the dynamics "
              "amplify them, so after many steps the two sets of models are "
              "two runs of the same training that differ by rounding; the "
              "comparison that holds to float32 tolerance is the one of the "
              "first steps (tests/experiments/test_sweep.py). "
              "With Adam, a parameter whose gradient is zero up to rounding "
              "(the bias of a convolution followed by BatchNorm, which the "
              "normalisation cancels) moves by about the learning rate at "
              "every step, in the direction of the rounding noise, so two "
              "float32 runs can differ there by up to steps x learning rate. "
              "The training loss does not see it; the test embeddings do, a "
              "little, because BatchNorm's running mean (evaluation mode) "
              "lags behind those biases."]
  return "\n".join(lines) + "\n"


def write_results(out_dir: str, result: Mapping[str, Any]) -> None:
  """Writes ``results.json``, ``results.md`` and the heatmaps to ``out_dir``."""
  from experiments.figures import plots  # pylint: disable=g-import-not-at-top
  os.makedirs(out_dir, exist_ok=True)
  grid = Grid(tuple(result["grid"]["names"]),
              tuple(tuple(v) for v in result["grid"]["values"]))
  for key, fname, title in HEATMAPS:
    plots.write_heatmap(os.path.join(out_dir, fname), grid,
                  [m["metrics"][key] for m in result["models"]],
                  title=f"{result['loss']} on {result['dataset']}\n{title} "
                        f"after {result['steps']} steps")
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(result, f, indent=2, sort_keys=True, allow_nan=True)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(results_markdown(result))


def run_sweep(config, grid: Grid, *, num_steps: Optional[int] = None,
              compare_sequential: bool = False, eval_at_init: bool = True,
              conv: Optional[str] = None, command: str = "",
              log=print) -> Dict[str, Any]:
  """The whole job: reads the data, trains (and times) the grid, evaluates.

  Args:
    config: the training config (``circle_jax.config.base_config()``).
    grid: the hyperparameter grid.
    num_steps: training steps (default ``config.num_train_steps``).
    compare_sequential: also train the grid one model at a time, time it and
      compare the models (:func:`circle_jax.train.grid.compare_runs`).
    eval_at_init: evaluate the common initial model too.
    conv: the vmapped program's convolutions
      (:func:`circle_jax.train.grid.make_sweep_step`; default
      :func:`circle_jax.train.grid.default_conv`). The sequential baseline
      always uses the model's own (``native``) convolutions.
    command: the command line, for the results file.
    log: progress output.

  Returns:
    The result dict that :func:`write_results` writes (JSON-serialisable).
  """
  conv = conv or grid_lib.default_conv()
  s = setup(config, grid)
  steps = int(num_steps or config.num_train_steps)
  log(f"{grid.size} models ({' x '.join(grid.names)}), {steps} steps, "
      f"loss {s.entry.name}, fixed {s.fixed_hyper}, conv {conv}")
  t0 = time.perf_counter()
  batches = jax.device_put(read_batches(s, steps))
  jax.block_until_ready(batches)
  timings = {"read_batches_s": time.perf_counter() - t0}
  log(f"read {steps} batches in {timings['read_batches_s']:.1f} s")
  init_metrics = None
  if eval_at_init:
    init_metrics = evaluate(s, grid_lib.stacked_state(s.state, 1),
                            conv=conv)[0][0]
  states, history, timings["vmapped"] = grid_lib.train_vmapped(s, batches,
                                                               conv=conv)
  log(f"vmapped: compile {timings['vmapped']['compile_s']:.1f} s, train "
      f"{timings['vmapped']['train_s']:.1f} s")
  metrics, emb, timings["eval_s"] = evaluate(s, states, conv=conv)
  check = None
  if compare_sequential:
    seq_states, seq_history, timings["sequential"] = grid_lib.train_sequential(
        s, batches)
    log(f"sequential: compile {timings['sequential']['compile_s']:.1f} s, "
        f"train {timings['sequential']['train_s']:.1f} s")
    seq_metrics, seq_emb, _ = evaluate(s, seq_states, conv="native")
    check = grid_lib.compare_runs(
        {"states": states, "history": history, "metrics": metrics,
         "embeddings": emb},
        {"states": seq_states, "history": seq_history,
         "metrics": seq_metrics, "embeddings": seq_emb})
  finite = history["finite"].all(axis=0)
  models = []
  for i, point in enumerate(grid.points()):
    models.append({
        "hyper": point,
        "finite": bool(finite[i]),
        "final_loss": float(np.mean(history["loss"][-10:, i])),
        "loss_history": history["loss"][:, i].tolist(),
        "metrics": metrics[i],
    })
  c = config
  return {
      "command": command,
      "dataset": s.info.name,
      "loss": s.entry.name,
      "model": f"{c.model.name} ({c.model.embedding_dim}-d)",
      "optimizer": f"{c.optim.name}, lr {c.optim.learning_rate:g}, loss-group "
                   f"multiplier {c.optim.lr_multipliers.get('loss', 1.0):g}",
      "seed": int(c.seed),
      "batch_size": config_facts.global_batch_size(c),
      "steps": steps,
      "conv": conv,
      "test_images": len(s.test_source),
      "grid": {"names": list(grid.names),
               "values": [list(v) for v in grid.values]},
      "num_models": grid.size,
      "fixed_hyper": dict(s.fixed_hyper),
      "init_metrics": init_metrics,
      "models": models,
      "timings": timings,
      "sequential_check": check,
      "machine": f"Machine: {hostenv.describe()}.",
  }


# ----------------------------------------------------------------------------
# Command line.
# ----------------------------------------------------------------------------


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  grid = parse_grid(f.grid)
  result = run_sweep(
      f.config, grid, num_steps=f.steps,
      compare_sequential=f.compare_sequential, eval_at_init=f.eval_at_init,
      conv=None if f.conv == "auto" else f.conv,
      command="python -m experiments.sweep " + " ".join(sys.argv[1:]))
  write_results(f.out, result)
  print(results_markdown(result))


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  config_flag.DEFINE_config_file(
      "config", "experiments/configs/omniglot_small.py", "Training config.")
  flags.DEFINE_multi_string(
      "grid", None, "NAME=V1,V2,...: one axis of the grid (one or two).",
      required=True)
  flags.DEFINE_integer("steps", None,
                       "Training steps (default: config.num_train_steps).")
  flags.DEFINE_bool("compare_sequential", False,
                    "Also train the grid one model at a time and compare.")
  flags.DEFINE_bool("eval_at_init", True, "Evaluate the initial model too.")
  flags.DEFINE_enum("conv", "auto", ("auto",) + CONVS,
                    "Convolutions of the vmapped program; auto: unrolled on "
                    "CPU, native elsewhere.")
  flags.DEFINE_string("out", None, "Output folder.", required=True)


def _parse_flags(argv):
  """absl's flag parsing, except that ``--help`` exits with status 0."""
  from absl import app  # pylint: disable=g-import-not-at-top
  if {"-h", "--help", "-?", "--helpshort"} & set(argv[1:]):
    app.usage(shorthelp=True, writeto_stdout=True)
    sys.exit(0)
  return app.parse_flags_with_usage(argv)


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  hostenv.reexec_with_hugepage_malloc()  # CIRCLE_JAX_NO_HUGEPAGES=1: off.
  _define_flags()
  app.run(main, flags_parser=_parse_flags)
