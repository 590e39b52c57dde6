"""The official Omniglot 20-way one-shot runs with a trained model.

  python -m experiments.omniglot_oneshot --workdir W --runs all_runs.zip \\
      [--which best|latest]

``--runs`` is ``python/one-shot-classification/all_runs.zip`` of the Omniglot
repository (Lake et al. 2015, https://github.com/brendenlake/omniglot) or its
extracted folder; nothing is downloaded. Each test image is classified by
1-nearest neighbour (cosine) among its run's training images, embedded with the
workdir's model and eval preprocessing
(:mod:`circle_jax.evaluation.omniglot_oneshot`). Prints the error of each run
and their mean, in %, as the paper reports them.
"""

import os
import sys

if __package__ in (None, ""):  # python experiments/omniglot_oneshot.py
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags

from circle_jax.evaluation import omniglot_oneshot
from circle_jax.train import console
# pylint: enable=g-import-not-at-top,wrong-import-position

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's folder.",
                               required=True)
_RUNS = flags.DEFINE_string("runs", None, "all_runs.zip or its folder.",
                            required=True)
_WHICH = flags.DEFINE_enum("which", None, ["best", "latest"],
                           "Checkpoint (default: best if the run kept one).")
_VERBOSE = flags.DEFINE_bool("verbose", False,
                             "Library INFO logs and full tracebacks.")


def _run():
  result, info = omniglot_oneshot.evaluate_workdir(
      _WORKDIR.value, _RUNS.value, which=_WHICH.value)
  print(f"{info['workdir']} ({info['dataset']}), {info['which']} checkpoint "
        f"at step {info['step']}: 1-NN (cosine) one-shot error")
  for name, error in zip(result.runs, result.errors):
    print(f"{name}  {error:6.2f}%")
  print(f"mean   {result.mean_error:6.2f}% over {len(result.runs)} runs")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  console.configure_logging(_VERBOSE.value)
  status = console.run_tool(_run, verbose=_VERBOSE.value)
  if status:
    sys.exit(status)


if __name__ == "__main__":
  app.run(main)
