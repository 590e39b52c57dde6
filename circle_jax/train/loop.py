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

Multi-host: every process runs this function; process ``p`` reads its share
of every global batch, checkpoints are written collectively by orbax, and
only process 0 writes ``metrics.json``, ``config.json`` and the TensorBoard
events.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, Optional

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from circle_jax import data as data_lib
from circle_jax import evaluation as eval_lib
from circle_jax import losses as losses_lib
from circle_jax import models as models_lib
from circle_jax.errors import UserError
from circle_jax.train import checkpoint as ckpt_lib
from circle_jax.train import config_checks
from circle_jax.train import console as console_lib
from circle_jax.train import optim as optim_lib
from circle_jax.train import state as state_lib
from circle_jax.train import step as step_lib
from circle_jax.train import workdir as workdir_lib
from circle_jax.train import writers as writers_lib


class NonFiniteError(UserError, FloatingPointError):
  """The loss or a gradient became NaN/inf; the message names the step."""


class CheckpointError(UserError):
  """A checkpoint cannot be restored into the model of the config."""


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


def default_data_dir() -> str:
  return os.path.expanduser(
      os.environ.get("TFDS_DATA_DIR", "~/tensorflow_datasets"))


# ----------------------------------------------------------------------------
# Building blocks (also used by circle_jax.embed).
# ----------------------------------------------------------------------------


def eval_preprocess(config, info):
  return info.get_preprocess(train=False,
                             **dict(config.dataset.get("preprocess", {}) or {}))


def train_preprocess(config, info):
  return info.get_preprocess(train=True,
                             **dict(config.dataset.get("preprocess", {}) or {}))


def build_model(config, mode: str = "none"):
  """The model of ``config.model``; ``sync_bn`` syncs BN over the device axis."""
  kwargs = dict(config.model.get("kwargs", {}) or {})
  if config.model.get("sync_bn", False) and mode in ("shard_map", "pmap"):
    kwargs["bn_axis_name"] = step_lib.AXIS
  dtype = jnp.bfloat16 if config.model.get("dtype") == "bfloat16" else jnp.float32
  return models_lib.get_model(
      config.model.name, embedding_dim=config.model.embedding_dim,
      pooling=config.model.get("pooling", "avg"),
      freeze_bn=config.model.get("freeze_bn", False), dtype=dtype, **kwargs)


def _load_pretrained(config, variables):
  path = config.model.get("pretrained", None)  # "" or None: from scratch.
  if not path:
    return variables
  name = config.model.name
  if name.startswith("resnet"):
    backbone = models_lib.load_keras_resnet(path, depth=int(name[6:]))
  elif name == "bn_inception":
    backbone = models_lib.load_bn_inception(path)
  else:
    raise config_checks.ConfigError(
        f"config.model.pretrained: no pretrained weights for {name!r}.")
  logging.info("Loaded pretrained %s backbone from %s", name, path)
  return models_lib.replace_backbone(variables, backbone)


def init_state(config, model, info, sample_shape):
  """The initial :class:`TrainState` (host-independent, same on all processes)."""
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
  if config.model.get("freeze_bn", False) and "batch_stats" in variables:
    frozen = models_lib.frozen_bn_paths(variables)
  tx = optim_lib.optimizer_from_config(
      config.optim, num_train_steps=config.num_train_steps,
      frozen_paths=frozen)
  state = state_lib.TrainState.create(
      apply_fn=model.apply,
      params={"model": variables["params"], "loss": loss_params},
      tx=tx, batch_stats=variables.get("batch_stats", {}))
  return state, entry, hyper, k_step


def _eval_mesh(mode):
  devices = jax.devices()[:1] if mode == "none" else jax.devices()
  return step_lib.make_mesh(devices)


def embed_source(variables, embed, source, preprocess, *, batch_size, mesh,
                 num_threads=8):
  """Embeds a whole split: ``(embeddings [N, D] float32, labels [N])``."""
  sharding = NamedSharding(mesh, P(step_lib.AXIS))
  embs, labels, index = [], [], []
  for batch in data_lib.eval_iterator(source, preprocess=preprocess,
                                      batch_size=batch_size,
                                      num_threads=num_threads):
    images = jax.make_array_from_process_local_data(sharding, batch["image"])
    out = embed(variables, images)
    if jax.process_count() > 1:
      out = multihost_utils.process_allgather(out, tiled=True)
      lab = multihost_utils.process_allgather(batch["label"], tiled=True)
      msk = multihost_utils.process_allgather(batch["mask"], tiled=True)
      idx = multihost_utils.process_allgather(batch["index"], tiled=True)
    else:
      lab, msk, idx = batch["label"], batch["mask"], batch["index"]
    msk = np.asarray(msk, bool)
    embs.append(np.asarray(out)[msk])
    labels.append(np.asarray(lab)[msk])
    index.append(np.asarray(idx)[msk])
  order = np.argsort(np.concatenate(index), kind="stable")
  return np.concatenate(embs)[order], np.concatenate(labels)[order]


def load_sources(config, info, reporter=None):
  """``(train, validation or None)`` sources of a config's train split.

  With ``dataset.validation_fraction > 0`` the train split's classes are
  divided class-disjointly (:func:`circle_jax.data.split_classes`): the
  model trains on the kept classes (labels renumbered) and is selected on
  the held-out ones.
  """
  data_dir = config.dataset.get("data_dir") or default_data_dir()
  if reporter is not None and not data_lib.is_prepared(info.name,
                                                       data_dir=data_dir):
    reporter.note(f"Preparing dataset '{info.name}' in {data_dir} (first use "
                  "only) ...")
  source = data_lib.load_split(info.name, info.train_split, data_dir=data_dir,
                               manual_dir=config.dataset.get("manual_dir"))
  fraction = config.dataset.get("validation_fraction", 0.0) or 0.0
  if not fraction:
    return source, None
  return data_lib.split_classes(
      source, fraction=fraction, seed=config.dataset.get("validation_seed", 0))


class Evaluator:
  """Embeds an evaluation split and computes the metrics of the config.

  ``evaluator.test(tree)`` evaluates the dataset's test split(s) (In-Shop:
  queries against the gallery; otherwise each image against the others),
  ``evaluator.validation(tree)`` the held-out train classes.
  """

  def __init__(self, config, info, model, mode, validation_source=None):
    self.config, self.info = config, info
    self.mesh = _eval_mesh(mode)
    self.embed = step_lib.embed_fn(model.apply, mesh=self.mesh)
    self.preprocess = eval_preprocess(config, info)
    self.sources = {
        split: data_lib.load_split(
            info.name, split, data_dir=config.dataset.get("data_dir") or
            default_data_dir(), manual_dir=config.dataset.get("manual_dir"))
        for split in info.eval_splits}
    self.validation_source = validation_source
    self.ks = tuple(config.get("eval_ks", None) or info.ks)
    self.clustering = config.get("eval_clustering", True)

  def _variables(self, host_tree):
    variables = {"params": host_tree["params"]["model"]}
    if host_tree["batch_stats"]:
      variables["batch_stats"] = host_tree["batch_stats"]
    return step_lib.replicate(variables, mode="shard_map", mesh=self.mesh)

  def _embed(self, variables, source):
    return embed_source(variables, self.embed, source, self.preprocess,
                        batch_size=self.config.batch.get("eval_batch_size",
                                                         256),
                        mesh=self.mesh)

  def _metrics(self, emb, lab, gallery=None):
    out = {}
    if gallery is None:
      out.update(eval_lib.retrieval_metrics(emb, lab, ks=self.ks))
    else:
      out.update(eval_lib.retrieval_metrics(emb, lab, *gallery, ks=self.ks))
    if self.clustering:
      out.update(eval_lib.clustering_metrics(
          emb, lab, key=jax.random.PRNGKey(self.config.seed)))
    return {k: float(v) for k, v in out.items()}

  def test(self, host_tree) -> Dict[str, float]:
    variables = self._variables(host_tree)
    embedded = {s: self._embed(variables, src)
                for s, src in self.sources.items()}
    if "query" in embedded:
      (q, ql), gallery = embedded["query"], embedded["gallery"]
      return self._metrics(q, ql, gallery)
    return self._metrics(*embedded[self.info.eval_splits[0]])

  def validation(self, host_tree) -> Dict[str, float]:
    if self.validation_source is None:
      raise ValueError("This config has no validation split "
                       "(dataset.validation_fraction = 0).")
    return self._metrics(*self._embed(self._variables(host_tree),
                                      self.validation_source))

  __call__ = test


_SHOWN = ("recall@1", "map@r", "nmi")
_ORDER = ("precision@1", "r_precision", "map@r", "nmi", "ami")


def _summary(metrics: Dict[str, float]) -> str:
  return ", ".join(f"{k} {metrics[k]:.4f}" for k in _SHOWN if k in metrics)


def result_table(result: Dict[str, Any]) -> str:
  """The final table of a run (test-split metrics), with how the step was chosen."""
  cols = {}
  if result.get("init"):
    cols["init"] = result["init"]
  cols[f"final@{result['step']}"] = result["final"]
  best, res = result.get("best"), result["result"]
  if res["selection"] == "validation":
    cols[f"selected@{res['step']}"] = res["test"]
  elif res["selection"] == "test":
    cols[f"best@{res['step']} (test-selected)"] = res["test"]
  cfg = result.get("config", {})
  lines = [f"{cfg.get('dataset', {}).get('name')} / "
           f"{cfg.get('model', {}).get('name')} / "
           f"{cfg.get('loss', {}).get('name')}: test-split metrics",
           console_lib.metrics_table(cols, order=_ORDER)]
  if res["selection"] == "validation":
    val = best["validation"]
    lines.append(
        f"selected@{res['step']}: the step with the best validation "
        f"{res['metric']} ({val[res['metric']]:.4f}) on "
        f"{result['validation']['num_classes']} held-out train classes; its "
        "test numbers are the result.")
  elif res["selection"] == "test":
    lines.append(
        f"note: best@{res['step']} was selected on the TEST split (no "
        "validation split), so it is optimistic; report final, or set "
        "--config.dataset.validation_fraction to select on held-out train "
        "classes.")
  return "\n".join(lines)


def check_restored(tree, template, step, directory):
  """Raises CheckpointError naming the leaves whose shape or dtype differ."""
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


# ----------------------------------------------------------------------------
# The job.
# ----------------------------------------------------------------------------


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
    config: see ``experiments/configs/base.py`` for the fields.
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
    TrainingInterrupted: Ctrl-C (after saving the last completed step).
  """
  reporter = reporter or console_lib.LogReporter()
  config_checks.check_config(config)
  mode = config.get("parallelism", "shard_map")
  workdir = os.path.abspath(os.path.expanduser(workdir))
  primary = jax.process_index() == 0
  best_metric = config.get("best_metric", "recall@1") or None
  ckpts = ckpt_lib.Checkpoints(
      os.path.join(workdir, "checkpoints"), best_metric=best_metric,
      best_mode=config.get("best_mode", "max"),
      asynchronous=config.get("async_checkpoints", True))
  config_dict = workdir_lib.config_to_dict(config)
  resume_step = ckpts.latest_step()
  changes = []
  if resume_step is not None:
    changes = workdir_lib.check_resume(workdir, config_dict,
                                       resume_step=resume_step,
                                       force=force_resume)

  info = data_lib.get_dataset_info(config.dataset.name)
  train_source, val_source = load_sources(config, info, reporter)
  if config.batch.get("sampler", "pk") == "random":
    sampler = data_lib.RandomSampler(len(train_source),
                                     batch_size=config.batch.size,
                                     seed=config.seed)
  else:
    sampler = data_lib.PKSampler(
        data_lib.split_labels(train_source),
        classes_per_batch=config.batch.classes_per_batch,
        images_per_class=config.batch.images_per_class, seed=config.seed)
  train_pre = train_preprocess(config, info)
  model = build_model(config, mode)
  state, entry, hyper, step_key = init_state(config, model, info,
                                             train_pre.output_shape)
  logging.info("Model %s: %d parameters; loss %s: %d parameters.",
               config.model.name, state_lib.count_params(state.params["model"]),
               entry.name, state_lib.count_params(state.params["loss"]))

  host = step_lib.to_host(state_lib.state_to_tree(state), mode="none")
  meta = {}
  if resume_step is not None:
    template = host
    try:
      host, _, meta = ckpts.restore(template)
    except (ValueError, KeyError, TypeError) as e:
      raise CheckpointError(
          f"Checkpoint step {resume_step} in {ckpts.directory} cannot be "
          f"restored with this config ({str(e).splitlines()[0][:200]}); "
          "start fresh with another --workdir.") from e
    check_restored(host, template, resume_step, ckpts.directory)
    reporter.note(f"Resumed from step {int(host['step'])} ({workdir}).")
    for path, old, new in changes:
      reporter.note(f"  changed on resume: {path}: {old} -> {new}")
  if primary:
    workdir_lib.record(workdir, config_dict, step=int(host["step"]),
                       changes=changes)
  writer = writers_lib.create_writer(os.path.join(workdir, "tensorboard"),
                                     is_primary=primary)
  start = int(host["step"])
  mesh = step_lib.make_mesh() if mode == "shard_map" else None
  state = state_lib.state_from_tree(
      state, step_lib.replicate(host, mode=mode, mesh=mesh))
  train_iter = data_lib.train_iterator(
      train_source, sampler=sampler, preprocess=train_pre, start_step=start,
      num_workers=config.dataset.get("num_workers", 0),
      num_threads=config.dataset.get("num_threads", 8))
  train_step = step_lib.make_train_step(
      step_lib.make_loss_fn(entry, hyper), mode=mode, base_key=step_key,
      mesh=mesh)
  evaluator = Evaluator(config, info, model, mode, val_source)
  select_on = "validation" if val_source is not None else "test"
  evaluate = (evaluator.validation if val_source is not None
              else evaluator.test)
  tag = "val" if val_source is not None else "eval"
  num_steps = config.num_train_steps
  eval_every = config.get("eval_every_steps", 0)
  ckpt_every = config.get("checkpoint_every_steps", 0)
  log_every = config.get("log_every_steps", 0) or 50
  global_batch = config_checks.global_batch_size(config)
  lrs = optim_lib.learning_rates(config.optim, num_steps)

  init_metrics = meta.get("init_metrics")
  init_val = meta.get("init_validation_metrics")
  if start == 0 and config.get("eval_at_init", True):
    init_metrics = evaluator.test(host)
    writer.write_scalars(0, {f"eval/{k}": v for k, v in init_metrics.items()})
    reporter.note(f"step 0 test: {_summary(init_metrics)}")
    if val_source is not None:
      init_val = evaluator.validation(host)
      writer.write_scalars(0, {f"val/{k}": v for k, v in init_val.items()})
      reporter.note(f"step 0 validation: {_summary(init_val)}")
  last_eval = (None, None)
  pending = []
  t0, t_window, steps_window = time.time(), time.time(), 0
  train_seconds = float(meta.get("train_seconds", 0.0))

  def check_pending():
    """Fetches the pending step metrics; raises on the first non-finite one."""
    nonlocal pending
    if not pending:
      return None
    fetched = jax.device_get([m for _, m in pending])
    steps = [s for s, _ in pending]
    pending = []
    for s, m in zip(steps, fetched):
      if not bool(m["finite"]):
        ckpts.wait()
        last = ckpts.latest_step()
        kept = (f"The last good checkpoint, step {last} in {ckpts.directory}, "
                "is kept: rerunning the same command resumes from it." if
                last is not None else "No checkpoint was saved before it "
                f"(checkpoint_every_steps={ckpt_every}), so there is nothing "
                "to resume.")
        raise NonFiniteError(
            f"Non-finite loss or gradient at step {s} (loss = "
            f"{float(m['loss'])}); training stopped without saving that "
            f"state. Lower optim.learning_rate or set optim.grad_clip_norm "
            f"(and check the data). {kept}")
    return steps[-1], {k: float(np.mean([float(m[k]) for m in fetched]))
                       for k in ("loss", "grad_norm")}

  def save_latest(done, host_tree):
    ckpts.save_latest(done, host_tree, train_iter.get_state(), meta={
        "init_metrics": init_metrics,
        "init_validation_metrics": init_val,
        "train_seconds": train_seconds + time.time() - t0})

  reporter.start(total=num_steps, initial=start,
                 description=f"{info.name}/{entry.name}")
  done = start
  try:
    for step in range(start, num_steps):
      batch = next(train_iter)
      batch = {"image": batch["image"], "label": batch["label"]}
      state, metrics = train_step(state, step_lib.shard_batch(
          batch, mode=mode, mesh=mesh))
      done = step + 1
      pending.append((done, step_lib.first_replica(metrics, mode=mode)))
      reporter.advance(done)
      steps_window += 1
      do_eval = (eval_every and done % eval_every == 0) or done == num_steps
      do_ckpt = (ckpt_every and done % ckpt_every == 0) or done == num_steps
      if done % log_every == 0 or do_eval or do_ckpt:
        _, means = check_pending()
        now = time.time()
        rate = steps_window / max(now - t_window, 1e-9)
        t_window, steps_window = now, 0
        scalars = {"train/loss": means["loss"],
                   "train/grad_norm": means["grad_norm"],
                   "train/steps_per_sec": rate,
                   "train/images_per_sec": rate * global_batch}
        scalars.update({f"train/lr_{g}": v for g, v in lrs(step).items()})
        writer.write_scalars(done, scalars)
        reporter.stats(done, num_steps, loss=means["loss"],
                       steps_per_sec=rate, images_per_sec=rate * global_batch)
      if do_eval or do_ckpt:
        host_tree = step_lib.to_host(state_lib.state_to_tree(state),
                                     mode=mode)
        if do_eval:
          metrics_now = evaluate(host_tree)
          last_eval = (done, metrics_now)
          writer.write_scalars(done, {f"{tag}/{k}": v
                                      for k, v in metrics_now.items()})
          reporter.note(f"step {done} {select_on}: {_summary(metrics_now)}")
          ckpts.save_best(done, host_tree, train_iter.get_state(),
                          metrics_now)
        if do_ckpt:
          # The init metrics and the train time travel with the checkpoint.
          save_latest(done, host_tree)
      writer.flush()
  except KeyboardInterrupt:
    saved = ckpts.latest_step()
    try:
      if done > (saved or 0) and done > start:
        check_pending()
        save_latest(done, step_lib.to_host(state_lib.state_to_tree(state),
                                           mode=mode))
      ckpts.wait()
      saved = ckpts.latest_step()
    except Exception:  # pylint: disable=broad-except
      # E.g. Ctrl-C inside a step whose input buffers were donated.
      logging.exception("Could not save the interrupted step.")
    reporter.finish()
    writer.close()
    train_iter.close()
    ckpts.close()
    raise TrainingInterrupted(saved, ckpts.directory) from None
  finally:
    reporter.finish()

  ckpts.wait()
  train_seconds += time.time() - t0
  final_step, last_metrics = last_eval
  final_tree = None
  if val_source is None and final_step == num_steps:
    final = last_metrics
  else:
    final_tree = step_lib.to_host(state_lib.state_to_tree(state), mode=mode)
    final = evaluator.test(final_tree)
  best = None
  saved_best = ckpts.best_metrics()
  if saved_best is not None:
    best = {"step": saved_best["step"], "metric": best_metric,
            "mode": config.get("best_mode", "max"), "selected_on": select_on}
    if select_on == "test":
      best["test"] = saved_best["metrics"]
    else:
      best["validation"] = saved_best["metrics"]
      if best["step"] == num_steps:
        best["test"] = final
      else:
        tree, _, _ = ckpts.restore(host, which="best")
        best["test"] = evaluator.test(tree)
    result_part = {"step": best["step"], "selection": select_on,
                   "metric": best_metric, "test": best["test"]}
  else:
    result_part = {"step": num_steps, "selection": "last", "metric": None,
                   "test": final}
  validation = None
  if val_source is not None:
    validation = {
        "fraction": config.dataset.validation_fraction,
        "seed": config.dataset.get("validation_seed", 0),
        "classes": [int(c) for c in val_source.classes],
        "num_classes": len(val_source.classes),
        "num_images": len(val_source),
        "init": init_val,
    }
  result = {
      "init": init_metrics,
      "final": final,
      "best": best,
      "result": result_part,
      "validation": validation,
      "step": num_steps,
      "train_seconds": train_seconds,
      "config": config_dict,
      "config_changes": workdir_lib.load_changes(workdir),
  }
  if primary:
    with open(os.path.join(workdir, "metrics.json"), "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)
  reporter.result(result_table(result))
  writer.close()
  train_iter.close()
  ckpts.close()
  return result
