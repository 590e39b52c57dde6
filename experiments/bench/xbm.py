r"""The train step's time with a cross-batch memory of M rows.

Builds the run of a config (model, state, loss) as the trainer does, without
data (random images of the preprocessed shape and P x K labels), compiles
the train step once per memory size, and times the sizes interleaved in
rounds, so a machine whose load changes affects every size alike::

  python -m experiments.bench.xbm --sizes 0,512,2048 \
      --out experiments/results/bench/xbm_cpu.md

Reports the median and the minimum over the rounds of the mean step time
of each round, and the memory's bytes per device.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import statistics
import sys
import time
from typing import Optional, Sequence

import jax
import numpy as np

from circle_jax import config_facts
from circle_jax import config as config_lib
from circle_jax import data as data_lib
from circle_jax import hostenv
from circle_jax import parallel
from circle_jax.train import config_checks
from circle_jax.train import run as run_lib
from circle_jax.train import state as state_lib
from circle_jax.train import step as step_lib
from circle_jax.train import xbm as xbm_lib
from experiments.configs import omniglot_small

_REPO = pathlib.Path(__file__).resolve().parents[2]


def build_step(config, size: int):
  """``(step, state, batch)`` of ``config`` with ``xbm.size = size``."""
  config = config.copy_and_resolve_references()
  config.xbm.size = size
  info = data_lib.get_dataset_info(config.dataset.name)
  shape = config_facts.train_preprocess(config, info).output_shape
  placement = parallel.from_config(config)
  model = run_lib.build_model(config, placement)
  state, entry, hyper, key = run_lib.init_state(config, model, info, shape)
  host = parallel.SingleDevice().to_host(state_lib.state_to_tree(state))
  state = state_lib.state_from_tree(
      state, placement.replicate(host, sharded=xbm_lib.is_sharded))
  step = step_lib.make_train_step(step_lib.make_loss_fn(entry, hyper),
                                  placement=placement, base_key=key)
  p, k = config.batch.classes_per_batch, config.batch.images_per_class
  rng = np.random.default_rng(0)
  batch = placement.shard_batch({
      "image": rng.standard_normal((p * k,) + tuple(shape), np.float32),
      "label": np.repeat(np.arange(p, dtype=np.int32), k)})
  return step, state, batch


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--sizes", default="0,512,2048")
  p.add_argument("--losses", default="circle,multi_similarity,contrastive")
  p.add_argument("--steps", type=int, default=20, help="steps per round")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--out", default="experiments/results/bench/xbm_cpu.md")
  args = p.parse_args(argv)
  sizes = [int(s) for s in args.sizes.split(",")]
  base = omniglot_small.get_config()
  lines = []
  for loss in args.losses.split(","):
    config = base.copy_and_resolve_references()
    config.loss = config_lib.loss_config(loss)
    config_checks.check_config(config)
    runs = {m: list(build_step(config, m)) for m in sizes}
    for m in sizes:  # compile and warm up
      step, state, batch = runs[m]
      runs[m][1], metrics = step(state, batch)
      jax.block_until_ready(metrics)
    times = {m: [] for m in sizes}
    for _ in range(args.rounds):
      for m in sizes:
        step, state, batch = runs[m]
        t0 = time.perf_counter()
        for _ in range(args.steps):
          state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times[m].append((time.perf_counter() - t0) / args.steps * 1e3)
        runs[m][1] = state
    for m in sizes:
      dim = config.model.embedding_dim
      lines.append(
          f"| `{loss}` | {m} | {statistics.median(times[m]):.1f} | "
          f"{min(times[m]):.1f} | "
          f"{xbm_lib.bytes_per_device(m, dim, 'float32', 1):,} |")
    print("\n".join(lines[-len(sizes):]), flush=True)
  cfg = base
  text = "\n".join([
      "# Train step time with a cross-batch memory (CPU)",
      "",
      "```bash",
      "python -m experiments.bench.xbm " + shlex.join(
          ["--sizes", args.sizes, "--losses", args.losses, "--steps",
           str(args.steps), "--rounds", str(args.rounds), "--out", args.out]),
      "```",
      "",
      f"The omniglot_small config (`experiments/configs/omniglot_small.py`: "
      f"{cfg.model.name} {cfg.model.embedding_dim}-d, P x K = "
      f"{cfg.batch.classes_per_batch} x {cfg.batch.images_per_class}, "
      f"{jax.device_count()} device, parallelism {cfg.parallelism}), random "
      "images, memory written from the first step (start_step 0; a step's "
      "work does not depend on how full the memory is: every row is "
      "compared, empty ones masked). Each "
      f"round times {args.steps} steps of every size in turn; "
      f"{args.rounds} rounds. Machine: "
      f"{hostenv.cpu_text(hostenv.machine_info())}; the machine is shared, "
      "so compare the sizes within a loss (same rounds), not across runs.",
      "",
      "| loss | M | ms / step (median of rounds) | ms / step (best round) | "
      "XBM bytes / device |",
      "| --- | ---: | ---: | ---: | ---: |",
      *lines, ""])
  pathlib.Path(args.out).write_text(text)
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
