"""The main job: ``python -m experiments.main --config CONFIG --workdir DIR``.

Trains and evaluates with :func:`circle_jax.train.train_and_evaluate`. Running
the same command again resumes from ``DIR/checkpoints``.

Multi-host: pass ``--jax_distributed`` to call ``jax.distributed.initialize()``
with the cluster's auto-detected settings (TPU pods, SLURM, ...), or give the
coordinator explicitly (e.g. two CPU processes on one machine)::

  python -m experiments.main ... --coordinator_address=localhost:12345 \
      --num_processes=2 --process_id=0
"""

from absl import app
from absl import flags
from absl import logging
import jax
from experiments import config_flag

_CONFIG = config_flag.DEFINE_config_file(
    "config", "experiments/configs/digits.py", "Training config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder.", required=True)
_DISTRIBUTED = flags.DEFINE_bool(
    "jax_distributed", False,
    "Call jax.distributed.initialize() with auto-detected cluster settings.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (multi-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process' id.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _COORDINATOR.value:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value,
                               process_id=_PROCESS_ID.value)
  elif _DISTRIBUTED.value:
    jax.distributed.initialize()
  logging.info("JAX process %d/%d, %d local / %d global devices (%s).",
               jax.process_index(), jax.process_count(),
               jax.local_device_count(), jax.device_count(),
               jax.devices()[0].platform)
  # Imported here so that jax.distributed is initialised first.
  from circle_jax.train import loop  # pylint: disable=g-import-not-at-top
  loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
