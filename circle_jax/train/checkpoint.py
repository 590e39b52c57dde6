"""Orbax checkpoints: the latest ones for resuming, the best one for inference.

Layout under ``DIR/checkpoints``::

  latest/<step>/{state, data, meta}   every ``checkpoint_every_steps`` and at the end
  best/<step>/{state, data, meta}     the best evaluation by ``config.best_metric``

``state`` is the host copy of the :class:`TrainState` tree (step, params,
opt_state, batch_stats) as numpy arrays, so a checkpoint does not depend on the
parallelism mode or the device count it was written with. ``data`` is the
train iterator's state (JSON), ``meta`` the step and, for ``best``, the
metrics.

Atomicity: orbax writes a step into a temporary directory and renames it when
complete (the commit point); ``latest_step()`` only lists finalised steps and
leftover temporary directories are removed at start-up, so a checkpoint
interrupted by SIGKILL is never restored. Saves are asynchronous; all
processes call every method (orbax synchronises them and process 0 writes
the replicated arrays).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any
ITEMS = ("state", "data", "meta")


def _to_json(x):
  """Makes metrics / iterator states JSON-serialisable."""
  if isinstance(x, dict):
    return {str(k): _to_json(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_to_json(v) for v in x]
  if isinstance(x, (np.generic, np.ndarray)) or hasattr(x, "item"):
    x = np.asarray(x)
    return x.item() if x.ndim == 0 else x.tolist()
  return x


class Checkpoints:
  """The ``latest`` and ``best`` checkpoint managers of a run.

  Args:
    directory: ``DIR/checkpoints``.
    best_metric: the metric name that ranks evaluations (e.g. ``recall@1``);
      None disables the ``best`` checkpoint.
    best_mode: ``max`` or ``min``.
    max_to_keep: latest checkpoints to keep.
    asynchronous: save in a background thread.
  """

  def __init__(self, directory, *, best_metric: Optional[str] = None,
               best_mode: str = "max", max_to_keep: int = 2,
               asynchronous: bool = True):
    if best_mode not in ("max", "min"):
      raise ValueError(f"`best_mode` must be 'max' or 'min'; got {best_mode!r}.")
    directory = os.path.abspath(os.fspath(directory))
    self.directory = directory
    self.best_metric = best_metric
    common = dict(
        create=True, cleanup_tmp_directories=True,
        enable_async_checkpointing=asynchronous)
    self.latest = ocp.CheckpointManager(
        os.path.join(directory, "latest"),
        item_names=ITEMS,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, **common))
    self.best = None
    if best_metric:
      self.best = ocp.CheckpointManager(
          os.path.join(directory, "best"),
          item_names=ITEMS,
          options=ocp.CheckpointManagerOptions(
              max_to_keep=1, best_fn=lambda m: float(m[best_metric]),
              best_mode=best_mode, **common))

  # -- saving ---------------------------------------------------------------

  @staticmethod
  def _args(state_tree, data_state, meta):
    return ocp.args.Composite(
        state=ocp.args.StandardSave(state_tree),
        data=ocp.args.JsonSave(_to_json(data_state or {})),
        meta=ocp.args.JsonSave(_to_json(meta)))

  def save_latest(self, step: int, state_tree: PyTree, data_state=None,
                  meta: Optional[dict] = None) -> bool:
    """Saves (asynchronously) unless ``step`` is already saved.

    Args:
      step: the step (number of updates applied).
      state_tree: host copy of the state (``state_to_tree`` then ``to_host``).
      data_state: the train iterator's ``get_state()``.
      meta: extra JSON-serialisable items kept in ``meta`` with the step.
    """
    step = int(step)
    if step in self.latest.all_steps():
      return False
    return self.latest.save(
        step, args=self._args(state_tree, data_state,
                              dict(meta or {}, step=step)),
        force=True)

  def save_best(self, step: int, state_tree: PyTree, data_state,
                metrics: dict) -> bool:
    """Offers an evaluated state; orbax keeps it if it is the best so far.

    Waits for the write to finish, so that a later ``latest`` checkpoint never
    exists without the ``best`` of the evaluations before it.
    """
    if self.best is None:
      return False
    step = int(step)
    if step in self.best.all_steps():
      return False
    metrics = _to_json(metrics)
    saved = self.best.save(
        step, args=self._args(state_tree, data_state,
                              {"step": step, "metrics": metrics}),
        metrics={k: v for k, v in metrics.items()
                 if isinstance(v, (int, float))}, force=True)
    self.best.wait_until_finished()
    return saved

  # -- restoring ------------------------------------------------------------

  def latest_step(self) -> Optional[int]:
    return self.latest.latest_step()

  def best_step(self) -> Optional[int]:
    return None if self.best is None else self.best.best_step()

  def best_metrics(self) -> Optional[dict]:
    """``{'step': s, 'metrics': {...}}`` of the best checkpoint, or None."""
    step = self.best_step()
    if step is None:
      return None
    meta = self.best.restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(meta["meta"])

  def restore(self, template: Optional[PyTree] = None, *,
              step: Optional[int] = None,
              which: str = "latest"):
    """Restores ``(state_tree, data_state, meta)``.

    Args:
      template: a host (numpy) tree with the structure, shapes and dtypes of
        the saved state (e.g. of a freshly initialised state); None returns
        the saved tree as nested dicts/lists.
      step: the step to restore (default: the latest, or the best).
      which: ``latest`` or ``best``.

    Returns:
      The state tree (numpy arrays) and the JSON items.
    """
    manager = self.latest if which == "latest" else self.best
    if manager is None:
      raise ValueError("This run has no `best` checkpoints (no best_metric).")
    if step is None:
      step = manager.latest_step() if which == "latest" else manager.best_step()
    if step is None:
      raise FileNotFoundError(f"No {which} checkpoint in {self.directory}.")
    abstract = None
    if template is not None:
      abstract = jax.tree.map(
          lambda x: np.zeros(np.shape(x), np.asarray(x).dtype), template)
    out = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore()))
    tree = jax.tree.map(np.asarray, out["state"])
    return tree, out["data"], out["meta"]

  def wait(self):
    self.latest.wait_until_finished()
    if self.best is not None:
      self.best.wait_until_finished()

  def close(self):
    self.latest.close()
    if self.best is not None:
      self.best.close()
