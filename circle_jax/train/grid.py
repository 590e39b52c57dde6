"""A grid of loss hyperparameters trained as one program: jit(vmap(step)).

One model per point of a grid of loss hyperparameters (e.g. Circle's
``gamma x margin``, Sun et al., "Circle Loss: A Unified Perspective of Pair
Similarity Optimization", CVPR 2020, section 4.5), trained as a *single*
compiled program:

* the ``TrainState`` s are stacked (:func:`stacked_state`): every array of
  ``params``, ``opt_state``, ``batch_stats`` and ``step`` gets a leading model
  axis of size ``grid.size``; all models start from the same initialisation,
  so the only difference between them is their hyperparameters;
* the swept hyperparameters are float32 arrays ``[grid.size]``
  (:meth:`Grid.arrays`), vmapped with the state, so inside the step they are
  traced scalars, not Python constants; the other hyperparameters of the
  loss stay constants (:func:`check_grid` checks every point with Python
  floats, since the losses' own range checks cannot see traced values);
* one ``jax.jit(jax.vmap(train_step))`` updates all models on the same batch
  (:func:`make_sweep_step`; the batch is not vmapped: one data pipeline
  feeds the grid), and :func:`make_sweep_embed` embeds a batch for all models.

:func:`train_sequential` trains the same grid one model at a time with the
unvmapped step (one compilation per point, the hyperparameters as Python
constants), the baseline that :func:`compare_runs` measures the vmapped
models against.

Convolutions under ``vmap``: a convolution whose input and kernel both carry
the model axis becomes one grouped convolution, which XLA:CPU runs 2-6x slower
than the same convolutions one by one (measured on conv4's layers). With
``conv="unrolled"`` (the CPU default, :func:`default_conv`) the vmapped step
runs the model's ``nn.Conv`` s with a batching rule that unrolls the
convolutions over the models (:func:`unrolled_conv`): the same values, one
program. ``conv="native"`` keeps JAX's grouped convolution (the default on
GPU/TPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import flax.linen as nn
import jax
from jax import custom_batching
import jax.numpy as jnp
import numpy as np

from circle_jax import evaluation as eval_lib
from circle_jax import losses as losses_lib
from circle_jax import parallel
from circle_jax.train import state as state_lib
from circle_jax.train import step as step_lib

PyTree = Any
CONVS = ("native", "unrolled")
# The grid's placement: one device, the models vmapped (not sharded).
# experiments/sweep.py builds its model and embeds with it too.
PLACEMENT = parallel.SingleDevice()


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

  def matrix(self, values: Sequence[float]) -> np.ndarray:
    """Per-model values as a 2-D ``[rows, cols]`` array (1-D grid: 1 row)."""
    values = np.asarray(values, np.float64)
    shape = self.shape if len(self.shape) == 2 else (1, self.size)
    return values.reshape(shape)

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
      a point the loss rejects, or a class matrix sharded over devices.
  """
  if fixed_hyper.get("shard_classes"):
    raise ValueError(
        "loss.shard_classes: the sweep trains every grid point on one device "
        "(no device axis to shard the class matrix over); unset "
        "--config.loss.shard_classes.")
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
  # The regularizers' fields are the step's (make_loss_fn), not the loss's.
  fixed_hyper = {k: v for k, v in fixed_hyper.items()
                 if k not in losses_lib.regularizers.FIELDS}
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


@dataclasses.dataclass
class GridProblem:
  """What training a grid needs: the models' common start and their loss.

  Attributes:
    grid: the hyperparameter grid.
    entry: the ``circle_jax.losses`` registry entry.
    fixed_hyper: the loss hyperparameters that are not swept (constants).
    state: the single initial ``TrainState`` (every model starts from it).
    base_key: the loss key of :func:`circle_jax.train.step.train_step`.
  """

  grid: Grid
  entry: Any
  fixed_hyper: Dict[str, Any]
  state: state_lib.TrainState
  base_key: jax.Array


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
  return step_lib.make_train_step(loss_fn, placement=PLACEMENT,
                                 base_key=base_key)


def make_sweep_embed(apply_fn, *, conv: str = "native"):
  """Jitted ``(stacked variables, images [b, ...]) -> [b, M, D]`` (eval mode).

  The model axis comes second so that
  ``circle_jax.evaluation.embedding.embed_split`` (which masks and orders
  along the first axis) can embed a split with it.
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



def _history(metrics: List[dict]) -> Dict[str, np.ndarray]:
  """Fetches per-step metrics: ``{name: [steps, ...]}`` (one host sync)."""
  fetched = jax.device_get(metrics)
  return {k: np.stack([np.asarray(m[k]) for m in fetched])
          for k in ("loss", "grad_norm", "finite")}


def _compile_and_train(step, state, batches: Sequence[dict], *args):
  """Compiles ``step(state, *args, batch)`` ahead of time, then runs it on
  every batch; returns ``(state, history, {'compile_s', 'train_s'})``."""
  t0 = time.perf_counter()
  compiled = step.lower(state, *args, batches[0]).compile()
  t1 = time.perf_counter()
  metrics = []
  for batch in batches:
    state, m = compiled(state, *args, batch)
    metrics.append(m)
  jax.block_until_ready((state, metrics))
  t2 = time.perf_counter()
  return state, _history(metrics), {"compile_s": t1 - t0, "train_s": t2 - t1}


def train_vmapped(s: GridProblem, batches: Sequence[dict], *,
                  conv: str = "native"):
  """Trains every grid point at once with one compiled vmapped step.

  Every model starts from ``s.state`` and sees the same ``batches``
  (``{'image', 'label'}`` arrays, one per step). ``conv``: see
  :func:`make_sweep_step`.

  Returns:
    ``(states, history, timings)``: the stacked final state, ``{'loss',
    'grad_norm', 'finite'}`` each ``[steps, M]``, and ``{'compile_s',
    'train_s'}`` (wall seconds; compilation ahead of time, then the steps).
  """
  step = make_sweep_step(s.entry, s.fixed_hyper, base_key=s.base_key,
                         conv=conv)
  hyper = jax.device_put(s.grid.arrays())
  return _compile_and_train(step, stacked_state(s.state, s.grid.size),
                            batches, hyper)


def train_sequential(s: GridProblem, batches: Sequence[dict]):
  """Trains the grid one model at a time (the baseline of the vmapped run).

  Each point gets its own compiled :func:`make_sequential_step` with its
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
    state, history, timings = _compile_and_train(step, fresh_state(s.state),
                                                 batches)
    per_model.append(timings)
    finals.append(state_lib.state_to_tree(state))
    histories.append(history)
  states = s.state.replace(**stack_trees(finals))
  history = {k: np.stack([h[k] for h in histories], axis=1)
             for k in histories[0]}
  timings = {k: float(sum(t[k] for t in per_model))
             for k in ("compile_s", "train_s")}
  timings["per_model"] = per_model
  return states, history, timings



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
