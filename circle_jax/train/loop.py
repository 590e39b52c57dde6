"""``train_and_evaluate(config, workdir)``: the main training job.

Trains an embedding with any registered loss on any registered dataset,
evaluates retrieval (Recall@K, P@1, R-Precision, MAP@R) and clustering
(NMI/AMI) on the test split(s), checkpoints with orbax and resumes.

Determinism and exact resume: the batch of step ``t`` is a function of
``(config.seed, t)`` (``circle_jax.data``), the loss key is
``fold_in(key, t)``, and the checkpoint holds the complete state (params,
optimiser state, BN statistics, step) plus the iterator state. A run killed
at any moment and restarted with the same command therefore replays exactly
the steps of an uninterrupted run (``tests/train/test_loop.py`` checks bitwise
equality on CPU).

Non-finite guard: each step returns a ``finite`` flag; the host fetches the
pending metrics at the logging cadence and before every evaluation or
checkpoint (no sync per step), and stops with :class:`NonFiniteError` naming
the first bad step and its loss, without saving that state.

Model selection: with ``dataset.validation_fraction > 0`` a class-disjoint
share of the *train* classes is held out; the periodic evaluations run on
it, ``best_metric`` selects the step there, and the test-split numbers of
that step are the run's result (``metrics.json['result']``). Without it,
the selection is on the test split and the table says so.

Workdirs: ``config.json`` records the config of the checkpoints; a rerun
with a config that trains something else is refused
(:mod:`circle_jax.train.workdir`). Ctrl-C saves the last completed step
before stopping (:class:`TrainingInterrupted`).

Structure: :func:`train_and_evaluate` is four parts sharing a :class:`Job`:
``_build`` (config check, data, model, state, resume), ``_evaluate_init``,
``_train`` (the steps, logging, periodic evaluation and checkpoints, Ctrl-C)
and ``_finish`` (final and best metrics, ``metrics.json``). Devices are
:mod:`circle_jax.parallel`'s business, building and restoring
:mod:`circle_jax.train.run`'s, evaluating :mod:`circle_jax.train.evaluate`'s.

Multi-host: every process runs this function; process ``p`` reads its share
of every global batch, checkpoints are written collectively by orbax, and
only process 0 writes ``metrics.json``, ``config.json`` and the TensorBoard
events.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Dict, List, Optional

from absl import logging
import jax
import ml_collections
import numpy as np

from circle_jax import config_facts
from circle_jax import data as data_lib
from circle_jax import parallel
from circle_jax.errors import UserError
from circle_jax.train import checkpoint as ckpt_lib
from circle_jax.train import class_rows as class_rows_lib
from circle_jax.train import config_checks
from circle_jax.train import console as console_lib
from circle_jax.train import evaluate as evaluate_lib
from circle_jax.train import lock as lock_lib
from circle_jax.train import optim as optim_lib
from circle_jax.train import preemption as preemption_lib
from circle_jax.train import run as run_lib
from circle_jax.train import restore as restore_lib
from circle_jax.train import state as state_lib
from circle_jax.train import step as step_lib
from circle_jax.train import workdir as workdir_lib
from circle_jax.train import writers as writers_lib

class WorkdirWriteError(UserError):
  """A file of the run could not be written (full disk, read-only workdir)."""


class NonFiniteError(UserError, FloatingPointError):
  """The loss or a gradient became NaN/inf; the message names the step."""


class TrainingInterrupted(KeyboardInterrupt):
  """Ctrl-C: the last completed step was saved (if it could be).

  Attributes:
    saved_step: the newest checkpoint step (None if there is none).
    directory: the checkpoint folder.
  """

  def __init__(self, saved_step: Optional[int], directory: str):
    super().__init__(saved_step, directory)
    self.saved_step = saved_step
    self.directory = directory


class TrainingPreempted(TrainingInterrupted):
  """SIGTERM (preemption): the last completed step was saved synchronously.

  The command-line job exits with :data:`exit_status` (75, EX_TEMPFAIL) so a
  scheduler can requeue the same command.
  """

  exit_status = preemption_lib.EXIT_PREEMPTED

  def __init__(self, saved_step: Optional[int], directory: str,
               signal_name: str = "SIGTERM"):
    super().__init__(saved_step, directory)
    self.signal_name = signal_name


# ----------------------------------------------------------------------------
# The job: build, evaluate at init, train, finish.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
  """What the parts of :func:`train_and_evaluate` share."""

  config: ml_collections.ConfigDict
  workdir: str
  reporter: Any
  placement: parallel.Placement
  ckpts: ckpt_lib.Checkpoints
  config_dict: Dict[str, Any]
  info: Any = None
  val_source: Any = None
  entry: Any = None
  state: Any = None              # on the devices
  template: Any = None           # host tree of the initial state
  rows: Any = None               # the sharded class matrix, or None
  start: int = 0
  done: int = 0
  meta: Dict[str, Any] = dataclasses.field(default_factory=dict)
  train_iter: Any = None
  train_step: Any = None
  evaluator: Any = None
  writer: Any = None
  init_metrics: Optional[dict] = None
  init_val: Optional[dict] = None
  last_eval: tuple = (None, None)
  eval_changed: bool = False     # resumed with other evaluation settings
  pending: List[tuple] = dataclasses.field(default_factory=list)
  train_seconds: float = 0.0
  t0: float = 0.0

  @property
  def select_on(self) -> str:
    return "validation" if self.val_source is not None else "test"

  def host_tree(self):
    return class_rows_lib.unpad(self.rows, self.placement.to_host(
        state_lib.state_to_tree(self.state),
        sharded=class_rows_lib.sharded_leaves(self.rows)))

  def close(self):
    self.writer.close()
    self.train_iter.close()
    self.ckpts.close()

def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       reporter: Optional[console_lib.LogReporter] = None,
                       force_resume: bool = False) -> Dict[str, Any]:
  """Trains, evaluates and checkpoints; resumes from ``workdir`` if possible.

  Model selection: with ``dataset.validation_fraction > 0`` the periodic
  evaluations run on the held-out train classes, ``best_metric`` picks the
  step there, and the test metrics of that step are the result. Without a
  validation split, ``best_metric`` selects on the test split (the table
  says so: it is optimistic) and the periodic evaluations are on the test
  split.

  Args:
    config: a :func:`circle_jax.config.base_config` config.
    workdir: output folder: ``checkpoints/``, ``tensorboard/``,
      ``metrics.json``, ``config.json`` (see :mod:`circle_jax.train.workdir`).
    reporter: progress and result output (default: the absl log; the CLI
      passes a :class:`console_lib.ConsoleReporter`).
    force_resume: resume a workdir even if its saved config differs in
      fields that change the training.

  Returns:
    The content of ``metrics.json``:

    * ``init``: test metrics at step 0 (None with ``eval_at_init=False``),
    * ``final``: test metrics at the last step,
    * ``best``: None, or ``{'step', 'metric', 'mode', 'selected_on':
      'validation' | 'test', 'test': test metrics of that step,
      'validation': its validation metrics (validation only)}``,
    * ``result``: what to report: ``{'step', 'selection': 'validation' |
      'test' | 'last', 'metric', 'test'}``,
    * ``validation``: None or ``{'fraction', 'seed', 'classes',
      'num_classes', 'num_images', 'init'}``,
    * ``step``, ``train_seconds``, ``config``, ``config_changes``.

  Raises:
    config_checks.ConfigError: a bad config value (before any work).
    workdir_lib.WorkdirConfigError: ``workdir`` holds a run with another
      config.
    CheckpointError: the checkpoint does not fit the model.
    NonFiniteError: the loss or a gradient became non-finite.
    TrainingInterrupted: Ctrl-C (after saving the last completed step);
      :class:`TrainingPreempted` for SIGTERM.
    lock_lib.WorkdirLockedError: another live run holds ``workdir``.
    ckpt_lib.CheckpointWriteError, WorkdirWriteError: a full disk or a
      read-only workdir (earlier checkpoints stay intact).
  """

  reporter = reporter or console_lib.LogReporter()
  config_checks.check_config(config)
  workdir = os.path.abspath(os.path.expanduser(workdir))
  with lock_lib.WorkdirLock(workdir,
                            is_primary=jax.process_index() == 0) as lock:
    if lock.note:
      reporter.note(lock.note)
    try:
      job = _build(config, workdir, reporter, force_resume)
      _evaluate_init(job)
      _train(job)
      result = _finish(job)
    except OSError as e:
      raise _write_error(e, workdir) or e
    reporter.result(evaluate_lib.result_table(result))
    job.close()
  return result


def _write_error(e: OSError, workdir: str) -> Optional[WorkdirWriteError]:
  """A full disk or read-only workdir as one line; None for other errors."""
  if ckpt_lib.errno_of(e) not in ckpt_lib.WRITE_ERRNOS:
    return None
  path = e.filename or workdir
  return WorkdirWriteError(
      f"Could not write {path}: {ckpt_lib.write_failure(str(path), e)}; "
      f"earlier checkpoints are intact. {ckpt_lib.WRITE_FIX}")


def _build(config, workdir, reporter, force_resume) -> Job:
  """Builds data, model and state; resumes the workdir."""
  job = Job(config, workdir, reporter, parallel.from_config(config),
            restore_lib.open_checkpoints(config, workdir),
            workdir_lib.config_to_dict(config))
  resume_step = job.ckpts.latest_step()
  changes = []
  if resume_step is not None:
    changes = workdir_lib.check_resume(workdir, job.config_dict,
                                       resume_step=resume_step,
                                       force=force_resume)
  job.info = data_lib.get_dataset_info(config.dataset.name)
  train_source, job.val_source = run_lib.load_sources(config, job.info,
                                                      reporter)
  train_pre = config_facts.train_preprocess(config, job.info)
  model = run_lib.build_model(config, job.placement)
  state, job.entry, hyper, step_key = run_lib.init_state(
      config, model, job.info, train_pre.output_shape)
  logging.info("Model %s: %d parameters; loss %s: %d parameters.",
               config.model.name, state_lib.count_params(state.params["model"]),
               job.entry.name, state_lib.count_params(state.params["loss"]))
  job.rows = class_rows_lib.from_config(config, job.entry,
                                        hyper.get("num_classes"))
  job.template = host = parallel.SingleDevice().to_host(
      state_lib.state_to_tree(state))
  if resume_step is not None:
    template = host
    host, _, job.meta, _, notes = job.ckpts.restore_newest(
        template, check=lambda tree, step: restore_lib.check_restored(
            tree, template, step, job.ckpts.directory))
    for note in notes:
      reporter.note(note)
    reporter.note(f"Resumed from step {int(host['step'])} ({workdir}).")
    for path, old, new in changes:
      reporter.note(f"  changed on resume: {path}: {old} -> {new}")
    job.eval_changed = any(workdir_lib.is_evaluation_field(path)
                           for path, _, _ in changes)
  primary = jax.process_index() == 0
  if primary:
    workdir_lib.record(workdir, job.config_dict, step=int(host["step"]),
                       changes=changes)
  job.writer = writers_lib.create_writer(os.path.join(workdir, "tensorboard"),
                                         is_primary=primary)
  job.start = job.done = int(host["step"])
  sharded = class_rows_lib.sharded_leaves(job.rows)
  job.state = state_lib.state_from_tree(state, job.placement.replicate(
      class_rows_lib.pad(job.rows, host, job.placement.num_devices),
      sharded=sharded))
  job.train_iter = data_lib.train_iterator(
      train_source, sampler=run_lib.make_sampler(config, train_source),
      preprocess=train_pre, start_step=job.start,
      num_workers=config.dataset.num_workers,
      num_threads=config.dataset.num_threads)
  job.train_step = step_lib.make_train_step(
      step_lib.make_loss_fn(job.entry, hyper,
                            config_facts.more_losses(config),
                            config.miner.to_dict(),
                            config_facts.more_loss_miners(config),
                            run_lib.semantic_hook(config, model, job.info)),
      placement=job.placement,
      base_key=step_key, embed_chunk_size=config.batch.embed_chunk_size,
      sharded=sharded)
  job.evaluator = evaluate_lib.Evaluator(config, job.info, model,
                                         job.placement, job.val_source)
  job.init_metrics = job.meta.get("init_metrics")
  job.init_val = job.meta.get("init_validation_metrics")
  job.train_seconds = float(job.meta.get("train_seconds", 0.0))
  return job


def _evaluate_init(job: Job) -> None:
  """The untrained model's metrics (step 0 of a fresh run only)."""
  if job.start != 0 or not job.config.eval_at_init:
    return
  job.init_metrics = job.evaluator.test(job.template)
  job.writer.write_scalars(0, {f"eval/{k}": v
                               for k, v in job.init_metrics.items()})
  job.reporter.note(f"step 0 test: {evaluate_lib.summary(job.init_metrics)}")
  if job.val_source is not None:
    job.init_val = job.evaluator.validation(job.template)
    job.writer.write_scalars(0, {f"val/{k}": v
                                 for k, v in job.init_val.items()})
    job.reporter.note(
        f"step 0 validation: {evaluate_lib.summary(job.init_val)}")


def _check_pending(job: Job) -> Optional[Dict[str, float]]:
  """Fetches the pending step metrics; raises on the first non-finite one.

  Returns the mean loss and gradient norm of the fetched steps.
  """
  if not job.pending:
    return None
  fetched = jax.device_get([m for _, m in job.pending])
  steps = [s for s, _ in job.pending]
  job.pending = []
  for s, m in zip(steps, fetched):
    if not bool(m["finite"]):
      job.ckpts.wait()
      last = job.ckpts.latest_step()
      kept = (f"The last good checkpoint, step {last} in "
              f"{job.ckpts.directory}, is kept: rerunning the same command "
              "resumes from it." if last is not None else "No checkpoint was "
              "saved before it (checkpoint_every_steps="
              f"{job.config.checkpoint_every_steps}), so there is nothing to "
              "resume.")
      raise NonFiniteError(
          f"Non-finite loss or gradient at step {s} (loss = "
          f"{float(m['loss'])}); training stopped without saving that "
          f"state. Lower optim.learning_rate or set optim.grad_clip_norm "
          f"(and check the data). {kept}")
  return {k: float(np.mean([float(m[k]) for m in fetched]))
          for k in ("loss", "grad_norm")}


def _save_latest(job: Job, host_tree) -> None:
  # The init metrics and the train time travel with the checkpoint.
  job.ckpts.save_latest(job.done, host_tree, job.train_iter.get_state(), meta={
      "init_metrics": job.init_metrics,
      "init_validation_metrics": job.init_val,
      "train_seconds": job.train_seconds + time.time() - job.t0})


def _train(job: Job) -> None:
  """The steps from ``job.start`` to ``num_train_steps``; Ctrl-C saves."""
  config = job.config
  num_steps = config.num_train_steps
  job.reporter.start(total=num_steps, initial=job.start,
                     description=f"{job.info.name}/{job.entry.name}")
  log = functools.partial(
      _log, job, lrs=optim_lib.learning_rates(config.optim, num_steps),
      global_batch=config_facts.global_batch_size(config))
  job.t0 = window = time.time()
  steps_window = 0
  with preemption_lib.PreemptionWatch() as watch:
    try:
      for step in range(job.start, num_steps):
        batch = next(job.train_iter)
        batch = {"image": batch["image"], "label": batch["label"]}
        job.state, metrics = job.train_step(job.state,
                                            job.placement.shard_batch(batch))
        job.done = done = step + 1
        job.pending.append((done, job.placement.first_replica(metrics)))
        job.reporter.advance(done)
        steps_window += 1
        do_eval = _due(done, config.eval_every_steps, num_steps)
        do_ckpt = _due(done, config.checkpoint_every_steps, num_steps)
        if done % (config.log_every_steps or 50) == 0 or do_eval or do_ckpt:
          window = log(step, steps_window, window)
          steps_window = 0
        if do_eval or do_ckpt:
          _evaluate_and_save(job, do_eval, do_ckpt)
        job.writer.flush()
        if watch.should_stop(done):
          _interrupted(job, preempted_by=watch.preempted_by)
    except TrainingInterrupted:
      raise
    except KeyboardInterrupt:
      _interrupted(job)
    finally:
      job.reporter.finish()
  job.ckpts.wait()
  job.train_seconds += time.time() - job.t0


def _due(done: int, every: int, num_steps: int) -> bool:
  return bool(every and done % every == 0) or done == num_steps


def _log(job: Job, step: int, steps: int, since: float, *, lrs,
         global_batch: int) -> float:
  """Writes the train scalars of the steps since the last log; returns now."""
  means = _check_pending(job)
  now = time.time()
  rate = steps / max(now - since, 1e-9)
  scalars = {"train/loss": means["loss"],
             "train/grad_norm": means["grad_norm"],
             "train/steps_per_sec": rate,
             "train/images_per_sec": rate * global_batch}
  scalars.update({f"train/lr_{g}": v for g, v in lrs(step).items()})
  job.writer.write_scalars(job.done, scalars)
  job.reporter.stats(job.done, job.config.num_train_steps, loss=means["loss"],
                     steps_per_sec=rate, images_per_sec=rate * global_batch)
  return now


def _evaluate_and_save(job: Job, do_eval: bool, do_ckpt: bool) -> None:
  host_tree = job.host_tree()
  if do_eval:
    evaluate = (job.evaluator.validation if job.val_source is not None
                else job.evaluator.test)
    metrics = evaluate(host_tree)
    job.last_eval = (job.done, metrics)
    tag = "val" if job.val_source is not None else "eval"
    job.writer.write_scalars(job.done, {f"{tag}/{k}": v
                                        for k, v in metrics.items()})
    job.reporter.note(f"step {job.done} {job.select_on}: "
                      f"{evaluate_lib.summary(metrics)}")
    job.ckpts.save_best(job.done, host_tree, job.train_iter.get_state(),
                        metrics)
  if do_ckpt:
    _save_latest(job, host_tree)


def _interrupted(job: Job, preempted_by: Optional[str] = None):
  """Ctrl-C or SIGTERM: saves the last completed step and waits for the write.

  Raises:
    TrainingInterrupted: Ctrl-C; TrainingPreempted: ``preempted_by``.
  """
  saved = job.ckpts.latest_step()
  try:
    if job.done > (saved or 0) and job.done > job.start:
      _check_pending(job)
      _save_latest(job, job.host_tree())
    job.ckpts.wait()
    saved = job.ckpts.latest_step()
  except UserError:
    raise  # a full disk, a non-finite step: their own one-line errors
  except Exception:  # pylint: disable=broad-except
    # E.g. a second Ctrl-C inside a step whose input buffers were donated.
    logging.exception("Could not save the interrupted step.")
  job.reporter.finish()
  job.close()
  if preempted_by:
    raise TrainingPreempted(saved, job.ckpts.directory, preempted_by)
  raise TrainingInterrupted(saved, job.ckpts.directory) from None


def _read_best(job: Job, *, final_step: int):
  """``(summary, tree, note)`` of the best checkpoint.

  ``summary`` is None without a best checkpoint. ``tree`` is None where the
  test metrics need no restore (selected on the test split, or the best
  step is the last). An unreadable best checkpoint (truncated, overwritten,
  missing an item) is moved aside and ``note`` says so: the result falls
  back to the last step instead of failing the finished run.
  """
  try:
    saved = job.ckpts.best_metrics()
    if saved is None or (job.select_on == "test" and not job.eval_changed
                         ) or saved["step"] == final_step:
      return saved, None, ""
    tree, _, _ = job.ckpts.restore(job.template, which="best")
    return saved, tree, ""
  except Exception as e:  # pylint: disable=broad-except
    note = job.ckpts.move_best_aside(ckpt_lib.error_line(e))
    job.reporter.note(note)
    return None, None, note


def _finish(job: Job) -> Dict[str, Any]:
  """The final and best test metrics; writes ``metrics.json``."""
  config, num_steps = job.config, job.config.num_train_steps
  final_step, final = job.last_eval
  if job.val_source is not None or final_step != num_steps:
    final = job.evaluator.test(job.host_tree())
  last_state_test = job.evaluator.last_test  # the figure's (final state)
  best = None
  result_part = {"step": num_steps, "selection": "last", "metric": None,
                 "test": final}
  saved_best, best_tree, best_note = _read_best(job, final_step=num_steps)
  if saved_best is not None:
    best = {"step": saved_best["step"], "metric": config.best_metric,
            "mode": config.best_mode, "selected_on": job.select_on}
    # The saved metrics are the selected step's test (or validation)
    # metrics; resumed with other evaluation settings, they are evaluated
    # anew (best_tree is None when the selected step is the last).
    if job.select_on == "test" and not job.eval_changed:
      best["test"] = saved_best["metrics"]
    else:
      best["test"] = (final if best_tree is None
                      else job.evaluator.test(best_tree))
    if job.select_on == "validation" and not job.eval_changed:
      best["validation"] = saved_best["metrics"]
    elif job.select_on == "validation":
      best["validation"] = job.evaluator.validation(
          job.host_tree() if best_tree is None else best_tree)
    result_part = {"step": best["step"], "selection": job.select_on,
                   "metric": config.best_metric, "test": best["test"]}
  elif best_note:  # unreadable: the last step's result
    result_part["note"] = best_note
  validation = None
  if job.val_source is not None:
    validation = {
        "fraction": config.dataset.validation_fraction,
        "seed": config.dataset.validation_seed,
        "by": config.dataset.validation_by,
        "classes": [int(c) for c in job.val_source.classes],
        "num_classes": len(job.val_source.classes),
        "num_images": len(job.val_source),
        "init": job.init_val,
    }
  result = {
      "init": job.init_metrics, "final": final, "best": best,
      "result": result_part, "validation": validation, "step": num_steps,
      "train_seconds": job.train_seconds, "config": job.config_dict,
      "config_changes": workdir_lib.load_changes(job.workdir),
  }
  if jax.process_index() == 0:
    with open(os.path.join(job.workdir, "metrics.json"), "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)
    _draw_retrievals(job, last_state_test)
  return result


def _draw_retrievals(job: Job, embedded) -> None:
  """``retrievals.png``: the final state's test retrievals (a figure: a
  failure to draw it is a note, never a failed run)."""
  try:
    if not embedded:
      if jax.process_count() > 1:  # embedding is collective: not on one host
        return
      job.evaluator.test(job.host_tree())
      embedded = job.evaluator.last_test
    job.evaluator.draw_retrievals(
        os.path.join(job.workdir, "retrievals.png"), embedded=embedded,
        seed=job.config.seed)
  except Exception as e:  # pylint: disable=broad-except
    job.reporter.note(f"retrievals.png not drawn: {e}")
