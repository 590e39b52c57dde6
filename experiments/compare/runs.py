"""The runs of a loss comparison: one main job per (loss, seed).

:func:`prepare` decides whether a run's workdir already holds it (complete,
same config: reused), holds it evaluated otherwise (complete, and only
``circle_jax.train.workdir.EVALUATION_FIELDS`` differ: re-evaluated, its main
job resumes at the last step and evaluates again, training nothing) or holds
another run (a conflict); :func:`execute` trains it
with ``python -m experiments.main`` in a child process and records the
outcome. ``experiments/compare/losses.py`` (the command line) plans the runs and
``experiments/compare/report.py`` writes their report.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from absl import flags

from circle_jax import config_flag
from circle_jax import hostenv
from circle_jax import losses as losses_lib
from circle_jax.train import workdir as workdir_lib

_REPO = pathlib.Path(__file__).resolve().parents[2]

METRICS_FILE = "metrics.json"
RUN_FILE = "compare_run.json"      # written by this script next to the run
STDOUT_FILE = "compare.stdout.log"
STDERR_FILE = "compare.stderr.log"
STDERR_TAIL_LINES = 20

# Config fields that do not change what a run computes (paths, I/O,
# logging cadence): a finished run with other values is still reused.
IGNORED_FIELDS = (
    "dataset.data_dir", "dataset.manual_dir", "dataset.num_workers",
    "dataset.num_threads", "batch.eval_batch_size", "async_checkpoints",
    "parallelism", "log_every_steps", "checkpoint_every_steps",
    "compilation_cache_dir",
)


# ----------------------------------------------------------------------------
# Runs.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
  """One (loss, seed) training run of a comparison.

  Attributes:
    loss: the registry name of the loss.
    seed: ``config.seed``.
    workdir: the main job's ``--workdir``.
    command: the main job's command line.
    config: the resolved config of the run (plain JSON), as the main job
      will build it.
    status: ``"pending"``, ``"reused"`` (complete before this invocation),
      ``"done"`` (trained or re-evaluated now) or ``"failed"``.
    reevaluate: a pending run that is complete but evaluated with other
      ``workdir.EVALUATION_FIELDS``: the main job only evaluates it again.
    metrics: the run's ``metrics.json`` once complete.
    wall_seconds: wall time of the process that trained the run (None if
      unknown, e.g. a run made by hand); a re-evaluation keeps it.
    error: why the run failed (with the tail of its stderr).
    info: ``compare_run.json`` (command, wall time, machine).
    variant: the ablation it belongs to (``--ablation NAME:...``), "" for
      the comparison's own runs.
  """

  loss: str
  seed: int
  workdir: str
  command: List[str]
  config: Dict[str, Any]
  status: str = "pending"
  metrics: Optional[Dict[str, Any]] = None
  wall_seconds: Optional[float] = None
  error: str = ""
  info: Dict[str, Any] = dataclasses.field(default_factory=dict)
  variant: str = ""
  reevaluate: bool = False

  @property
  def complete(self) -> bool:
    return self.status in ("reused", "done")


def parse_losses(text: str) -> List[str]:
  """``"all"`` (every registered loss, registry order) or ``"a,b,c"``."""
  if text.strip() == "all":
    return list(losses_lib.LOSSES)
  names = [n.strip() for n in text.split(",") if n.strip()]
  unknown = [n for n in names if n not in losses_lib.LOSSES]
  if unknown or not names:
    raise ValueError(
        f"--losses: unknown loss(es) {unknown or text!r}; known losses: "
        f"{', '.join(losses_lib.LOSSES)} (or 'all').")
  if len(set(names)) != len(names):
    raise ValueError(f"--losses: {text!r} names a loss twice.")
  return names


def parse_seeds(text: str) -> List[int]:
  """``"3"`` -> seeds 0, 1, 2; ``"0,4,7"`` -> those seeds."""
  if "," in text:
    seeds = [int(s) for s in text.split(",") if s.strip()]
  else:
    seeds = list(range(int(text)))
  if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
    raise ValueError(f"--seeds: expected a count >= 1 or distinct seeds "
                     f">= 0; got {text!r}.")
  return seeds


def config_args(config: str, loss: str, seed: int,
                overrides: Sequence[str]) -> List[str]:
  """The config flags of one run (what :func:`resolve_config` parses)."""
  return [f"--config={config}", f"--config.loss.name={loss}",
          f"--config.seed={seed}", *overrides]


def main_command(flag_args: Sequence[str], workdir: str) -> List[str]:
  """The main job's command line for one run."""
  return [sys.executable, "-m", "experiments.main", *flag_args,
          f"--workdir={workdir}"]


def resolve_config(flag_args: Sequence[str]) -> Dict[str, Any]:
  """The config that ``experiments.main`` builds from these flags (as JSON).

  Parsed with the main job's own ``--config`` flag, so a bad override or a
  hyperparameter the loss does not have fails here, before any training.
  """
  argv = ["experiments.main", *flag_args]
  values = flags.FlagValues()
  holder = config_flag.DEFINE_config_file("config", None, flag_values=values,
                                          sys_argv=argv)
  try:
    values(argv, known_only=True)
  except flags.Error as e:
    raise ValueError(str(e)) from None
  except (AttributeError, KeyError) as e:  # ml_collections: unknown field
    raise ValueError(f"a --config.* override names a field that the config "
                     f"does not have ({e}); see circle_jax/config.py."
                     ) from None
  return json.loads(holder.value.to_json_best_effort(sort_keys=True))


def config_differences(saved: Dict[str, Any], expected: Dict[str, Any]
                       ) -> List[Tuple[str, Any, Any]]:
  """Fields (outside :data:`IGNORED_FIELDS`) whose values differ."""
  return [d for d in workdir_lib.config_diff(saved, expected)
          if not workdir_lib.in_fields(d[0], IGNORED_FIELDS)]


def _read_json(path: str) -> Optional[Any]:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def complete_metrics(workdir: str) -> Optional[Dict[str, Any]]:
  """The workdir's ``metrics.json`` if it is complete (has ``result.test``)."""
  metrics = _read_json(os.path.join(workdir, METRICS_FILE))
  if not isinstance(metrics, dict):
    return None
  result = metrics.get("result")
  if not isinstance(result, dict) or not isinstance(result.get("test"), dict):
    return None
  return metrics


def _saved_differences(run: Run) -> List[Tuple[str, Any, Any]]:
  """The fields in which ``run.workdir``'s saved config differs from the
  run's ([] if there is none)."""
  metrics = _read_json(os.path.join(run.workdir, METRICS_FILE))
  if isinstance(metrics, dict) and isinstance(metrics.get("config"), dict):
    saved = metrics["config"]
  else:
    saved = _read_json(os.path.join(run.workdir, "config.json"))
  if not isinstance(saved, dict):
    return []
  return config_differences(saved, run.config)


def _workdir_conflict(diff: List[Tuple[str, Any, Any]], run: Run) -> str:
  """Why ``run.workdir`` holds another run ("" if it does not): a field
  outside ``workdir.EVALUATION_FIELDS`` differs."""
  if all(workdir_lib.is_evaluation_field(d[0]) for d in diff):
    return ""
  shown = "; ".join(f"{p}: {_short(a)} (there) vs {_short(b)} (this "
                    "comparison)" for p, a, b in diff[:5])
  more = f" and {len(diff) - 5} more" if len(diff) > 5 else ""
  return (f"{run.workdir} holds a run of another config ({shown}{more}); "
          "pass another --workdir, or delete that folder.")


def _short(v) -> str:
  text = json.dumps(v) if v != workdir_lib.ABSENT else v
  return text if len(text) <= 40 else text[:37] + "..."


def prepare(run: Run) -> None:
  """Marks ``run`` reused (complete, same config), failed (conflict), or
  pending; pending with ``reevaluate`` when it is complete but evaluated
  with other ``workdir.EVALUATION_FIELDS``."""
  diff = _saved_differences(run)
  conflict = _workdir_conflict(diff, run)
  if conflict:
    run.status, run.error = "failed", conflict
    return
  metrics = complete_metrics(run.workdir)
  if metrics is not None:
    run.info = _read_json(os.path.join(run.workdir, RUN_FILE)) or {}
    run.wall_seconds = run.info.get("wall_seconds")
    if diff:
      run.status, run.reevaluate = "pending", True
    else:
      run.status, run.metrics = "reused", metrics


def _tail(path: str, lines: int = STDERR_TAIL_LINES) -> str:
  try:
    with open(path, errors="replace") as f:
      return "".join(f.readlines()[-lines:]).rstrip()
  except OSError:
    return ""


def execute(run: Run, env: Dict[str, str]) -> None:
  """Runs the main job of ``run`` and records its outcome in ``run``.

  stdout and stderr go to ``compare.stdout.log`` / ``compare.stderr.log`` in
  the workdir; ``compare_run.json`` records the command, the wall time and
  the machine. On Ctrl-C the child (which saves its last step) is waited
  for and ``KeyboardInterrupt`` is raised again.
  """
  os.makedirs(run.workdir, exist_ok=True)
  out_path = os.path.join(run.workdir, STDOUT_FILE)
  err_path = os.path.join(run.workdir, STDERR_FILE)
  load_start = os.getloadavg()[0]
  t0 = time.time()
  with open(out_path, "w") as out, open(err_path, "w") as err:
    proc = subprocess.Popen(run.command, stdout=out, stderr=err, env=env)
    try:
      code = proc.wait()
    except KeyboardInterrupt:
      proc.wait()
      raise
  wall = time.time() - t0
  metrics = complete_metrics(run.workdir)
  if code == 0 and metrics is not None:
    finished = datetime.datetime.now().isoformat(timespec="seconds")
    if run.reevaluate:  # the training's record stays; this one is added
      run.status, run.metrics = "done", metrics
      run.info = {**run.info, "reevaluated": (
          run.info.get("reevaluated", []) + [{
              "command": run.command, "wall_seconds": wall,
              "finished": finished}])}
    else:
      run.status, run.metrics, run.wall_seconds = "done", metrics, wall
      run.info = {
          "command": run.command, "wall_seconds": wall, "finished": finished,
          **hostenv.machine_info(),
          "load_average": [load_start, os.getloadavg()[0]],
      }
    with open(os.path.join(run.workdir, RUN_FILE), "w") as f:
      json.dump(run.info, f, indent=2)
    return
  why = (f"exit status {code}" if code else
         f"exit status 0 but no complete {METRICS_FILE}")
  run.status = "failed"
  run.error = (f"{why} after {wall:.0f} s; workdir {run.workdir}; last "
               f"lines of {err_path}:\n{_tail(err_path)}")


def child_env(workdir: str, compilation_cache: bool) -> Dict[str, str]:
  """The main jobs' environment: this repo importable, the shared cache."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(_REPO), env.get("PYTHONPATH", "")) if p)
  if compilation_cache and "JAX_COMPILATION_CACHE_DIR" not in env:
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
        os.path.abspath(workdir), "jax_cache")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  return env
