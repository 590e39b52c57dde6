"""Restoring a workdir: its config, its checkpoints, its model for inference.

  run = restore_run(workdir)             # best checkpoint if any, else latest
  embeddings, labels = run.embed_split() # the test split, as the run evaluated

The trainer (:mod:`circle_jax.train.loop`) opens and restores its own
checkpoints here too (:func:`open_checkpoints`, :func:`restore_checkpoint`),
so a checkpoint that does not fit the config's model fails the same way
everywhere (:class:`CheckpointError`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from circle_jax import config_facts
from circle_jax import config as config_lib
from circle_jax import data as data_lib
from circle_jax import parallel
from circle_jax.errors import UserError
from circle_jax.evaluation import embedding as embedding_lib
from circle_jax.train import checkpoint as ckpt_lib
from circle_jax.train import run as run_lib
from circle_jax.train import state as state_lib
from circle_jax.train import workdir as workdir_lib


class CheckpointError(UserError):
  """A checkpoint cannot be restored into the model of the config."""


class RunError(UserError):
  """A workdir holds no run, or no checkpoint of the kind asked for."""



def open_checkpoints(config, workdir: str) -> ckpt_lib.Checkpoints:
  """The ``latest`` and ``best`` checkpoints of the run in ``workdir``."""
  return ckpt_lib.Checkpoints(
      os.path.join(workdir, "checkpoints"),
      best_metric=config.best_metric or None, best_mode=config.best_mode,
      asynchronous=config.async_checkpoints)


def check_restored(tree, template, step, directory):
  """Raises CheckpointError naming the leaves whose shape differs."""
  bad = []
  got = dict(jax.tree_util.tree_leaves_with_path(tree))
  for path, want in jax.tree_util.tree_leaves_with_path(template):
    have = got.get(path)
    if have is None:
      bad.append(f"{jax.tree_util.keystr(path)} missing")
    elif np.shape(have) != np.shape(want):
      bad.append(f"{jax.tree_util.keystr(path)} saved {np.shape(have)}, "
                 f"config builds {np.shape(want)}")
  bad.sort(key=lambda b: not b.startswith("['params']"))
  if bad or len(got) != len(jax.tree.leaves(template)):
    raise CheckpointError(
        f"Checkpoint step {step} in {directory} does not fit this config's "
        f"model/loss ({'; '.join(bad[:3]) or 'different parameters'}); it "
        "was written by another configuration: start fresh with another "
        "--workdir.")


def restore_checkpoint(ckpts: ckpt_lib.Checkpoints, template=None, *,
                       which: str = "latest", step: Optional[int] = None):
  """``(state tree, data state, meta)`` of a checkpoint, checked.

  Args:
    ckpts: the run's checkpoints.
    template: a host tree of the state's structure and shapes (None: the
      saved tree as is).
    which: ``latest`` or ``best``.
    step: the step (default: the newest / the best).

  Raises:
    CheckpointError: it does not fit ``template``.
  """
  try:
    tree, data_state, meta = ckpts.restore(template, which=which, step=step)
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(
        f"Checkpoint step {step if step is not None else which} in "
        f"{ckpts.directory} cannot be restored with this config "
        f"({str(e).splitlines()[0][:200]}); start fresh with another "
        "--workdir.") from e
  if template is not None:
    check_restored(tree, template, meta.get("step", step), ckpts.directory)
  return tree, data_state, meta


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a workdir's run was trained with (its ``config.json``)."""
  path = os.path.join(workdir, workdir_lib.CONFIG_FILE)
  if not os.path.exists(path):
    raise RunError(f"{path} not found: --workdir must be the folder of a "
                   "training run.")
  return config_lib.from_dict(workdir_lib.load_config(workdir), source=path)


@dataclasses.dataclass
class Run:
  """A workdir's run restored for inference (:func:`restore_run`).

  Attributes:
    workdir: the run's folder (absolute).
    config: its config.
    info: the dataset's spec.
    model: the Flax model.
    placement: where :meth:`embed_split` runs.
    variables: host ``{'params', 'batch_stats'?}`` of the checkpoint.
    which: ``best`` or ``latest``.
    step: the checkpoint's step.
    meta: the checkpoint's JSON metadata (its metrics for ``best``).
  """

  workdir: str
  config: ml_collections.ConfigDict
  info: Any
  model: Any
  placement: parallel.Placement
  variables: Dict[str, Any]
  which: str
  step: int
  meta: Dict[str, Any]

  def embed_split(self, split: Optional[str] = None, *, source=None,
                  apply_fn=None) -> Tuple[np.ndarray, np.ndarray]:
    """``(embeddings [N, D], labels [N])`` of ``split`` (default: the
    dataset's first evaluation split) or of ``source``, by the evaluation's
    ``eval_apply`` or by ``apply_fn(variables, images)`` (any trailing
    shape)."""
    if source is None:
      source = run_lib.load_split(self.config, self.info,
                                  split or self.info.eval_splits[0])
    return embedding_lib.embed_split(
        self.variables,
        apply_fn or embedding_lib.eval_apply(self.config, self.model),
        source, config_facts.eval_preprocess(self.config, self.info),
        placement=self.placement,
        batch_size=self.config.batch.eval_batch_size,
        num_threads=self.config.dataset.num_threads)


def restore_run(workdir: str, which: Optional[str] = None, *,
                step: Optional[int] = None,
                placement: Optional[parallel.Placement] = None) -> Run:
  """Restores a workdir's model for inference.

  Args:
    workdir: a folder written by the trainer.
    which: ``best`` or ``latest`` (default: best if the run kept one).
    step: a step of ``which`` (default: the best / the newest).
    placement: where to embed (default: the placement of the run's
      config, :func:`circle_jax.parallel.from_config`).

  Returns:
    A :class:`Run`. Its variables are checked against the model the config
    builds (shapes only, without running the initialiser).

  Raises:
    RunError: no ``config.json`` or no such checkpoint.
    CheckpointError: the checkpoint does not fit the config's model.
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  config = load_config(workdir)
  if placement is None:
    placement = parallel.from_config(config)
  info = data_lib.get_dataset_info(config.dataset.name)
  model = run_lib.build_model(config, placement)
  ckpts = open_checkpoints(config, workdir)
  try:
    if which is None:
      which = "best" if ckpts.best_step() is not None else "latest"
    saved = ckpts.best_step() if which == "best" else ckpts.latest_step()
    if saved is None:
      raise RunError(f"{workdir} has no {which} checkpoint yet; train it "
                     "first.")
    tree, _, meta = restore_checkpoint(ckpts, which=which, step=step)
  finally:
    ckpts.close()
  variables = state_lib.model_variables(tree)
  shape = (1,) + tuple(config_facts.eval_preprocess(config, info).output_shape)
  template = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(shape), train=False))
  check_restored(variables, dict(template), meta.get("step"),
                 ckpts.directory)
  return Run(workdir, config, info, model, placement, variables, which,
             int(meta.get("step", step if step is not None else saved)), meta)
