"""Runs the main job several times, optionally under CPU load, and compares.

Each run is ``python -m experiments.main`` on the digits config for a few SGD
steps in a fresh process with ``--devices`` simulated CPU devices; the final
checkpoints (parameters, optimiser state, batch statistics) are compared with
the first run's, bitwise. ``--load N`` keeps N busy-looping processes running
meanwhile, to look for thread-timing-dependent results (XLA:CPU thread pools,
input threads).

Usage::

  python -m experiments.tools.check_determinism --runs 10 --devices 4 --load 4
  python -m experiments.tools.check_determinism --runs 8 --load 6 \\
      --extra=--config.model.embedding_dim=32

Prints one line per run with the largest absolute difference to run 0 and
exits with status 1 if any run differs. Results:
``experiments/results/tools/check_determinism_cpu.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def short_run_command(workdir, data_dir, steps, extra=()):
  """The main job on digits for ``steps`` SGD-momentum steps, checkpointing
  every 4 steps, without evaluation: the run that the resume and multi-host
  tests (``tests/train/test_resume_multihost.py``) and this script compare."""
  return [sys.executable, "-m", "experiments.main",
          "--config=experiments/configs/digits.py", f"--workdir={workdir}",
          f"--config.dataset.data_dir={data_dir}",
          f"--config.num_train_steps={steps}",
          "--config.checkpoint_every_steps=4", "--config.eval_every_steps=0",
          "--config.eval_at_init=False", "--config.eval_clustering=False",
          "--config.log_every_steps=4", "--config.best_metric=",
          "--config.dataset.num_threads=2", "--config.optim.name=sgd",
          "--config.optim.learning_rate=0.05", "--config.optim.momentum=0.9",
          *extra]


def _final_leaves(workdir):
  """The leaves of a run's latest checkpoint (the whole saved train state)."""
  import jax  # pylint: disable=import-outside-toplevel
  from circle_jax.train import restore as restore_lib  # pylint: disable=import-outside-toplevel
  ckpts = restore_lib.open_checkpoints(restore_lib.load_config(workdir),
                                       workdir)
  try:
    tree, _, _ = restore_lib.restore_checkpoint(ckpts, which="latest")
  finally:
    ckpts.close()
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _burn(stop):
  while not stop.is_set():
    sum(i * i for i in range(10000))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--runs", type=int, default=5)
  p.add_argument("--devices", type=int, default=4)
  p.add_argument("--load", type=int, default=0,
                 help="busy-looping processes kept running meanwhile")
  p.add_argument("--steps", type=int, default=24)
  p.add_argument("--extra", action="append", default=[],
                 help="extra main-job flags (repeatable)")
  args = p.parse_args()

  root = tempfile.mkdtemp(prefix="determinism_")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_REPO,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}")
  stop = multiprocessing.Event()
  hogs = [multiprocessing.Process(target=_burn, args=(stop,))
          for _ in range(args.load)]
  for h in hogs:
    h.start()
  first, differs = None, False
  try:
    for i in range(args.runs):
      workdir = os.path.join(root, f"run{i}")
      t0 = time.time()
      proc = subprocess.run(
          short_run_command(workdir, os.path.join(root, "tfds"), args.steps,
                            args.extra), cwd=_REPO, env=env, capture_output=True,
          text=True, check=False)
      if proc.returncode:
        sys.exit(f"run {i} failed:\n{proc.stderr[-3000:]}")
      leaves = _final_leaves(workdir)
      first = first or leaves
      diff = max(float(np.abs(a.astype(np.float64) - b).max())
                 for a, b in zip(leaves, first))
      differs |= diff != 0.0
      print(f"run {i}: {time.time() - t0:.0f} s, max |diff| vs run 0: "
            f"{diff:.3g}, load average {os.getloadavg()[0]:.1f}", flush=True)
  finally:
    stop.set()
    for h in hogs:
      h.join()
    shutil.rmtree(root, ignore_errors=True)
  sys.exit(1 if differs else 0)


if __name__ == "__main__":
  main()
