"""The parts of a run built from its config.

Everything here is a function of the config (:mod:`circle_jax.config` and
:mod:`circle_jax.config_facts`), so the trainer (:mod:`circle_jax.train.loop`),
a restored run (:mod:`circle_jax.train.restore`), the embedding tool
(:mod:`circle_jax.embed`) and the experiment scripts build the model, the
state, the data sources, the preprocessing and the sampler the same way.
"""

from __future__ import annotations

import os

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from circle_jax import config_facts
from circle_jax import data as data_lib
from circle_jax import losses as losses_lib
from circle_jax import models as models_lib
from circle_jax import parallel
from circle_jax.train import config_checks
from circle_jax.train import optim as optim_lib
from circle_jax.train import semantic as semantic_lib
from circle_jax.train import state as state_lib
from circle_jax.train import xbm as xbm_lib


def default_data_dir() -> str:
  return os.path.expanduser(
      os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets"))


# ----------------------------------------------------------------------------
# Built from the config.
# ----------------------------------------------------------------------------


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
  num_classes = int(data_lib.split_labels(source).max()) + 1
  if num_classes != info.num_train_classes:  # a partial copy of the dataset
    where = (f" (as read from manual_dir '{config.dataset.manual_dir}')"
             if config.dataset.manual_dir else " (as prepared)")
    config_checks.check_train_classes(config, info, num_classes, where)
  validation = None
  if config.dataset.validation_fraction:
    source, validation = data_lib.split_classes(
        source, fraction=config.dataset.validation_fraction,
        seed=config.dataset.validation_seed,
        superclasses=config_facts.validation_superclasses(config, info))
  if config_facts.class_copies(config) > 1:
    source = data_lib.RotatedClasses(source, config.dataset.rotations,
                                     mirror=config.dataset.mirror_classes)
  return source, validation


def make_sampler(config, train_source):
  """The train batches' sampler: P x K classes (``pk``), ``random``, P
  images x K views (``views``), or P x K classes from S super-classes
  (``hierarchical``; the records' super-labels where the dataset has them,
  :attr:`DatasetSpec.super_labels`, else its
  :attr:`DatasetSpec.train_superclasses`,
  :func:`circle_jax.config_facts.train_label_superclasses`)."""
  if config.batch.sampler == "hierarchical":
    labels = data_lib.split_labels(train_source)
    info = data_lib.get_dataset_info(config.dataset.name)
    if info.super_labels:  # the records' own (SOP's super_class_id)
      of_record = data_lib.split_super_labels(train_source)
    else:
      supers = config_facts.train_label_superclasses(config, info)
      if labels.max() + 1 != supers.size:  # a partial copy of the dataset
        raise config_checks.ConfigError(
            f"config.batch.sampler: the train split has {labels.max() + 1} "
            f"classes, not the {supers.size} of its declared super-classes;"
            " use 'pk'.")
      of_record = supers[labels]
    try:
      return data_lib.HierarchicalSampler(
          np.stack([labels, of_record], 1),
          batch_size=config_facts.global_batch_size(config),
          samples_per_class=config.batch.images_per_class,
          batches_per_super_tuple=config.batch.batches_per_super_tuple,
          super_classes_per_batch=config.batch.super_classes_per_batch,
          seed=config.seed)
    except ValueError as e:
      raise config_checks.ConfigError(
          f"config.batch.sampler: 'hierarchical': {e}") from None
  if config.batch.sampler == "views":
    return data_lib.ViewSampler(
        len(train_source), images_per_batch=config.batch.classes_per_batch,
        views=config.batch.images_per_class, seed=config.seed)
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
    placement: a :class:`circle_jax.parallel.Placement` (default: the
      config's, :func:`circle_jax.parallel.from_config`); with
      ``model.sync_bn`` BatchNorm averages its statistics over the
      placement's device axis.
  """
  if placement is None:
    placement = parallel.from_config(config)
  kwargs = dict(config.model.kwargs)
  if config.model.sync_bn and placement.axis_name is not None:
    kwargs["bn_axis_name"] = placement.axis_name
  dtype = jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32
  return models_lib.get_model(
      config.model.name, embedding_dim=config.model.embedding_dim,
      pooling=config.model.pooling, freeze_bn=config.model.freeze_bn,
      dtype=dtype, normalize=config_facts.head_normalizes(config), **kwargs)


def _load_pretrained(config, variables, in_channels: int):
  """The variables with the backbone's pretrained weights, their first
  convolution adapted to images of ``in_channels`` channels (grayscale
  datasets take RGB weights as timm does)."""
  path = config.model.pretrained  # "": from scratch.
  if not path:
    return variables
  name = config.model.name
  if name.startswith("resnet"):
    backbone = models_lib.load_keras_resnet(path, depth=int(name[6:]),
                                            in_channels=in_channels)
  elif name == "bn_inception":
    backbone = models_lib.load_bn_inception(path, in_channels=in_channels)
  elif name.startswith("vit_"):  # timm ViT weights (.safetensors/.pth/.npz).
    backbone = models_lib.load_timm_vit(path, build_model(config).backbone,
                                        in_channels=in_channels)
  else:
    raise config_checks.ConfigError(
        f"config.model.pretrained: no pretrained weights for {name!r}.")
  logging.info("Loaded pretrained %s backbone from %s", name, path)
  return models_lib.replace_backbone(variables, backbone)


def init_state(config, model, info, sample_shape):
  """``(state, loss entry, loss hyperparameters, step key)`` at step 0.

  The state is host-independent (the same on all processes). With
  ``loss.shard_classes`` the state holds the whole class matrix, as one
  device's run (:mod:`circle_jax.train.class_rows` shards it when it is
  placed), and the hyperparameters add its ``num_classes``.
  """
  entry = losses_lib.get_loss(config.loss.name)
  hyper = config_facts.loss_hyper(config)
  key = jax.random.PRNGKey(config.seed)
  k_model, k_loss, k_step = jax.random.split(key, 3)
  variables = model.init(k_model, jnp.zeros((1,) + tuple(sample_shape)),
                         train=False)
  variables = _load_pretrained(config, dict(variables),
                               in_channels=int(sample_shape[-1]))
  loss_params = {}
  if entry.param_name is not None:
    n = config_facts.num_classes(config, info)
    loss_params = {entry.param_name: entry.init_params(
        k_loss, n, config.model.embedding_dim, **hyper)}
    if hyper.get("shard_classes"):  # the whole matrix, sharded when placed
      hyper["num_classes"] = n
  more = {key: {e.param_name: e.init_params(
      jax.random.fold_in(k_loss, i + 1),
      config_facts.num_classes(config, info), config.model.embedding_dim,
      **h)} for i, (key, e, _, h) in enumerate(
          config_facts.more_losses(config)) if e.param_name is not None}
  if more:  # the class matrices of config.more_losses, by key
    loss_params = {**loss_params, losses_lib.combine.MORE_LOSSES: more}
  loss_state = None
  hook = semantic_hook(config, model, info)
  if hook is not None:  # VPTSP-G's semantic branch and its memory
    loss_params[semantic_lib.PARAMS], loss_state = hook.init(
        jax.random.fold_in(k_loss, 2 ** 20))
  frozen = models_lib.frozen_module_paths(variables, config.model.kwargs)
  if config.model.freeze_bn and "batch_stats" in variables:
    frozen |= models_lib.frozen_bn_paths(variables)
  tx = optim_lib.optimizer_from_config(
      config.optim, num_train_steps=config.num_train_steps,
      frozen_paths=frozen)
  state = state_lib.TrainState.create(
      apply_fn=model.apply,
      params={"model": variables["params"], "loss": loss_params},
      tx=tx, batch_stats=variables.get("batch_stats", {}),
      xbm=xbm_lib.from_config(config), loss_state=loss_state)
  return state, entry, hyper, k_step


def semantic_hook(config, model, info):
  """The step's hook of a loss that takes semantic proxies
  (:mod:`circle_jax.train.semantic`), or None."""
  return semantic_lib.from_config(config, model,
                                  config_facts.num_classes(config, info))
