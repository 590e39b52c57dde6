"""The parts of a run built from its config, and restoring a finished run.

Everything here is a function of the config (:mod:`circle_jax.config`), so
the trainer (:mod:`circle_jax.train.loop`), the embedding tool
(:mod:`circle_jax.embed`) and the experiment scripts build the model, the
data and the sampler the same way, and restore a workdir's checkpoint and
embed a split through one path:

  run = restore_run(workdir)             # best checkpoint if any, else latest
  embeddings, labels = run.embed_split() # the test split, as the run evaluated

:func:`embed_split` is the evaluation's embedding loop (padded batches,
masked, in record order) and takes any ``apply_fn``, e.g. a ``vmap`` over a
stack of models.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Dict, Optional, Tuple

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from circle_jax import config as config_lib
from circle_jax import data as data_lib
from circle_jax import losses as losses_lib
from circle_jax import models as models_lib
from circle_jax import ops
from circle_jax import parallel
from circle_jax.errors import UserError
from circle_jax.train import checkpoint as ckpt_lib
from circle_jax.train import config_checks
from circle_jax.train import optim as optim_lib
from circle_jax.train import state as state_lib
from circle_jax.train import workdir as workdir_lib
from circle_jax.train import xbm as xbm_lib


class CheckpointError(UserError):
  """A checkpoint cannot be restored into the model of the config."""


class RunError(UserError):
  """A workdir holds no run, or no checkpoint of the kind asked for."""


def default_data_dir() -> str:
  return os.path.expanduser(
      os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets"))


# ----------------------------------------------------------------------------
# Built from the config.
# ----------------------------------------------------------------------------


def eval_preprocess(config, info):
  return info.get_preprocess(train=False, **dict(config.dataset.preprocess))


def train_preprocess(config, info):
  return info.get_preprocess(train=True, **dict(config.dataset.preprocess))


def load_split(config, info, split: str):
  """The random-access source of ``split`` of the config's dataset."""
  return data_lib.load_split(
      info.name, split, data_dir=config.dataset.data_dir or default_data_dir(),
      manual_dir=config.dataset.manual_dir)


def load_sources(config, info, reporter=None):
  """``(train, validation or None)`` sources of a config's train split.

  With ``dataset.validation_fraction > 0`` the train split's classes are
  divided class-disjointly (:func:`circle_jax.data.split_classes`): the
  model trains on the kept classes (labels renumbered) and is selected on
  the held-out ones (whole superclasses with ``dataset.validation_by =
  'superclass'``). With ``dataset.rotations > 1`` (or
  ``dataset.mirror_classes``) the kept classes, and only they, are then
  multiplied by their rotations (and mirror images)
  (:class:`circle_jax.data.RotatedClasses`).
  """
  data_dir = config.dataset.data_dir or default_data_dir()
  if reporter is not None and not data_lib.is_prepared(info.name,
                                                       data_dir=data_dir):
    reporter.note(f"Preparing dataset '{info.name}' in {data_dir} (first use "
                  "only) ...")
  source = load_split(config, info, info.train_split)
  validation = None
  if config.dataset.validation_fraction:
    source, validation = data_lib.split_classes(
        source, fraction=config.dataset.validation_fraction,
        seed=config.dataset.validation_seed,
        superclasses=config_checks.validation_superclasses(config, info))
  if config_checks.class_copies(config) > 1:
    source = data_lib.RotatedClasses(source, config.dataset.rotations,
                                     mirror=config.dataset.mirror_classes)
  return source, validation


def make_sampler(config, train_source):
  """The train batches' sampler: P x K classes (``pk``) or ``random``."""
  if config.batch.sampler == "random":
    return data_lib.RandomSampler(len(train_source),
                                  batch_size=config.batch.size,
                                  seed=config.seed)
  return data_lib.PKSampler(
      data_lib.split_labels(train_source),
      classes_per_batch=config.batch.classes_per_batch,
      images_per_class=config.batch.images_per_class, seed=config.seed)


def build_model(config, placement=None):
  """The model of ``config.model``.

  Args:
    config: the run's config.
    placement: a :class:`circle_jax.parallel.Placement` or mode name
      (default: the config's); with ``model.sync_bn`` BatchNorm averages its
      statistics over the placement's device axis.
  """
  placement = parallel.get_placement(placement or config.parallelism)
  kwargs = dict(config.model.kwargs)
  if config.model.sync_bn and placement.axis_name is not None:
    kwargs["bn_axis_name"] = placement.axis_name
  dtype = jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32
  return models_lib.get_model(
      config.model.name, embedding_dim=config.model.embedding_dim,
      pooling=config.model.pooling, freeze_bn=config.model.freeze_bn,
      dtype=dtype, **kwargs)


def _load_pretrained(config, variables):
  path = config.model.pretrained  # "": from scratch.
  if not path:
    return variables
  name = config.model.name
  if name.startswith("resnet"):
    backbone = models_lib.load_keras_resnet(path, depth=int(name[6:]))
  elif name == "bn_inception":
    backbone = models_lib.load_bn_inception(path)
  elif name.startswith("vit_"):  # timm ViT weights (.safetensors/.pth/.npz).
    backbone = models_lib.load_timm_vit(path, build_model(config).backbone)
  else:
    raise config_checks.ConfigError(
        f"config.model.pretrained: no pretrained weights for {name!r}.")
  logging.info("Loaded pretrained %s backbone from %s", name, path)
  return models_lib.replace_backbone(variables, backbone)


def init_state(config, model, info, sample_shape):
  """``(state, loss entry, loss hyperparameters, step key)`` at step 0.

  The state is host-independent (the same on all processes).
  """
  entry = losses_lib.get_loss(config.loss.name)
  hyper = config_checks.loss_hyper(config)
  key = jax.random.PRNGKey(config.seed)
  k_model, k_loss, k_step = jax.random.split(key, 3)
  variables = model.init(k_model, jnp.zeros((1,) + tuple(sample_shape)),
                         train=False)
  variables = _load_pretrained(config, dict(variables))
  loss_params = {}
  if entry.param_name is not None:
    n = config_checks.num_classes(config, info)
    loss_params = {entry.param_name: entry.init_params(
        k_loss, n, config.model.embedding_dim, **hyper)}
  frozen = ()
  if config.model.freeze_bn and "batch_stats" in variables:
    frozen = models_lib.frozen_bn_paths(variables)
  tx = optim_lib.optimizer_from_config(
      config.optim, num_train_steps=config.num_train_steps,
      frozen_paths=frozen)
  state = state_lib.TrainState.create(
      apply_fn=model.apply,
      params={"model": variables["params"], "loss": loss_params},
      tx=tx, batch_stats=variables.get("batch_stats", {}),
      xbm=xbm_lib.from_config(config))
  return state, entry, hyper, k_step


# ----------------------------------------------------------------------------
# Checkpoints.
# ----------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------
# Embedding.
# ----------------------------------------------------------------------------


def shifted_views(images: jax.Array, shift: int) -> jax.Array:
  """``[5, b, H, W, C]``: the images, then shifted by ``shift`` pixels down,
  up, right and left; the uncovered border repeats the edge pixels."""
  s = int(shift)
  h, w = images.shape[1:3]
  padded = jnp.pad(images, ((0, 0), (s, s), (s, s), (0, 0)), mode="edge")
  offsets = ((0, 0), (-s, 0), (s, 0), (0, -s), (0, s))
  return jnp.stack([padded[:, s + dy:s + dy + h, s + dx:s + dx + w]
                    for dy, dx in offsets])


def model_apply(model, shift: int = 0) -> Callable:
  """``apply_fn(variables, images)``: the model in eval mode.

  With ``shift > 0`` (``config.eval_shift``), test-time augmentation: the
  mean of the L2-normalised outputs of the 5 :func:`shifted_views` of each
  image, run as one batch of ``5 b``. Its norm is at most 1; cosine
  similarities ignore it.
  """
  apply = functools.partial(model.apply, train=False)
  if not shift:
    return apply

  def apply_shifted(variables, images):
    views = shifted_views(images, shift)
    out = apply(variables, views.reshape((-1,) + images.shape[1:]))
    out = out.reshape(views.shape[:2] + out.shape[1:])
    return ops.l2_normalize(out).mean(axis=0)

  return apply_shifted


def eval_apply(config, model) -> Callable:
  """The evaluation's ``apply_fn``: :func:`model_apply` with the config's
  ``eval_shift``."""
  return model_apply(model, config.eval_shift)


def embed_split(variables, apply_fn: Callable, source, preprocess, *,
                placement: parallel.Placement, batch_size: int,
                num_threads: int) -> Tuple[np.ndarray, np.ndarray]:
  """Embeds a whole split as the evaluation does.

  Args:
    variables: host (numpy) variables of ``apply_fn``, identical on every
      process.
    apply_fn: ``apply_fn(variables, images [b, H, W, C]) -> [b, ...]`` in
      eval mode (:func:`model_apply`; any trailing shape).
    source: a random-access source (``circle_jax.data.load_split``).
    preprocess: the eval preset (:func:`eval_preprocess`).
    placement: where the forward pass runs (the run's placement).
    batch_size: global batch size (a multiple of the devices).
    num_threads: decoding threads.

  Returns:
    ``(outputs [N, ...] float32, labels [N])`` in record order, on every
    process.
  """
  embed = placement.embed_fn(apply_fn)
  variables = placement.replicate(variables)
  embs, labels, index = [], [], []
  for batch in data_lib.eval_iterator(source, preprocess=preprocess,
                                      batch_size=batch_size,
                                      num_threads=num_threads):
    out = placement.gather(embed(variables,
                                 placement.shard_batch(batch["image"])))
    rest = {k: batch[k] for k in ("label", "mask", "index")}
    if jax.process_count() > 1:
      rest = {k: multihost_utils.process_allgather(v, tiled=True)
              for k, v in rest.items()}
    mask = np.asarray(rest["mask"], bool)
    embs.append(out[mask])
    labels.append(np.asarray(rest["label"])[mask])
    index.append(np.asarray(rest["index"])[mask])
  order = np.argsort(np.concatenate(index), kind="stable")
  return np.concatenate(embs)[order], np.concatenate(labels)[order]


# ----------------------------------------------------------------------------
# A finished (or running) run.
# ----------------------------------------------------------------------------


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

  def embed_split(self, split: Optional[str] = None, *,
                  source=None) -> Tuple[np.ndarray, np.ndarray]:
    """``(embeddings [N, D], labels [N])`` of ``split`` (default: the
    dataset's first evaluation split) or of ``source``."""
    if source is None:
      source = load_split(self.config, self.info,
                          split or self.info.eval_splits[0])
    return embed_split(
        self.variables, eval_apply(self.config, self.model), source,
        eval_preprocess(self.config, self.info), placement=self.placement,
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
    placement: where to embed (default: the run's ``config.parallelism``).

  Returns:
    A :class:`Run`. Its variables are checked against the model the config
    builds (shapes only, without running the initialiser).

  Raises:
    RunError: no ``config.json`` or no such checkpoint.
    CheckpointError: the checkpoint does not fit the config's model.
  """
  workdir = os.path.abspath(os.path.expanduser(workdir))
  config = load_config(workdir)
  placement = parallel.get_placement(placement or config.parallelism)
  info = data_lib.get_dataset_info(config.dataset.name)
  model = build_model(config, placement)
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
  shape = (1,) + tuple(eval_preprocess(config, info).output_shape)
  template = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros(shape), train=False))
  check_restored(variables, dict(template), meta.get("step"),
                 ckpts.directory)
  return Run(workdir, config, info, model, placement, variables, which,
             int(meta.get("step", step if step is not None else saved)), meta)
