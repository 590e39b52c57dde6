"""The main job: ``python -m experiments.main --config CONFIG --workdir DIR``.

Trains and evaluates with :func:`circle_jax.train.loop.train_and_evaluate`,
with a live progress bar on stderr and the result table on stdout. Running the
same command again resumes from ``DIR/checkpoints``; a changed config that
trains something else is refused (``--force_resume`` overrides). Ctrl-C saves
the last completed step and prints the command that resumes. Errors a user can
fix print one line (``--verbose``: tracebacks and the libraries' INFO logs).

The job re-executes itself with glibc's huge-page malloc
(``circle_jax/hostenv.py``; ``CIRCLE_JAX_NO_HUGEPAGES=1`` keeps the default).

Any config field can be overridden (``--config.num_train_steps=500``), and
``--config.loss.name=NAME`` selects another registered loss with its own
paper defaults (:func:`circle_jax.config_flag.switch_loss`). Run it from the
repository root (or with the root on ``PYTHONPATH``).

Multi-host: pass ``--jax_distributed`` to call ``jax.distributed.initialize()``
with the cluster's auto-detected settings (TPU pods, SLURM, ...), or give the
coordinator explicitly (e.g. two CPU processes on one machine)::

  python -m experiments.main ... --coordinator_address=localhost:12345 \\
      --num_processes=2 --process_id=0
"""

import sys


from absl import app
from absl import flags
from absl import logging
import jax

from circle_jax import config_flag
from circle_jax import hostenv
from circle_jax.train import console

_CONFIG = config_flag.DEFINE_config_file(
    "config", "experiments/configs/digits.py", "Training config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder.", required=True)
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Show the libraries' INFO logs and full tracebacks.")
_FORCE_RESUME = flags.DEFINE_bool(
    "force_resume", False,
    "Resume the workdir's run even if the config changed fields that change "
    "the training (model, data, loss, optimiser, ...).")
_DISTRIBUTED = flags.DEFINE_bool(
    "jax_distributed", False,
    "Call jax.distributed.initialize() with auto-detected cluster settings.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (multi-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process' id.")


def _train():
  hostenv.enable_compilation_cache(_CONFIG.value.get("compilation_cache_dir"))
  if _COORDINATOR.value:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  elif _DISTRIBUTED.value:
    jax.distributed.initialize()
  logging.info("JAX process %d/%d, %d local / %d global devices (%s); %s.",
               jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count(),
               jax.devices()[0].platform, hostenv.malloc_setting())
  # Imported here so that jax.distributed is initialised first.
  from circle_jax.train import loop  # pylint: disable=g-import-not-at-top
  reporter = (console.ConsoleReporter() if jax.process_index() == 0
              else console.LogReporter())
  loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value, reporter=reporter,
                          force_resume=_FORCE_RESUME.value)


def _interrupted(e) -> str:
  step = getattr(e, "saved_step", None)
  where = getattr(e, "directory", _WORKDIR.value)
  saved = (f"the last saved step is {step} ({where})" if step is not None
           else "no checkpoint was saved yet")
  what = (f"Preempted ({e.signal_name}, exit status {e.exit_status})"
          if hasattr(e, "signal_name") else "Interrupted")
  return (f"{what}: {saved}. Resume with:\n  "
          f"{console.resume_command(sys.argv, 'experiments.main')}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  console.configure_logging(_VERBOSE.value)
  status = console.run_tool(_train, verbose=_VERBOSE.value,
                            on_interrupt=_interrupted)
  if status:
    sys.exit(status)


if __name__ == "__main__":
  # Huge-page malloc, as the benchmarks run (circle_jax/hostenv.py; off with
  # CIRCLE_JAX_NO_HUGEPAGES=1): XLA:CPU allocates a step's temporaries
  # afresh on every call, and their page faults were a quarter of a HIER
  # step on a 2-core CPU (2.43-2.53 -> 3.33-3.46 steps/s, the same losses).
  hostenv.reexec_with_hugepage_malloc()
  app.run(main)
