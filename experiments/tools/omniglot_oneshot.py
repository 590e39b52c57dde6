"""The official Omniglot 20-way one-shot runs with a trained model.

  python -m experiments.tools.omniglot_oneshot --workdir W --runs all_runs.zip \\
      [--which best|latest]

``--runs`` is ``python/one-shot-classification/all_runs.zip`` of the Omniglot
repository (Lake et al. 2015, https://github.com/brendenlake/omniglot) or its
extracted folder; nothing is downloaded. Each test image is classified by
1-nearest neighbour (cosine) among its run's training images, embedded with the
workdir's model and eval preprocessing
(:mod:`circle_jax.evaluation.omniglot_oneshot`). Prints the error of each run
and their mean, in %, as the paper reports them.
"""

import sys


import argparse
from typing import Optional, Sequence

from circle_jax import hostenv
from circle_jax.evaluation import omniglot_oneshot
from circle_jax.train import console
from circle_jax.train import restore as restore_lib


def _run(args):
  runs = omniglot_oneshot.read_runs(args.runs)
  run = restore_lib.restore_run(args.workdir, args.which)
  result, info = omniglot_oneshot.evaluate_run(run, runs)
  print(f"{info['workdir']} ({info['dataset']}), {info['which']} checkpoint "
        f"at step {info['step']}: 1-NN (cosine) one-shot error")
  for name, error in zip(result.runs, result.errors):
    print(f"{name}  {error:6.2f}%")
  print(f"mean   {result.mean_error:6.2f}% over {len(result.runs)} runs")


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workdir", required=True, help="a training run's folder")
  p.add_argument("--runs", required=True, help="all_runs.zip or its folder")
  p.add_argument("--which", choices=("best", "latest"), default=None,
                 help="checkpoint (default: best if the run kept one)")
  p.add_argument("--verbose", action="store_true",
                 help="library INFO logs and full tracebacks")
  args = p.parse_args(argv)
  console.configure_logging(args.verbose)
  hostenv.enable_compilation_cache()
  return console.run_tool(lambda: _run(args), verbose=args.verbose)


if __name__ == "__main__":
  sys.exit(main())
