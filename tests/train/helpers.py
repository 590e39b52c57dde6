"""Small models, losses and configs shared by the trainer tests.

The trainer is generic in the model and the loss; these tiny ones keep the
compilations fast. Each test that needs the project's real registries
(``circle_jax.losses.get_loss``, ``circle_jax.models.get_model``) uses them
directly. The configs are built from the package's schema
(:mod:`circle_jax.config`) with the settings of the experiments' digits and
omniglot_small jobs (``tests/experiments/test_main.py`` checks they agree).
"""

import dataclasses
import functools
import os
import signal
import time
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from circle_jax import config_facts
from circle_jax import ops
from circle_jax import config as config_lib
from circle_jax.losses.engine import reductions
from circle_jax.losses import engine
from circle_jax.train import checkpoint as ckpt_lib
from circle_jax.train import console
from circle_jax.train import loop
from circle_jax.train import state as state_lib


def digits_config(**overrides):
  """The digits job's config (experiments/configs/digits.py), with
  ``overrides`` as ``{'a.b': value}``."""
  c = config_lib.base_config()
  c.model.embedding_dim = 4
  c.model.sync_bn = True
  c.model.kwargs.width = 32
  c.loss = config_lib.loss_config("circle", gamma=80.0, margin=0.4)
  c.batch.classes_per_batch = 5
  c.batch.images_per_class = 8
  c.num_train_steps = 150
  c.eval_every_steps = 75
  c.checkpoint_every_steps = 75
  return override(c, **overrides)


def omniglot_small_config(**overrides):
  """The omniglot_small job's config (experiments/configs/omniglot_small.py)."""
  c = config_lib.base_config()
  c.dataset.name = "omniglot_small"
  c.dataset.num_threads = 0
  c.model.sync_bn = True
  c.loss = config_lib.loss_config("circle", gamma=80.0, margin=0.4)
  c.batch.classes_per_batch = 16
  c.num_train_steps = 2000
  return override(c, **overrides)


def override(c, **overrides):
  """Sets ``c['a']['b'] = v`` for each ``a.b=v``; returns ``c``."""
  for path, value in overrides.items():
    node = c
    *parents, leaf = path.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


class TinyNet(nn.Module):
  """conv -> (BN) -> relu -> mean pool -> dense head -> L2 normalise."""

  embedding_dim: int = 4
  use_bn: bool = True
  freeze_bn: bool = False

  @nn.compact
  def __call__(self, images, *, train: bool):
    x = images.astype(jnp.float32)
    backbone = _Backbone(use_bn=self.use_bn, freeze_bn=self.freeze_bn,
                         name="backbone")
    x = backbone(x, train=train)
    x = nn.Dense(self.embedding_dim, name="head")(x)
    return ops.l2_normalize(x)


class _Backbone(nn.Module):
  use_bn: bool
  freeze_bn: bool

  @nn.compact
  def __call__(self, x, *, train):
    x = nn.Conv(3, (3, 3), use_bias=not self.use_bn)(x)
    if self.use_bn:
      x = nn.BatchNorm(use_running_average=not train or self.freeze_bn,
                       momentum=0.5)(x)
    x = nn.relu(x)
    return jnp.mean(x, axis=(1, 2))


@dataclasses.dataclass(frozen=True)
class Entry:
  """The subset of ``circle_jax.losses.LossEntry`` the step uses."""

  name: str
  fn: Callable
  param_name: Optional[str] = None
  supports_axis_name: bool = True

  def apply(self, embeddings, labels, params=None, *, key=None,
            axis_name=None, ref=None, **hyper):
    del key
    if axis_name is not None:
      hyper["axis_name"] = axis_name
    if ref is not None:
      hyper["ref"] = ref
    return self.fn(embeddings, labels, params, **hyper)

  def bind(self, **hyper):
    return functools.partial(self.fn, **hyper)

  def routed(self, *, key=None, axis_name=None, ref=None):
    del key
    return {k: v for k, v in (("axis_name", axis_name), ("ref", ref))
            if v is not None}


def _pair_loss(embeddings, labels, params=None, *, axis_name=None, scale=8.0):
  """A Circle-like pair loss of the global batch (written with the engine's pair block)."""
  del params
  _, _, s, pos, neg = engine.pair_block(embeddings, labels,
                                        axis_name=axis_name)
  per = (ops.log1p_sum_exp(scale * s, neg)
         + ops.log1p_sum_exp(-scale * s, pos))
  return reductions.mean_over_valid(per, pos.any(1), axis_name)


def _proxy_loss(embeddings, labels, proxies, *, axis_name=None, scale=8.0):
  """Normalised-softmax over proxies, mean over the global batch."""
  s = ops.cosine_similarity(embeddings, proxies)
  logits = scale * s
  per = jax.nn.logsumexp(logits, axis=1) - jnp.take_along_axis(
      logits, labels[:, None], axis=1)[:, 0]
  return reductions.mean_over_valid(per, jnp.ones_like(per), axis_name)


PAIR = Entry("toy_pair", _pair_loss)
PROXY = Entry("toy_proxy", _proxy_loss, param_name="proxies")


def fake_batch(key, batch_size=16, num_classes=4, size=6):
  k1, _ = jax.random.split(key)
  labels = jnp.arange(batch_size) % num_classes
  images = jax.random.normal(k1, (batch_size, size, size, 1))
  images = images + labels[:, None, None, None].astype(jnp.float32)
  return {"image": images, "label": labels.astype(jnp.int32)}


def initial_state(model, tx, sample_images, *, key, loss_params=None,
                  memory=None):
  """A ``TrainState`` at step 0 built as ``circle_jax.train.run.init_state``
  builds it (``TrainState.create`` over ``{'model', 'loss'}`` parameters),
  for a toy model, optimiser and loss parameters instead of a config's."""
  variables = dict(model.init(key, sample_images, train=False))
  return state_lib.TrainState.create(
      apply_fn=model.apply,
      params={"model": variables["params"], "loss": dict(loss_params or {})},
      tx=tx, batch_stats=variables.get("batch_stats", {}), xbm=memory)


def sigkill_when_exists(proc, path: str, timeout: float = 240) -> None:
  """SIGKILLs (kill -9) the process ``proc`` as soon as ``path`` exists
  (e.g. a checkpoint's ``_CHECKPOINT_METADATA``); fails if it never does."""
  deadline = time.time() + timeout
  while not os.path.exists(path) and proc.poll() is None:
    assert time.time() < deadline, f"{path} was never written"
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  assert proc.wait() == -signal.SIGKILL


def finish(proc, timeout: float = 300) -> None:
  """Waits for a job started with ``subprocess.Popen(stderr=PIPE)``; fails
  with the end of its stderr unless it exits with 0."""
  _, err = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, err.decode()[-3000:]


def saved_tree(workdir: str, step: int):
  """The tree of the latest checkpoint of ``workdir``, which must be at
  ``step``."""
  ckpts = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"))
  assert ckpts.latest_step() == step
  tree = ckpts.restore()[0]
  ckpts.close()
  return tree


def assert_resumes_exactly(make_config: Callable, tmp_path, steps: int):
  """Finishes the interrupted run in ``tmp_path / 'a'`` with
  ``make_config()``, trains the same config uninterrupted in
  ``tmp_path / 'b'``, and checks that both end at ``steps`` with bitwise
  equal checkpoints."""
  trees = []
  for run in ("a", "b"):
    workdir = str(tmp_path / run)
    loop.train_and_evaluate(make_config(), workdir)
    trees.append(saved_tree(workdir, steps))
  for x, y in zip(jax.tree.leaves(trees[0]), jax.tree.leaves(trees[1])):
    np.testing.assert_array_equal(x, y)


def write_run(config, workdir: str, *, latest: int = 4,
              best: Optional[int] = 2) -> dict:
  """A workdir as the trainer leaves it, without training: ``config.json``
  and the config's initial state saved as the ``latest`` step ``latest``
  and, with ``best``, as the ``best`` step ``best`` with its parameters
  shifted by 0.5 (so a test sees which checkpoint was restored).

  Returns:
    ``{'latest': tree, 'best': tree or None}``, the host trees saved.
  """
  # Imported here: the other helpers need neither the data nor the models.
  from circle_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from circle_jax import parallel  # pylint: disable=g-import-not-at-top
  from circle_jax.train import restore as restore_lib  # pylint: disable=g-import-not-at-top
  from circle_jax.train import run as run_lib  # pylint: disable=g-import-not-at-top
  from circle_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  info = data_lib.get_dataset_info(config.dataset.name)
  model = run_lib.build_model(config, parallel.SingleDevice())
  shape = config_facts.train_preprocess(config, info).output_shape
  state, *_ = run_lib.init_state(config, model, info, shape)
  tree = parallel.SingleDevice().to_host(state_lib.state_to_tree(state))
  workdir_lib.record(workdir, workdir_lib.config_to_dict(config), step=0,
                     changes=[])
  ckpts = restore_lib.open_checkpoints(config, workdir)
  saved = {"latest": dict(tree, step=np.int32(latest)), "best": None}
  ckpts.save_latest(latest, saved["latest"])
  if best is not None:
    saved["best"] = dict(tree, step=np.int32(best),
                         params=jax.tree.map(lambda x: x + 0.5,
                                             tree["params"]))
    ckpts.save_best(best, saved["best"], None, {"recall@1": 0.5})
  ckpts.wait()
  ckpts.close()
  return saved


class InterruptAt(console.LogReporter):
  """A reporter that raises KeyboardInterrupt, as Ctrl-C would, after step
  ``at`` (the loop's exact-resume tests)."""

  def __init__(self, at):
    self.at = at

  def advance(self, done):
    if done == self.at:
      raise KeyboardInterrupt
