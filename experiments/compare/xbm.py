r"""Cross-batch memory on omniglot_small: losses x memory sizes x seeds.

Trains each (loss, memory size, seed) with the main job, through the loss
comparison's runner (``experiments/compare/runs.py``: same protocol, reuse of
finished runs, one process per run, a shared compilation cache), and writes
``OUT.md`` (accuracy, step time and the memory's footprint per device) and
``OUT.png``::

  python -m experiments.compare.xbm --out experiments/results/compare/xbm_omniglot_small

Every run is ``experiments/configs/omniglot_small.py`` with
``--config.dataset.validation_fraction=0.2 --config.num_train_steps=800
--config.eval_every_steps=200`` (the protocol of
experiments/results/compare/losses_omniglot_small.md) plus ``--config.xbm.size=M
--config.xbm.start_step=START``; ``M = 0`` is the run without memory.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import shlex
import statistics
import sys
import time
from typing import List, Optional, Sequence

from circle_jax import config as config_lib
from circle_jax import data as data_lib
from circle_jax import results
from circle_jax import config_facts
from circle_jax.train import xbm as xbm_lib
from experiments.compare import runs as compare_runs
from experiments.compare import report as compare_report

_REPO = pathlib.Path(__file__).resolve().parents[2]

CONFIG = "experiments/configs/omniglot_small.py"
PROTOCOL = ("--config.dataset.validation_fraction=0.2",
            "--config.num_train_steps=800", "--config.eval_every_steps=200")
LOSSES = "circle,multi_similarity,contrastive"
SIZES = "0,512,2048"
START_STEP = 100


def label(loss: str, size: int) -> str:
  """The row name of a (loss, memory size)."""
  return f"{loss}, M={size}"


def build_runs(args) -> List[compare_runs.Run]:
  """Every (loss, memory size, seed) run, its row name as ``run.loss``."""
  runs = []
  for loss in compare_runs.parse_losses(args.losses):
    for size in parse_sizes(args.sizes):
      overrides = [*PROTOCOL, f"--config.xbm.size={size}",
                   f"--config.xbm.start_step={args.start_step}"]
      for seed in compare_runs.parse_seeds(args.seeds):
        workdir = os.path.join(args.workdir, f"xbm_{size}", loss,
                               f"seed_{seed}")
        flags = compare_runs.config_args(CONFIG, loss, seed, overrides)
        run = compare_runs.Run(loss, seed, workdir,
                               compare_runs.main_command(flags, workdir),
                               compare_runs.resolve_config(flags))
        run.loss = label(loss, size)
        runs.append(run)
  return runs


def parse_sizes(text: str) -> List[int]:
  return [int(s) for s in text.split(",") if s.strip()]


def command(args) -> str:
  cmd = ["python", "-m", "experiments.compare.xbm", "--losses", args.losses,
         "--sizes", args.sizes, "--seeds", args.seeds, "--start-step",
         str(args.start_step), "--out", args.out]
  return shlex.join(cmd)


def memory_scale(done, args) -> str:
  """How the memory sizes compare with the train images of the runs."""
  if not done:
    return ""
  info = data_lib.get_dataset_info(done[0]["config"]["dataset"]["name"])
  train = info.num_images["train"] - (done[0]["validation"] or {}).get(
      "num_images", 0)
  batch = config_facts.global_batch_size(
      config_lib.from_dict(done[0]["config"]))
  return "; ".join(
      f"M={m} is {m / train:.0%} of the {train:,} train images (filled "
      f"{m // batch} steps after step {args.start_step})"
      for m in parse_sizes(args.sizes) if m)


def cost_lines(runs: Sequence[compare_runs.Run], rows: Sequence[str]
               ) -> List[str]:
  """Step time and memory footprint per (loss, memory size)."""
  lines = ["| run | ms / step | XBM bytes / device (1 device) | "
           "XBM bytes / device (8 devices) |",
           "| --- | ---: | ---: | ---: |"]
  for row in rows:
    done = [r for r in runs if r.loss == row and r.metrics is not None]
    if not done:
      lines.append(f"| `{row}` | – | – | – |")
      continue
    cfg = done[0].metrics["config"]
    steps = cfg["num_train_steps"]
    ms = results.aggregate([r.metrics["train_seconds"] / steps * 1e3
                            for r in done])
    size, dim = cfg["xbm"]["size"], cfg["model"]["embedding_dim"]
    one, eight = (xbm_lib.bytes_per_device(size, dim, cfg["xbm"]["dtype"], n)
                  for n in (1, 8))
    lines.append(f"| `{row}` | {results.format_stat(ms, 1.0, 0)} | {one:,} | "
                 f"{eight:,} |")
  return lines


DISCUSSION = "## Discussion"


def effect_lines(summary, losses: Sequence[str], sizes: Sequence[int]
                 ) -> List[str]:
  """R@1 and MAP@R of each memory size minus the loss's run without one."""
  lines = ["| loss | M | ΔR@1 | ΔMAP@R | seeds' std of R@1 (M=0, M) |",
           "| --- | ---: | ---: | ---: | ---: |"]
  for loss in losses:
    base = summary.get(label(loss, 0), {})
    for size in sizes:
      row = summary.get(label(loss, size), {})
      if not size or not base.get("recall@1") or not row.get("recall@1"):
        continue
      d = {k: 100 * (row[k].mean - base[k].mean) for k in ("recall@1",
                                                           "map@r")}
      stds = ", ".join("–" if s.std is None else f"{100 * s.std:.1f}"
                       for s in (base["recall@1"], row["recall@1"]))
      lines.append(f"| `{loss}` | {size} | {d['recall@1']:+.1f} | "
                   f"{d['map@r']:+.1f} | {stds} |")
  return lines


def _kept_discussion(md_path: pathlib.Path) -> List[str]:
  """The hand-written discussion of an earlier version of the file."""
  if not md_path.exists():
    return []
  text = md_path.read_text()
  if DISCUSSION not in text:
    return []
  kept = text.split(DISCUSSION, 1)[1].split("\n## Runs", 1)[0]
  return [DISCUSSION + kept.rstrip("\n"), ""]


def write_report(out: str, args, runs, rows, elapsed: float) -> None:
  """Writes ``OUT.md`` (keeping its hand-written discussion) and ``OUT.png``.
  """
  md_path, png_path = pathlib.Path(out + ".md"), pathlib.Path(out + ".png")
  cfg = runs[0].config
  done = [r.metrics for r in runs if r.metrics is not None]
  columns = compare_report.metric_columns(runs)
  summary = compare_report.summarize(runs, rows, [k for k, _ in columns])
  counts = {row: (sum(r.loss == row and r.metrics is not None for r in runs),
                  sum(r.loss == row for r in runs)) for row in rows}
  walls = [r.wall_seconds for r in runs if r.wall_seconds]
  lines = [
      f"# Cross-batch memory (XBM): {cfg['dataset']['name']}, "
      f"{cfg['model']['name']} {cfg['model']['embedding_dim']}-d",
      "",
      "Regenerate (reuses the finished runs in the workdir, trains the "
      "others):",
      "",
      "```bash",
      command(args),
      "```",
      "",
      f"Each run: `python -m experiments.main --config={CONFIG} "
      f"--config.loss.name=LOSS --config.seed=S {' '.join(PROTOCOL)} "
      f"--config.xbm.size=M --config.xbm.start_step={args.start_step}` "
      "(the protocol of experiments/results/compare/losses_omniglot_small.md "
      "plus the memory):",
      "",
      f"- data: {results.describe_data(cfg, done)}",
      f"- model: {results.describe_model(cfg)}",
      f"- batch: {results.describe_batch(cfg)}",
      f"- optimiser: {results.describe_optim(cfg)}",
      f"- steps: {cfg['num_train_steps']}; evaluation every "
      f"{cfg['eval_every_steps']} steps",
      f"- reported step: {results.describe_selection(cfg, done)}",
      f"- memory: M rows of the last train embeddings, enqueued from step "
      f"{args.start_step} on, loss = L(batch, batch) + 1.0 x L(batch, "
      f"memory) (circle_jax/train/xbm.py); {memory_scale(done, args)}",
      "- values: test-split metrics in %, mean ± sample standard deviation "
      "(ddof=1) over the seeds; the best mean of each column in bold",
      f"- time: {len(walls)} timed runs, {sum(walls):.0f} s in all, "
      + (f"{statistics.fmean(walls):.0f} s wall per run" if walls else "")
      + f"; this invocation {elapsed:.0f} s",
      f"- machine: {compare_report.machine_text(runs)}",
      f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
      "",
      results.table_markdown(summary, columns, counts),
      "",
      f"![R@1 and MAP@R per loss and memory size]({png_path.name})",
      "",
      "## Effect of the memory",
      "",
      "Mean over the seeds with the memory minus mean without (percentage "
      "points), and the seeds' standard deviations for scale.",
      "",
      *effect_lines(summary, compare_runs.parse_losses(args.losses),
                    parse_sizes(args.sizes)),
      "",
      "## Cost",
      "",
      "`ms / step`: the run's training-loop seconds (metrics.json "
      "`train_seconds`, which includes the step's compilation and the "
      "evaluations every 200 steps) / steps, mean ± std over the seeds. "
      "Memory per device: M/n x (D x 4 bytes + a 4-byte label), "
      "`circle_jax.train.xbm.bytes_per_device`; these runs use 1 CPU "
      "device.",
      "",
      *cost_lines(runs, rows),
      "",
      "## Runs",
      "",
      "| run | seed | step | R@1 | MAP@R | train s | wall s |",
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  for r in runs:
    if r.metrics is None:
      lines.append(f"| `{r.loss}` | {r.seed} | failed |" + " – |" * 4)
      continue
    res = r.metrics["result"]
    lines.append(
        f"| `{r.loss}` | {r.seed} | {res['step']} | "
        f"{100 * res['test']['recall@1']:.1f} | "
        f"{100 * res['test']['map@r']:.1f} | "
        f"{r.metrics['train_seconds']:.0f} | "
        f"{'–' if r.wall_seconds is None else f'{r.wall_seconds:.0f}'} |")
  md_path.parent.mkdir(parents=True, exist_ok=True)
  lines = lines[:lines.index("## Runs")] + _kept_discussion(md_path) + lines[
      lines.index("## Runs"):]
  md_path.write_text("\n".join(lines) + "\n")
  from experiments.figures import plots  # pylint: disable=g-import-not-at-top
  plots.write_bars(png_path, summary, compare_report.PLOT_METRICS,
                   f"{cfg['dataset']['name']}: loss, XBM memory size M "
                   f"(0: none), {cfg['num_train_steps']} steps")


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--losses", default=LOSSES)
  p.add_argument("--sizes", default=SIZES, help="memory sizes (0: none)")
  p.add_argument("--seeds", default="3")
  p.add_argument("--start-step", dest="start_step", type=int,
                 default=START_STEP)
  p.add_argument("--out",
                 default="experiments/results/compare/xbm_omniglot_small")
  p.add_argument("--workdir", default="/tmp/circle_jax_compare/xbm_study")
  p.add_argument("--report-only", dest="report_only", action="store_true",
                 help="write the report of the finished runs, train nothing")
  args = p.parse_args(argv)
  started = time.time()
  runs = build_runs(args)
  rows = list(dict.fromkeys(r.loss for r in runs))
  env = compare_runs.child_env(args.workdir, compilation_cache=True)
  for run in runs:
    compare_runs.prepare(run)
  # Seed 0 of every row first: a comparison cut short still has every row.
  todo = sorted((r for r in runs if r.status == "pending"),
                key=lambda r: r.seed)
  print(f"[xbm_study] {len(runs)} runs, {len(todo)} to train", flush=True)
  if args.report_only:
    todo = []
  for i, run in enumerate(todo):
    print(f"[xbm_study] {i + 1}/{len(todo)} {run.loss} seed {run.seed} ...",
          flush=True)
    compare_runs.execute(run, env)
    print(f"[xbm_study]   {run.status}"
          + (f": {run.error}" if run.error else ""), flush=True)
  write_report(args.out, args, runs, rows, time.time() - started)
  print(f"[xbm_study] wrote {args.out}.md and {args.out}.png")
  return int(any(r.status == "failed" for r in runs))


if __name__ == "__main__":
  sys.exit(main())
