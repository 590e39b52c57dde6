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
from circle_jax.train import checkpoint as ckpt_lib
from circle_jax.train import config_checks
from circle_jax.train import optim as optim_lib
from circle_jax.train import state as state_lib
from circle_jax.train import step as step_lib
from circle_jax.train import writers as writers_lib


class NonFiniteError(FloatingPointError):
  """The loss or a gradient became NaN/inf; the message names the step."""


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


class Evaluator:
  """Embeds the eval split(s) and computes the metrics of the config."""

  def __init__(self, config, info, model, mode):
    self.config, self.info = config, info
    self.mesh = _eval_mesh(mode)
    self.embed = step_lib.embed_fn(model.apply, mesh=self.mesh)
    self.preprocess = eval_preprocess(config, info)
    self.sources = {
        split: data_lib.load_split(
            info.name, split, data_dir=config.dataset.get("data_dir") or
            default_data_dir(), manual_dir=config.dataset.get("manual_dir"))
        for split in info.eval_splits}
    self.ks = tuple(config.get("eval_ks", None) or info.ks)
    self.clustering = config.get("eval_clustering", True)

  def __call__(self, host_tree) -> Dict[str, float]:
    variables = {"params": host_tree["params"]["model"]}
    if host_tree["batch_stats"]:
      variables["batch_stats"] = host_tree["batch_stats"]
    variables = step_lib.replicate(variables, mode="shard_map", mesh=self.mesh)
    out = {}
    bs = self.config.batch.get("eval_batch_size", 256)
    embedded = {s: embed_source(variables, self.embed, src, self.preprocess,
                                batch_size=bs, mesh=self.mesh)
                for s, src in self.sources.items()}
    if "query" in embedded:
      (q, ql), (g, gl) = embedded["query"], embedded["gallery"]
      out.update(eval_lib.retrieval_metrics(q, ql, g, gl, ks=self.ks))
      emb, lab = q, ql
    else:
      emb, lab = embedded[self.info.eval_splits[0]]
      out.update(eval_lib.retrieval_metrics(emb, lab, ks=self.ks))
    if self.clustering:
      out.update(eval_lib.clustering_metrics(
          emb, lab, key=jax.random.PRNGKey(self.config.seed)))
    return {k: float(v) for k, v in out.items()}


def _format_table(rows: Dict[str, Dict[str, float]]) -> str:
  names = sorted({k for r in rows.values() for k in r},
                 key=lambda k: (not k.startswith("recall@"),
                                int(k[7:]) if k.startswith("recall@") and
                                k[7:].isdigit() else 0, k))
  cols = list(rows)
  width = max([len(n) for n in names] + [6])
  lines = [" ".join([f"{'metric':<{width}}"] + [f"{c:>10}" for c in cols])]
  for n in names:
    cells = []
    for c in cols:
      v = rows[c].get(n)
      cells.append(f"{v:>10.4f}" if isinstance(v, float) else f"{str(v):>10}")
    lines.append(" ".join([f"{n:<{width}}"] + cells))
  return "\n".join(lines)


# ----------------------------------------------------------------------------
# The job.
# ----------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> Dict[str, Any]:
  """Trains, evaluates and checkpoints; resumes from ``workdir`` if possible.

  Args:
    config: see ``experiments/configs/digits.py`` for the fields.
    workdir: output folder: ``checkpoints/``, ``tensorboard/``,
      ``metrics.json``, ``config.json``.

  Returns:
    The content of ``metrics.json``: ``{'final': metrics, 'best': metrics
    (with 'step'), 'init': metrics at step 0, 'step', 'config',
    'train_seconds'}``.

  Raises:
    config_checks.ConfigError: a bad config value (before any work).
    NonFiniteError: the loss or a gradient became non-finite.
  """
  config_checks.check_config(config)
  mode = config.get("parallelism", "shard_map")
  workdir = os.path.abspath(os.path.expanduser(workdir))
  primary = jax.process_index() == 0
  if primary:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  writer = writers_lib.create_writer(os.path.join(workdir, "tensorboard"),
                                     is_primary=primary)
  info = data_lib.get_dataset_info(config.dataset.name)
  data_dir = config.dataset.get("data_dir") or default_data_dir()
  train_source = data_lib.load_split(
      info.name, info.train_split, data_dir=data_dir,
      manual_dir=config.dataset.get("manual_dir"))
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

  ckpts = ckpt_lib.Checkpoints(
      os.path.join(workdir, "checkpoints"),
      best_metric=config.get("best_metric", "recall@1") or None,
      best_mode=config.get("best_mode", "max"),
      asynchronous=config.get("async_checkpoints", True))
  host = step_lib.to_host(state_lib.state_to_tree(state), mode="none")
  meta = {}
  if ckpts.latest_step() is not None:
    host, data_state, meta = ckpts.restore(host)
    logging.info("Resumed from step %d (%s).", int(host["step"]),
                 ckpts.directory)
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
  evaluator = Evaluator(config, info, model, mode)
  num_steps = config.num_train_steps
  eval_every = config.get("eval_every_steps", 0)
  ckpt_every = config.get("checkpoint_every_steps", 0)
  log_every = config.get("log_every_steps", 0) or 50
  global_batch = config_checks.global_batch_size(config)
  lrs = optim_lib.learning_rates(config.optim, num_steps)

  init_metrics = meta.get("init_metrics")
  if start == 0 and config.get("eval_at_init", True):
    init_metrics = evaluator(host)
    writer.write_scalars(0, {f"eval/{k}": v for k, v in init_metrics.items()})
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
        raise NonFiniteError(
            f"Non-finite loss or gradient at step {s} (loss = "
            f"{float(m['loss'])}); stopping. The last good checkpoint is step "
            f"{ckpts.latest_step()} in {ckpts.directory}; it was not "
            "overwritten.")
    return steps[-1], {k: float(np.mean([float(m[k]) for m in fetched]))
                       for k in ("loss", "grad_norm")}

  for step in range(start, num_steps):
    batch = next(train_iter)
    batch = {"image": batch["image"], "label": batch["label"]}
    state, metrics = train_step(state, step_lib.shard_batch(
        batch, mode=mode, mesh=mesh))
    done = step + 1
    pending.append((done, step_lib.first_replica(metrics, mode=mode)))
    steps_window += 1
    do_eval = (eval_every and done % eval_every == 0) or done == num_steps
    do_ckpt = (ckpt_every and done % ckpt_every == 0) or done == num_steps
    if done % log_every == 0 or do_eval or do_ckpt:
      summary = check_pending()
      now = time.time()
      rate = steps_window / max(now - t_window, 1e-9)
      t_window, steps_window = now, 0
      _, means = summary
      scalars = {"train/loss": means["loss"],
                 "train/grad_norm": means["grad_norm"],
                 "train/steps_per_sec": rate,
                 "train/images_per_sec": rate * global_batch}
      scalars.update({f"train/lr_{g}": v for g, v in lrs(step).items()})
      writer.write_scalars(done, scalars)
      eta = (num_steps - done) / max(rate, 1e-9)
      logging.info("step %d/%d  loss %.4f  %.2f steps/s  %.0f images/s  "
                   "ETA %s", done, num_steps, means["loss"], rate,
                   rate * global_batch, time.strftime("%H:%M:%S",
                                                      time.gmtime(eta)))
    if do_eval or do_ckpt:
      host_tree = step_lib.to_host(state_lib.state_to_tree(state), mode=mode)
      if do_eval:
        metrics_now = evaluator(host_tree)
        last_eval = (done, metrics_now)
        writer.write_scalars(done, {f"eval/{k}": v
                                    for k, v in metrics_now.items()})
        logging.info("eval at step %d: %s", done, ", ".join(
            f"{k} {v:.4f}" for k, v in metrics_now.items()))
        ckpts.save_best(done, host_tree, train_iter.get_state(), metrics_now)
      if do_ckpt:
        # The init metrics and the train time travel with the checkpoint.
        ckpts.save_latest(done, host_tree, train_iter.get_state(), meta={
            "init_metrics": init_metrics,
            "train_seconds": train_seconds + time.time() - t0})
    writer.flush()

  ckpts.wait()
  train_seconds += time.time() - t0
  final_step, final = last_eval
  if final is None or final_step != num_steps:  # e.g. resumed after the end.
    host_tree = step_lib.to_host(state_lib.state_to_tree(state), mode=mode)
    final = evaluator(host_tree)
  best = ckpts.best_metrics()
  result = {
      "final": final,
      "best": (dict(best["metrics"], step=best["step"]) if best else None),
      "init": init_metrics,
      "step": num_steps,
      "train_seconds": train_seconds,
      "config": json.loads(config.to_json_best_effort()),
  }
  if primary:
    with open(os.path.join(workdir, "metrics.json"), "w") as f:
      json.dump(result, f, indent=2, sort_keys=True)
    rows = {"init": init_metrics or {}, "final": final}
    if best:
      rows[f"best@{best['step']}"] = best["metrics"]
    logging.info("Summary (%s, %s, %s):\n%s", info.name, config.model.name,
                 entry.name, _format_table(rows))
  writer.close()
  train_iter.close()
  ckpts.close()
  return result
