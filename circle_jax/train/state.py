"""The training state: model parameters, loss parameters, BN statistics, optimiser.

Parameters live in one tree ``{'model': ..., 'loss': ...}`` so that a single
optax transformation (with parameter groups, see :mod:`circle_jax.train.optim`)
updates the network and the loss parameters (proxies, class weights) together.
``'loss'`` is an empty dict for losses without parameters.

With a cross-batch memory (``config.xbm.size > 0``) the state also holds the
memory (:class:`circle_jax.train.xbm.Memory`); it is saved with the state
under ``'xbm'``, which a state without memory does not have, so checkpoints
of runs without it are unchanged. A loss that carries arrays from step to
step without gradient (VPTSP-G's semantic-proxy memory,
:mod:`circle_jax.train.semantic`) keeps them in ``loss_state``, saved under
``'loss_state'`` likewise only when present.
"""

from __future__ import annotations

from typing import Any, Optional

import flax
import jax
from flax.training import train_state

from circle_jax.train import xbm as xbm_lib

PyTree = Any


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` plus BatchNorm statistics.

  Attributes:
    step: int32 scalar, the number of optimiser updates applied.
    apply_fn: the model's ``apply`` (static, not saved).
    params: ``{'model': model params, 'loss': loss params or {}}``.
    tx: the optax transformation (static, not saved).
    opt_state: its state.
    batch_stats: the model's ``batch_stats`` collection (``{}`` without BN).
    xbm: the cross-batch memory, or None (off).
    loss_state: arrays the step's loss hook carries (replicated), or None.
  """

  batch_stats: PyTree = flax.struct.field(default_factory=dict)
  xbm: Optional[xbm_lib.Memory] = None
  loss_state: Optional[PyTree] = None


def model_variables(state) -> dict:
  """The ``{'params', 'batch_stats'}`` variables to call ``model.apply`` with.

  Args:
    state: a :class:`TrainState`, or its tree (:func:`state_to_tree`; a
      restored checkpoint).
  """
  if isinstance(state, TrainState):
    state = state_to_tree(state)
  variables = {"params": state["params"]["model"]}
  if state["batch_stats"]:
    variables["batch_stats"] = state["batch_stats"]
  return variables


def state_to_tree(state: TrainState) -> dict:
  """The savable part of the state (no functions), as a plain dict.

  ``'xbm'`` (the memory's arrays) only when the state has a memory.
  """
  tree = {
      "step": state.step,
      "params": state.params,
      "opt_state": state.opt_state,
      "batch_stats": state.batch_stats,
  }
  if state.xbm is not None:
    tree["xbm"] = {f: getattr(state.xbm, f) for f in xbm_lib.ARRAY_FIELDS}
  if state.loss_state is not None:
    tree["loss_state"] = state.loss_state
  return tree


def state_from_tree(template: TrainState, tree: dict) -> TrainState:
  """Puts a tree from :func:`state_to_tree` back into ``template``'s structure."""
  def like(t, x):
    return jax.tree.unflatten(jax.tree.structure(t), jax.tree.leaves(x))

  memory = template.xbm
  if memory is not None:
    memory = memory.replace(**{f: tree["xbm"][f] for f in xbm_lib.ARRAY_FIELDS})
  return template.replace(
      step=tree["step"],
      params=like(template.params, tree["params"]),
      opt_state=like(template.opt_state, tree["opt_state"]),
      batch_stats=like(template.batch_stats, tree["batch_stats"]),
      xbm=memory,
      loss_state=None if template.loss_state is None else like(
          template.loss_state, tree["loss_state"]),
  )


def count_params(tree: PyTree) -> int:
  return int(sum(x.size for x in jax.tree.leaves(tree)))
