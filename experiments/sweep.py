"""Hyperparameter sensitivity as one compiled program: a vmapped grid of models.

Trains one model per point of a grid of loss hyperparameters (e.g. Circle's
``gamma x margin``, the paper's section 4.5) as a *single* program:

* the ``TrainState`` s are stacked: every array of ``params``, ``opt_state``,
  ``batch_stats`` and ``step`` gets a leading model axis of size
  ``grid.size``; all models start from the same initialisation (the config's
  seed), so the only difference between them is their hyperparameters;
* the swept hyperparameters are float32 arrays ``[grid.size]``, vmapped with
  the state, so inside the step they are traced scalars, not Python
  constants; the other hyperparameters of the loss stay the config's
  constants;
* one ``jax.jit(jax.vmap(train_step))`` updates all models on the same batch
  (the batch is not vmapped: one data pipeline feeds the grid);
* the test split is embedded once per batch for all models with a vmapped
  embedding function, then Recall@K / MAP@R are computed per model with
  ``circle_jax.evaluation.retrieval_metrics``.

``--compare_sequential`` also trains the same grid one model at a time with
the unvmapped step (``circle_jax.train.step.make_train_step(mode="none")``, one
compilation per point, the hyperparameters as Python constants), on the same
batches, and reports the wall times (compilation and training separately) and
how far the two sets of models are apart (float32 rounding).

Convolutions under ``vmap``: a convolution whose input and kernel both carry
the model axis becomes one grouped convolution, which XLA:CPU runs 2-6x slower
than the same convolutions one by one (measured on conv4's layers). On CPU the
vmapped step therefore runs the model's ``nn.Conv`` s with a batching rule
that unrolls the convolutions over the models (``--conv=unrolled``, the CPU
default; :func:`unrolled_conv`): the same values, one program.
``--conv=native`` keeps JAX's grouped convolution (the default on GPU/TPU).

Like the benchmarks, the script re-executes itself with huge-page malloc
(``experiments/hostenv.py``; ``CIRCLE_JAX_NO_HUGEPAGES=1`` keeps the default):
on the 2-core machine it made both ways' training steps ~30% faster (4 models,
50 steps of omniglot_small).

The batches of all steps are read once from the config's pipeline
(``circle_jax.data.train_iterator``, a function of ``(seed, step)``) and kept on
the device, so the timings of both ways measure compilation and training only;
the time to read the data is reported once.

Usage::

  python -m experiments.sweep --config experiments/configs/omniglot_small.py \\
      --grid gamma=16,32,64,128 --grid margin=0.1,0.2,0.3,0.4 --steps 300 \\
      --compare_sequential --out experiments/results/sweep_circle_omniglot_small

Any config field can be overridden as in ``experiments.main``
(``--config.loss.name=ranked_proxy_anchor --config.optim.learning_rate=3e-4``).
Writes ``OUT/results.md`` (tables and timings), ``OUT/results.json``,
``OUT/map_at_r.png`` and ``OUT/recall_at_1.png`` (heatmaps over the grid).
The results are the test-split metrics of the last step: no model selection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import custom_batching
import numpy as np

from circle_jax import data as data_lib
from circle_jax import evaluation as eval_lib
from circle_jax.train import config_checks
from circle_jax.train import loop
from circle_jax.train import state as state_lib
from circle_jax.train import step as step_lib

PyTree = Any
CONVS = ("native", "unrolled")

# Metrics of the heatmaps: (key of retrieval_metrics, file name, title).
HEATMAPS = (("map@r", "map_at_r.png", "MAP@R"),
            ("recall@1", "recall_at_1.png", "R@1"))


# ----------------------------------------------------------------------------
# The grid.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Grid:
  """A product grid of float hyperparameters, flattened row-major.

  Attributes:
    names: the hyperparameter names, one per axis (the first varies slowest).
    values: the values of each axis.
  """

  names: Tuple[str, ...]
  values: Tuple[Tuple[float, ...], ...]

  @property
  def shape(self) -> Tuple[int, ...]:
    return tuple(len(v) for v in self.values)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  def points(self) -> List[Dict[str, float]]:
    """Every grid point as ``{name: value}`` (Python floats), row-major."""
    mesh = np.meshgrid(*[np.asarray(v, np.float64) for v in self.values],
                       indexing="ij")
    flat = [m.reshape(-1) for m in mesh]
    return [{n: float(f[i]) for n, f in zip(self.names, flat)}
            for i in range(self.size)]

  def arrays(self) -> Dict[str, np.ndarray]:
    """``{name: float32 [size]}``: the per-model hyperparameters."""
    points = self.points()
    return {n: np.asarray([p[n] for p in points], np.float32)
            for n in self.names}


def parse_grid(specs: Sequence[str]) -> Grid:
  """Parses ``["gamma=16,32", "margin=0.1,0.2"]`` into a :class:`Grid`.

  Raises:
    ValueError: a malformed spec, a repeated name or a non-numeric value.
  """
  if not specs or len(specs) > 2:
    raise ValueError("Give one or two --grid NAME=V1,V2,... (the axes of the "
                     f"heatmaps); got {len(specs or [])}.")
  names, values = [], []
  for spec in specs:
    name, sep, vals = str(spec).partition("=")
    name = name.strip()
    if not sep or not name or not vals.strip():
      raise ValueError(f"--grid {spec!r}: expected NAME=V1,V2,...")
    if name in names:
      raise ValueError(f"--grid: {name!r} is given twice.")
    try:
      axis = tuple(float(v) for v in vals.split(","))
    except ValueError:
      raise ValueError(
          f"--grid {spec!r}: the values must be numbers.") from None
    if len(set(axis)) != len(axis):
      raise ValueError(f"--grid {spec!r}: repeated value.")
    names.append(name)
    values.append(axis)
  return Grid(tuple(names), tuple(values))


def check_grid(entry, grid: Grid, fixed_hyper: Mapping[str, Any], *,
               embedding_dim: int, num_classes: Optional[int]) -> None:
  """Checks the grid's names and every grid point against the loss.

  The names must be float hyperparameters of the loss, and the loss must
  accept every point.
  Under ``vmap`` the hyperparameters are traced, and the losses' own range
  checks (``gamma > 0``, ...) only look at Python numbers; so every point is
  checked here with Python floats, by tracing the loss once per point
  (``jax.eval_shape``: no computation).

  Raises:
    ValueError: an unknown or non-float hyperparameter (integers such as
      SoftTriple's ``centers_per_class`` change shapes and cannot be vmapped),
      or a point the loss rejects.
  """
  for name in grid.names:
    if name not in entry.defaults:
      raise ValueError(
          f"--grid {name}: loss {entry.name!r} has no hyperparameter {name!r}; "
          f"it has {sorted(entry.defaults)}.")
    default = entry.defaults[name]
    if isinstance(default, bool) or not isinstance(default, float):
      raise ValueError(
          f"--grid {name}: only float hyperparameters can be swept; "
          f"{entry.name}.{name} defaults to {default!r}.")
  x = jax.ShapeDtypeStruct((4, embedding_dim), jnp.float32)
  y = jax.ShapeDtypeStruct((4,), jnp.int32)
  p = None
  if entry.param_name is not None:
    p = jax.eval_shape(lambda: entry.init_params(
        jax.random.PRNGKey(0), num_classes or 2, embedding_dim,
        **fixed_hyper))
  for point in grid.points():
    hyper = {**fixed_hyper, **point}
    try:
      jax.eval_shape(lambda x, y, p, h=hyper: entry.apply(
          x, y, p, key=jax.random.PRNGKey(0), **h), x, y, p)
    except ValueError as e:
      raise ValueError(f"--grid point {point}: {e}") from None


# ----------------------------------------------------------------------------
# Stacked states and the vmapped step.
# ----------------------------------------------------------------------------


def stack_trees(trees: Sequence[PyTree]) -> PyTree:
  """Stacks identically structured trees along a new leading axis."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def stacked_state(state: state_lib.TrainState,
                  num_models: int) -> state_lib.TrainState:
  """``num_models`` copies of ``state`` with a leading model axis.

  ``step``, ``params``, ``opt_state`` and ``batch_stats`` become
  ``[num_models, ...]`` arrays (fresh buffers: ``state`` is left intact);
  ``apply_fn`` and ``tx`` are shared (static fields).
  """
  tree = state_lib.state_to_tree(state)
  stacked = jax.tree.map(
      lambda x: jnp.repeat(jnp.asarray(x)[None], num_models, axis=0), tree)
  return state.replace(**stacked)


def fresh_state(state: state_lib.TrainState) -> state_lib.TrainState:
  """A copy of ``state`` in new buffers (a donated step may consume them)."""
  return state.replace(**jax.tree.map(lambda x: jnp.array(x, copy=True),
                                      state_lib.state_to_tree(state)))


def _unrolled_over_models(fn):
  """``fn(*arrays)`` whose ``vmap`` runs ``fn`` once per model, unrolled.

  When every argument has the model axis, the batched call is a Python loop
  over the models (``axis_size`` separate calls of ``fn``, stacked): for a
  convolution, ``axis_size`` ordinary convolutions instead of ``vmap``'s
  grouped convolution. Otherwise (e.g. a kernel per model on the shared
  input batch) it is ``vmap``'s own rule.
  """
  per_model = custom_batching.custom_vmap(fn)

  @per_model.def_vmap
  def rule(axis_size, in_batched, *args):
    if all(in_batched):
      return jnp.stack([fn(*(a[i] for a in args))
                        for i in range(axis_size)]), True
    in_axes = tuple(0 if b else None for b in in_batched)
    return jax.vmap(fn, in_axes=in_axes)(*args), True

  return per_model


def unrolled_conv(x: jax.Array, kernel: jax.Array, **conv_kwargs) -> jax.Array:
  """``lax.conv_general_dilated`` whose batching rule loops over the models.

  ``unrolled_conv(x, kernel, **conv_kwargs)`` is
  ``lax.conv_general_dilated(x, kernel, **conv_kwargs)``; under ``vmap`` it
  runs one convolution per model (:func:`_unrolled_over_models`).
  ``vmap`` of a convolution whose input and kernel both carry the model axis
  is a grouped convolution (``feature_group_count = models``), which XLA:CPU
  runs several times slower than the same number of separate convolutions.
  The value and the gradients are those of the plain convolution (the
  backward pass is its transposes, each looped over the models the same
  way); ``custom_vjp`` because ``custom_vmap`` has no reverse mode.
  """
  conv = functools.partial(jax.lax.conv_general_dilated, **conv_kwargs)

  @jax.custom_vjp
  def f(x, kernel):
    return _unrolled_over_models(conv)(x, kernel)

  def f_fwd(x, kernel):
    return f(x, kernel), (x, kernel)

  def f_bwd(res, g):
    x, kernel = res
    x_aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
    k_aval = jax.ShapeDtypeStruct(kernel.shape, kernel.dtype)
    dx = _unrolled_over_models(lambda g, k: jax.linear_transpose(
        lambda a: conv(a, k), x_aval)(g)[0])(g, kernel)
    dk = _unrolled_over_models(lambda x, g: jax.linear_transpose(
        lambda b: conv(x, b), k_aval)(g)[0])(x, g)
    return dx, dk

  f.defvjp(f_fwd, f_bwd)
  return f(x, kernel)


def _unrolled_conv_interceptor(next_fun, args, kwargs, context):
  """Runs 2-D ``nn.Conv`` calls with :func:`unrolled_conv`.

  The convolution is the module's own (same strides, padding, dilations,
  groups, precision, dtype promotion, bias); other modules and methods, masked,
  unshared-weight or non-2-D convolutions and initialisation go to
  ``next_fun`` unchanged.
  """
  m = context.module
  if (not isinstance(m, nn.Conv) or context.method_name != "__call__"
      or kwargs or len(args) != 1 or not m.has_variable("params", "kernel")):
    return next_fun(*args, **kwargs)
  x = args[0]
  kernel = m.get_variable("params", "kernel")
  padding = nn.linear.canonicalize_padding(m.padding, 2)
  if (x.ndim != 4 or kernel.ndim != 4 or not m.shared_weights
      or m.mask is not None or padding in ("CIRCULAR", "REFLECT", "CAUSAL")):
    return next_fun(*args, **kwargs)

  def pairs(v):
    return (1, 1) if v is None else ((v, v) if isinstance(v, int)
                                     else tuple(v))

  bias = m.get_variable("params", "bias") if m.use_bias else None
  x, kernel, bias = m.promote_dtype(x, kernel, bias, dtype=m.dtype)
  y = unrolled_conv(
      x, kernel, window_strides=pairs(m.strides),
      padding=padding if isinstance(padding, str) else tuple(
          tuple(p) for p in padding),
      lhs_dilation=pairs(m.input_dilation),
      rhs_dilation=pairs(m.kernel_dilation),
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=m.feature_group_count, precision=m.precision)
  if bias is not None:
    y = y + bias.reshape((1, 1, 1, -1))
  return y


def _conv_context(conv: str):
  """The context that applies the ``conv`` implementation while tracing."""
  if conv == "native":
    return contextlib.nullcontext()
  if conv == "unrolled":
    return nn.intercept_methods(_unrolled_conv_interceptor)
  raise ValueError(f"conv must be one of {CONVS}; got {conv!r}.")


def default_conv() -> str:
  """``unrolled`` on CPU (see :func:`unrolled_conv`), ``native`` elsewhere."""
  return "unrolled" if jax.default_backend() == "cpu" else "native"


def make_sweep_step(entry, fixed_hyper: Mapping[str, Any], *,
                    base_key: jax.Array, donate: bool = True,
                    conv: str = "native"):
  """One compiled step for all models of a grid.

  Args:
    entry: the ``circle_jax.losses`` registry entry.
    fixed_hyper: the hyperparameters that are not swept (Python constants).
    base_key: the loss key of :func:`circle_jax.train.step.train_step`.
    donate: donate the stacked state's buffers.
    conv: how the model's 2-D convolutions run: ``native`` (``vmap`` of
      ``lax.conv_general_dilated``: grouped convolutions) or ``unrolled``
      (:func:`unrolled_conv`: one convolution per model).

  Returns:
    ``step(states, hyper, batch) -> (states, metrics)``: ``states`` stacked
    (:func:`stacked_state`), ``hyper`` ``{name: float32 [M]}``, ``batch``
    ``{'image': [b, ...], 'label': [b]}`` shared by all models; ``metrics``
    are ``train_step``'s, each ``[M]``.
  """
  fixed_hyper = dict(fixed_hyper)

  _conv_context(conv)  # Checks the name now.

  def one_model(state, hyper, batch):
    loss_fn = step_lib.make_loss_fn(entry, {**fixed_hyper, **hyper})
    with _conv_context(conv):
      return step_lib.train_step(state, batch, loss_fn=loss_fn,
                                 base_key=base_key)

  return jax.jit(jax.vmap(one_model, in_axes=(0, 0, None)),
                 donate_argnums=(0,) if donate else ())


def make_sequential_step(entry, fixed_hyper: Mapping[str, Any],
                         point: Mapping[str, float], *, base_key: jax.Array):
  """The plain one-model step of one grid point.

  Its hyperparameters are Python constants, compiled into the program.
  """
  loss_fn = step_lib.make_loss_fn(entry, {**fixed_hyper, **point})
  return step_lib.make_train_step(loss_fn, mode="none", base_key=base_key)


def make_sweep_embed(apply_fn, *, conv: str = "native"):
  """Jitted ``(stacked variables, images [b, ...]) -> [b, M, D]`` (eval mode).

  The model axis comes second so that ``circle_jax.train.loop.embed_source``
  (which masks and orders along the first axis) can embed a split with it.
  ``conv``: see :func:`make_sweep_step`.
  """
  _conv_context(conv)

  def one_model(variables, images):
    with _conv_context(conv):
      return apply_fn(variables, images, train=False).astype(jnp.float32)

  def f(variables, images):
    out = jax.vmap(one_model, in_axes=(0, None))(variables, images)
    return jnp.moveaxis(out, 0, 1)

  return jax.jit(f)


# ----------------------------------------------------------------------------
# The experiment.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
  """Everything built from a config before training.

  Attributes:
    config: the run's config.
    info: the dataset's ``DatasetSpec``.
    grid: the hyperparameter grid.
    entry: the loss registry entry.
    fixed_hyper: the config's loss hyperparameters (swept ones overridden).
    model: the Flax model.
    state: the single initial state (from ``loop.init_state``).
    base_key: the loss key of the step.
    train_source: the train split.
    test_source: the test split.
  """

  config: Any
  info: Any
  grid: Grid
  entry: Any
  fixed_hyper: Dict[str, Any]
  model: Any
  state: state_lib.TrainState
  base_key: jax.Array
  train_source: Any
  test_source: Any


def setup(config, grid: Grid) -> Setup:
  """Builds the data sources, the model and the initial state of a sweep.

  Raises:
    ValueError: a config the sweep does not support (validation split,
      multi-split evaluation) or a bad grid (:func:`check_grid`).
  """
  config_checks.check_config(config, device_count=1, process_count=1)
  if config.dataset.get("validation_fraction", 0.0):
    raise ValueError("The sweep reports the test metrics of the last step and "
                     "trains on all train classes; set "
                     "--config.dataset.validation_fraction=0.")
  info = data_lib.get_dataset_info(config.dataset.name)
  if len(info.eval_splits) != 1:
    raise ValueError(f"The sweep evaluates one test split; {info.name} has "
                     f"{info.eval_splits}.")
  data_dir = config.dataset.get("data_dir") or loop.default_data_dir()
  manual_dir = config.dataset.get("manual_dir") or None
  train_source = data_lib.load_split(info.name, info.train_split,
                                     data_dir=data_dir, manual_dir=manual_dir)
  test_source = data_lib.load_split(info.name, info.eval_splits[0],
                                    data_dir=data_dir, manual_dir=manual_dir)
  model = loop.build_model(config, "none")
  train_pre = loop.train_preprocess(config, info)
  state, entry, hyper, base_key = loop.init_state(config, model, info,
                                                  train_pre.output_shape)
  check_grid(entry, grid, hyper, embedding_dim=config.model.embedding_dim,
             num_classes=config_checks.num_classes(config, info))
  fixed = {k: v for k, v in hyper.items() if k not in grid.names}
  return Setup(config, info, grid, entry, fixed, model, state, base_key,
               train_source, test_source)


def read_batches(s: Setup, num_steps: int) -> List[dict]:
  """The batches of steps ``0 .. num_steps - 1`` (numpy), from one pipeline."""
  config = s.config
  if config.batch.get("sampler", "pk") == "random":
    sampler = data_lib.RandomSampler(len(s.train_source),
                                     batch_size=config.batch.size,
                                     seed=config.seed)
  else:
    sampler = data_lib.PKSampler(
        data_lib.split_labels(s.train_source),
        classes_per_batch=config.batch.classes_per_batch,
        images_per_class=config.batch.images_per_class, seed=config.seed)
  it = data_lib.train_iterator(
      s.train_source, sampler=sampler,
      preprocess=loop.train_preprocess(config, s.info),
      num_workers=config.dataset.get("num_workers", 0),
      num_threads=config.dataset.get("num_threads", 4))
  try:
    return [{"image": b["image"], "label": b["label"]}
            for b in (next(it) for _ in range(num_steps))]
  finally:
    it.close()


def _history(metrics: List[dict]) -> Dict[str, np.ndarray]:
  """Fetches per-step metrics: ``{name: [steps, ...]}`` (one host sync)."""
  fetched = jax.device_get(metrics)
  return {k: np.stack([np.asarray(m[k]) for m in fetched])
          for k in ("loss", "grad_norm", "finite")}


def train_vmapped(s: Setup, batches: Sequence[dict], *,
                  conv: str = "native"):
  """Trains every grid point at once with one compiled vmapped step.

  ``conv``: see :func:`make_sweep_step`.

  Returns:
    ``(states, history, timings)``: the stacked final state, ``{'loss',
    'grad_norm', 'finite'}`` each ``[steps, M]``, and ``{'compile_s',
    'train_s'}`` (wall seconds; compilation ahead of time, then the steps).
  """
  step = make_sweep_step(s.entry, s.fixed_hyper, base_key=s.base_key,
                         conv=conv)
  hyper = jax.device_put(s.grid.arrays())
  states = stacked_state(s.state, s.grid.size)
  t0 = time.perf_counter()
  compiled = step.lower(states, hyper, batches[0]).compile()
  t1 = time.perf_counter()
  metrics = []
  for batch in batches:
    states, m = compiled(states, hyper, batch)
    metrics.append(m)
  jax.block_until_ready((states, metrics))
  t2 = time.perf_counter()
  return states, _history(metrics), {"compile_s": t1 - t0, "train_s": t2 - t1}


def train_sequential(s: Setup, batches: Sequence[dict]):
  """Trains the grid one model at a time (the baseline of the vmapped run).

  Each point gets its own compiled ``make_train_step(mode="none")`` with its
  hyperparameters as constants, a fresh copy of the same initial state and
  the same batches.

  Returns:
    ``(states, history, timings)`` as :func:`train_vmapped` (the final states
    stacked), ``timings`` summed over the models, with ``per_model``.
  """
  finals, histories, per_model = [], [], []
  for point in s.grid.points():
    step = make_sequential_step(s.entry, s.fixed_hyper, point,
                                base_key=s.base_key)
    state = fresh_state(s.state)
    t0 = time.perf_counter()
    compiled = step.lower(state, batches[0]).compile()
    t1 = time.perf_counter()
    metrics = []
    for batch in batches:
      state, m = compiled(state, batch)
      metrics.append(m)
    jax.block_until_ready((state, metrics))
    t2 = time.perf_counter()
    per_model.append({"compile_s": t1 - t0, "train_s": t2 - t1})
    finals.append(state_lib.state_to_tree(state))
    histories.append(_history(metrics))
  states = s.state.replace(**stack_trees(finals))
  history = {k: np.stack([h[k] for h in histories], axis=1)
             for k in histories[0]}
  timings = {k: float(sum(t[k] for t in per_model))
             for k in ("compile_s", "train_s")}
  timings["per_model"] = per_model
  return states, history, timings


def embed_test_split(s: Setup, states: state_lib.TrainState, *,
                     conv: str = "native"):
  """``(embeddings [N, M, D], labels [N])`` of the test split for all models."""
  mesh = step_lib.make_mesh(jax.devices()[:1])
  return loop.embed_source(
      state_lib.model_variables(states), make_sweep_embed(s.model.apply, conv=conv),
      s.test_source,
      loop.eval_preprocess(s.config, s.info),
      batch_size=s.config.batch.get("eval_batch_size", 256), mesh=mesh)


def retrieval_per_model(embeddings: np.ndarray, labels: np.ndarray,
                        ks: Sequence[int]) -> List[Dict[str, float]]:
  """``retrieval_metrics`` of each model of ``[N, M, D]`` embeddings.

  A model whose embeddings are not finite (diverged) gets NaN metrics.
  """
  out = []
  for m in range(embeddings.shape[1]):
    emb = embeddings[:, m]
    if not np.all(np.isfinite(emb)):
      out.append({f"recall@{k}": float("nan") for k in ks} |
                 {"precision@1": float("nan"), "r_precision": float("nan"),
                  "map@r": float("nan")})
      continue
    metrics = eval_lib.retrieval_metrics(emb, labels, ks=ks)
    out.append({k: float(v) for k, v in metrics.items()
                if not k.startswith("num_")})
  return out


def evaluate(s: Setup, states: state_lib.TrainState, *,
             conv: str = "native"):
  """Test-split retrieval metrics of every model.

  Returns:
    ``(metrics per model, embeddings [N, M, D], wall seconds)``.
  """
  t0 = time.perf_counter()
  emb, labels = embed_test_split(s, states, conv=conv)
  ks = tuple(s.config.get("eval_ks", None) or s.info.ks)
  metrics = retrieval_per_model(emb, labels, ks)
  return metrics, emb, time.perf_counter() - t0


def leaf_differences(a: PyTree, b: PyTree) -> Dict[str, float]:
  """The largest ``|a - b|`` of every leaf of two trees, by key path."""
  b_leaves = dict(jax.tree_util.tree_leaves_with_path(b))
  return {jax.tree_util.keystr(path): float(np.max(np.abs(
      np.asarray(x, np.float64) - np.asarray(b_leaves[path], np.float64))))
          for path, x in jax.tree_util.tree_leaves_with_path(a)}


def compare_runs(vmapped: Mapping[str, Any],
                 sequential: Mapping[str, Any]) -> Dict[str, Any]:
  """How far the vmapped and the one-at-a-time models are apart.

  Args:
    vmapped, sequential: ``{'states', 'history', 'metrics', 'embeddings'}``
      of the two runs (stacked states, per-step history, per-model metrics,
      ``[N, M, D]`` test embeddings).

  Returns:
    ``max_param_diff`` and the leaf where it is (``max_param_leaf``), the
    largest difference over the BatchNorm statistics, the per-step training
    loss, the test embeddings, MAP@R and R@1, ``param_leaf_diffs``, and
    ``first_step_apart``: the first step (0-based) where a model's training
    losses differ by more than 1e-3 relative (None if never).
  """
  leaves = leaf_differences(vmapped["states"].params,
                            sequential["states"].params)
  worst = max(leaves, key=leaves.get)
  stats = leaf_differences(vmapped["states"].batch_stats,
                           sequential["states"].batch_stats)

  a, b = vmapped["history"]["loss"], sequential["history"]["loss"]
  rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-12)
  apart = np.nonzero(np.nanmax(rel, axis=1) > 1e-3)[0]

  def metric_diff(key):
    return float(np.nanmax([abs(x[key] - y[key]) for x, y in zip(
        vmapped["metrics"], sequential["metrics"])]))

  return {
      "max_param_diff": leaves[worst],
      "max_param_leaf": worst,
      "param_leaf_diffs": leaves,
      "max_param_abs": float(max(np.max(np.abs(np.asarray(x))) for x in
                                 jax.tree.leaves(vmapped["states"].params))),
      "max_batch_stats_diff": max(stats.values()) if stats else 0.0,
      "max_loss_diff": float(np.nanmax(np.abs(a - b))),
      "first_step_apart": int(apart[0]) if apart.size else None,
      "max_embedding_diff": float(np.nanmax(np.abs(
          vmapped["embeddings"] - sequential["embeddings"]))),
      "max_map_diff": metric_diff("map@r"),
      "max_r1_diff": metric_diff("recall@1"),
  }


# ----------------------------------------------------------------------------
# Output: heatmaps and the results file.
# ----------------------------------------------------------------------------


def grid_matrix(grid: Grid, values: Sequence[float]) -> np.ndarray:
  """Per-model values as a 2-D ``[rows, cols]`` array (a 1-D grid is 1 row)."""
  values = np.asarray(values, np.float64)
  shape = grid.shape if len(grid.shape) == 2 else (1, grid.size)
  return values.reshape(shape)


def _grid_table(grid: Grid, values: Sequence[float]) -> List[str]:
  mat = grid_matrix(grid, values)
  if len(grid.names) == 2:
    head = f"| {grid.names[0]} \\ {grid.names[1]} | " + " | ".join(
        f"{c:g}" for c in grid.values[1]) + " |"
    rows = [f"| {r:g} | " + " | ".join(f"{v:.4f}" for v in mat[i]) + " |"
            for i, r in enumerate(grid.values[0])]
  else:
    head = f"| {grid.names[0]} | " + " | ".join(
        f"{c:g}" for c in grid.values[0]) + " |"
    rows = ["| | " + " | ".join(f"{v:.4f}" for v in mat[0]) + " |"]
  return [head, "|" + " --- |" * (mat.shape[1] + 1)] + rows


def _seconds(x: float) -> str:
  return f"{x:.1f} s"


def results_markdown(result: Mapping[str, Any]) -> str:
  """The results file in Markdown.

  Setup, metric tables over the grid, per-model rows, timings and the
  vmapped-vs-sequential check (when present).
  """
  grid = Grid(tuple(result["grid"]["names"]),
              tuple(tuple(v) for v in result["grid"]["values"]))
  models = result["models"]
  lines = [f"# Sweep: {result['loss']} on {result['dataset']} "
           f"({' x '.join(grid.names)})", ""]
  lines += [f"Command: `{result['command']}`", ""]
  lines += [f"{result['num_models']} models trained as one vmapped program, "
            f"{result['steps']} steps each on the same batches (global batch "
            f"{result['batch_size']}), from the same initialisation (seed "
            f"{result['seed']}); fixed loss hyperparameters "
            f"{result['fixed_hyper']}; model {result['model']}; optimiser "
            f"{result['optimizer']}; vmapped convolutions "
            f"`{result.get('conv', 'native')}`. Metrics: the test split "
            f"({result['test_images']} images) at the last step, no model "
            "selection.", ""]
  if result.get("init_metrics"):
    init = result["init_metrics"]
    lines += [f"At initialisation (all models): R@1 {init['recall@1']:.4f}, "
              f"MAP@R {init['map@r']:.4f}.", ""]
  for key, fname, title in HEATMAPS:
    lines += [f"## {title}", "", f"![{title}]({fname})", ""]
    lines += _grid_table(grid, [m["metrics"][key] for m in models]) + [""]
  ks = [k for k in models[0]["metrics"] if k.startswith("recall@")]
  cols = list(grid.names) + ["final loss"] + ks + ["map@r", "r_precision"]
  lines += ["## Every model", "",
            "final loss: mean of the last 10 steps' training loss.", "",
            "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
  for m in models:
    vals = [f"{m['hyper'][n]:g}" for n in grid.names]
    vals.append(f"{m['final_loss']:.4f}" if m["finite"] else "non-finite")
    vals += [f"{m['metrics'][k]:.4f}" for k in ks + ["map@r", "r_precision"]]
    lines.append("| " + " | ".join(vals) + " |")
  lines.append("")
  t = result["timings"]
  lines += ["## Timings", "", result["machine"], "",
            "| what | vmapped (all models) | one model at a time (sum) |",
            "| --- | --- | --- |"]
  seq = t.get("sequential")
  vm = t["vmapped"]

  def row(name, key):
    other = _seconds(seq[key]) if seq else "not run"
    return f"| {name} | {_seconds(vm[key])} | {other} |"

  lines += [row("compilation", "compile_s"), row("training steps", "train_s")]
  if seq:
    lines.append(
        f"| compilation + steps | {_seconds(vm['compile_s'] + vm['train_s'])} "
        f"| {_seconds(seq['compile_s'] + seq['train_s'])} |")
  lines += ["", f"Reading the {result['steps']} batches once (shared by both): "
            f"{_seconds(t['read_batches_s'])}; evaluating all models "
            f"(vmapped embedding + metrics): {_seconds(t['eval_s'])}."]
  if seq:
    total = ((seq["compile_s"] + seq["train_s"]) /
             (vm["compile_s"] + vm["train_s"]))
    lines += ["", f"Speed-up of the vmapped grid: "
              f"{seq['train_s'] / vm['train_s']:.2f}x on the training steps, "
              f"{total:.2f}x with compilation."]
  check = result.get("sequential_check")
  if check:
    leaves = sorted(check["param_leaf_diffs"].items(), key=lambda kv: -kv[1])
    apart = check.get("first_step_apart")
    apart = "none" if apart is None else f"step {apart}"
    worst = ", ".join(f"`{k}` {v:.2g}" for k, v in leaves[:3])
    lines += ["", "## Vmapped vs one at a time", "",
              "The same grid trained both ways, in float32 (vmapped with "
              f"`{result.get('conv', 'native')}` convolutions, one at a time "
              "with the model's own):", "",
              f"- largest |parameter difference|: {worst} (median over the "
              f"leaves {np.median([v for _, v in leaves]):.2g}; largest "
              f"|parameter| {check['max_param_abs']:.3g});",
              f"- BatchNorm statistics: {check['max_batch_stats_diff']:.3g};",
              f"- training loss, every step and model: "
              f"{check['max_loss_diff']:.3g}; first step where a model's "
              f"two losses differ by more than 1e-3 (relative): "
              f"{apart};",
              f"- test embeddings: {check['max_embedding_diff']:.3g};",
              f"- MAP@R {check['max_map_diff']:.3g}, R@1 "
              f"{check['max_r1_diff']:.3g}.", "",
              "Differences of float32 rounding (here: grouped or unrolled "
              "against plain convolutions, traced against constant "
              "hyperparameters) grow during training where the dynamics "
              "amplify them, so after many steps the two sets of models are "
              "two runs of the same training that differ by rounding; the "
              "comparison that holds to float32 tolerance is the one of the "
              "first steps (tests/experiments/test_sweep.py). "
              "With Adam, a parameter whose gradient is zero up to rounding "
              "(the bias of a convolution followed by BatchNorm, which the "
              "normalisation cancels) moves by about the learning rate at "
              "every step, in the direction of the rounding noise, so two "
              "float32 runs can differ there by up to steps x learning rate. "
              "The training loss does not see it; the test embeddings do, a "
              "little, because BatchNorm's running mean (evaluation mode) "
              "lags behind those biases."]
  return "\n".join(lines) + "\n"


def _machine() -> str:
  from experiments import hostenv  # pylint: disable=g-import-not-at-top
  load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  return (f"Machine: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {jax.devices()[0].device_kind} "
          f"({jax.default_backend()}), jax {jax.__version__}; load average at "
          f"the end {load}; {hostenv.describe()}.")


def write_results(out_dir: str, result: Mapping[str, Any]) -> None:
  """Writes ``results.json``, ``results.md`` and the heatmaps to ``out_dir``."""
  from experiments import plots  # pylint: disable=g-import-not-at-top
  os.makedirs(out_dir, exist_ok=True)
  grid = Grid(tuple(result["grid"]["names"]),
              tuple(tuple(v) for v in result["grid"]["values"]))
  for key, fname, title in HEATMAPS:
    plots.write_heatmap(os.path.join(out_dir, fname), grid,
                  [m["metrics"][key] for m in result["models"]],
                  title=f"{result['loss']} on {result['dataset']}\n{title} "
                        f"after {result['steps']} steps")
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(result, f, indent=2, sort_keys=True, allow_nan=True)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(results_markdown(result))


def run_sweep(config, grid: Grid, *, num_steps: Optional[int] = None,
              compare_sequential: bool = False, eval_at_init: bool = True,
              conv: Optional[str] = None, command: str = "",
              log=print) -> Dict[str, Any]:
  """The whole job: reads the data, trains (and times) the grid, evaluates.

  Args:
    config: the training config (``experiments/configs/base.py``).
    grid: the hyperparameter grid.
    num_steps: training steps (default ``config.num_train_steps``).
    compare_sequential: also train the grid one model at a time, time it and
      compare the models (:func:`compare_runs`).
    eval_at_init: evaluate the common initial model too.
    conv: the vmapped program's convolutions (:func:`make_sweep_step`;
      default :func:`default_conv`). The sequential baseline always uses the
      model's own (``native``) convolutions.
    command: the command line, for the results file.
    log: progress output.

  Returns:
    The result dict that :func:`write_results` writes (JSON-serialisable).
  """
  conv = conv or default_conv()
  s = setup(config, grid)
  steps = int(num_steps or config.num_train_steps)
  log(f"{grid.size} models ({' x '.join(grid.names)}), {steps} steps, "
      f"loss {s.entry.name}, fixed {s.fixed_hyper}, conv {conv}")
  t0 = time.perf_counter()
  batches = jax.device_put(read_batches(s, steps))
  jax.block_until_ready(batches)
  timings = {"read_batches_s": time.perf_counter() - t0}
  log(f"read {steps} batches in {timings['read_batches_s']:.1f} s")
  init_metrics = None
  if eval_at_init:
    init_metrics = evaluate(s, stacked_state(s.state, 1), conv=conv)[0][0]
  states, history, timings["vmapped"] = train_vmapped(s, batches, conv=conv)
  log(f"vmapped: compile {timings['vmapped']['compile_s']:.1f} s, train "
      f"{timings['vmapped']['train_s']:.1f} s")
  metrics, emb, timings["eval_s"] = evaluate(s, states, conv=conv)
  check = None
  if compare_sequential:
    seq_states, seq_history, timings["sequential"] = train_sequential(
        s, batches)
    log(f"sequential: compile {timings['sequential']['compile_s']:.1f} s, "
        f"train {timings['sequential']['train_s']:.1f} s")
    seq_metrics, seq_emb, _ = evaluate(s, seq_states, conv="native")
    check = compare_runs(
        {"states": states, "history": history, "metrics": metrics,
         "embeddings": emb},
        {"states": seq_states, "history": seq_history,
         "metrics": seq_metrics, "embeddings": seq_emb})
  finite = history["finite"].all(axis=0)
  models = []
  for i, point in enumerate(grid.points()):
    models.append({
        "hyper": point,
        "finite": bool(finite[i]),
        "final_loss": float(np.mean(history["loss"][-10:, i])),
        "loss_history": history["loss"][:, i].tolist(),
        "metrics": metrics[i],
    })
  c = config
  return {
      "command": command,
      "dataset": s.info.name,
      "loss": s.entry.name,
      "model": f"{c.model.name} ({c.model.embedding_dim}-d)",
      "optimizer": f"{c.optim.name}, lr {c.optim.learning_rate:g}, loss-group "
                   f"multiplier {c.optim.lr_multipliers.get('loss', 1.0):g}",
      "seed": int(c.seed),
      "batch_size": config_checks.global_batch_size(c),
      "steps": steps,
      "conv": conv,
      "test_images": len(s.test_source),
      "grid": {"names": list(grid.names),
               "values": [list(v) for v in grid.values]},
      "num_models": grid.size,
      "fixed_hyper": dict(s.fixed_hyper),
      "init_metrics": init_metrics,
      "models": models,
      "timings": timings,
      "sequential_check": check,
      "machine": _machine(),
  }


# ----------------------------------------------------------------------------
# Command line.
# ----------------------------------------------------------------------------


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  grid = parse_grid(f.grid)
  result = run_sweep(
      f.config, grid, num_steps=f.steps,
      compare_sequential=f.compare_sequential, eval_at_init=f.eval_at_init,
      conv=None if f.conv == "auto" else f.conv,
      command="python -m experiments.sweep " + " ".join(sys.argv[1:]))
  write_results(f.out, result)
  print(results_markdown(result))


def _define_flags():
  from absl import flags  # pylint: disable=g-import-not-at-top
  from experiments import config_flag  # pylint: disable=g-import-not-at-top
  config_flag.DEFINE_config_file(
      "config", "experiments/configs/omniglot_small.py", "Training config.")
  flags.DEFINE_multi_string(
      "grid", None, "NAME=V1,V2,...: one axis of the grid (one or two).",
      required=True)
  flags.DEFINE_integer("steps", None,
                       "Training steps (default: config.num_train_steps).")
  flags.DEFINE_bool("compare_sequential", False,
                    "Also train the grid one model at a time and compare.")
  flags.DEFINE_bool("eval_at_init", True, "Evaluate the initial model too.")
  flags.DEFINE_enum("conv", "auto", ("auto",) + CONVS,
                    "Convolutions of the vmapped program; auto: unrolled on "
                    "CPU, native elsewhere.")
  flags.DEFINE_string("out", None, "Output folder.", required=True)


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  from experiments import hostenv  # pylint: disable=g-import-not-at-top
  hostenv.reexec_with_hugepage_malloc()  # CIRCLE_JAX_NO_HUGEPAGES=1: off.
  _define_flags()
  app.run(main)
