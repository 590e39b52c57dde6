"""The per-device train step with a named axis.

One function, :func:`train_step`, is written for one device holding a slice of
the global batch. The loss receives ``axis_name`` and returns the loss of the
*global* batch on every device, with exact gradients w.r.t. the local
embeddings (``circle_jax.ops.global_sum``). The placement
(:mod:`circle_jax.parallel`) compiles it for its mode and says whether the
parameter gradients still need a ``psum`` (``pmap``) or already are the sum
over devices (``shard_map``, whose transpose of the replicated parameters'
broadcast sums them).

``tests/train/test_step.py`` checks numerically that one device, ``shard_map``
and ``pmap`` reach the same parameters after several steps on the same global
batch.

BatchNorm statistics are computed per device (like PyTorch without SyncBN) and
averaged over devices after each step, so the stored statistics stay
replicated.

The step is (a) :func:`embed` (the model on this device's images) followed by
(b) the loss of the embeddings (``loss_fn``, a function of the embeddings,
labels and loss parameters). ``embed_chunk_size`` replaces (a)'s forward and
backward passes by chunked ones (:mod:`circle_jax.train.gradcache`); (b) is
the same either way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import chex
import jax
import jax.numpy as jnp
import optax

from circle_jax import losses as losses_lib
from circle_jax import ops
from circle_jax import parallel
from circle_jax.train import gradcache
from circle_jax.train import state as state_lib
from circle_jax.train import xbm as xbm_lib
from circle_jax.train.state import TrainState

PyTree = Any
AXIS = parallel.AXIS

@dataclasses.dataclass(frozen=True, eq=False)
class LossFn:
  """The step's loss: a registry entry with its hyperparameters bound once,
  when the step is built (:func:`make_loss_fn`).

  ``loss_fn(embeddings [b, D], labels [b], loss_params, *, key, axis_name,
  ref=None) -> scalar``; the step itself calls ``fn`` directly, with
  :meth:`arguments`, so that no adapter frame stands between the step and
  the loss.

  Attributes:
    entry: the ``circle_jax.losses.LossEntry``.
    fn: ``fn(embeddings, labels, *args, **kwargs)``: the entry's bound loss
      (:meth:`circle_jax.losses.LossEntry.bind`), averaged over the devices
      when the loss cannot see the global batch.
  """

  entry: Any
  fn: Callable[..., jax.Array]
  regularizers: Any = dataclasses.field(default_factory=dict)
  centers_per_class: int = 1
  more: tuple = ()

  def additions(self, embeddings, labels, loss_params, *, key, axis_name):
    """What the objective adds to the loss (``None``: nothing): the
    weighted terms of ``config.more_losses``
    (:func:`circle_jax.losses.multiple_losses`, each term its own
    :class:`LossFn` and class matrix) and the regularizers
    (:meth:`regularize`)."""
    total = self.regularize(embeddings, loss_params, axis_name=axis_name)
    if self.more:
      mats = loss_params.get(losses_lib.combine.MORE_LOSSES, {})
      terms = [losses_lib.Term(functools.partial(
          fn.with_additions, key=key, axis_name=axis_name), weight,
                               takes_params=True)
               for _, weight, fn in self.more]
      more = losses_lib.multiple_losses(
          embeddings, labels, [mats.get(k, {}) for k, _, _ in self.more],
          terms=terms)
      total = more if total is None else total + more
    return total

  def with_additions(self, embeddings, labels, loss_params, *, key,
                     axis_name):
    """The loss of the batch plus :meth:`additions` (a term of
    ``config.more_losses``, with its own regularizers)."""
    loss = self(embeddings, labels, loss_params, key=key, axis_name=axis_name)
    more = self.additions(embeddings, labels, loss_params, key=key,
                          axis_name=axis_name)
    return loss if more is None else loss + more

  def regularize(self, embeddings, loss_params, *, axis_name):
    """The config's regularizers of the embeddings and the class matrix
    (:func:`circle_jax.losses.regularizers.regularization`), added to the
    loss in the step's objective (once, also with a cross-batch memory);
    ``None`` without regularizers."""
    if not any(self.regularizers.get(k) for k in (
        "embedding_regularizer", "weight_regularizer")):
      return None
    name = self.entry.param_name
    return losses_lib.regularizers.regularization(
        self.regularizers, embeddings,
        None if name is None else loss_params[name],
        centers_per_class=self.centers_per_class, axis_name=axis_name)
  mined: bool = False
  extra: Optional[Callable] = None

  def arguments(self, loss_params, *, key, axis_name, ref=None):
    """``(args, kwargs)`` of :attr:`fn` after the embeddings and labels."""
    entry = self.entry
    args = () if entry.param_name is None else (
        loss_params[entry.param_name],)
    extra = {}
    if self.mined:  # with `ref`, the miner mines anchors x references
      extra = {"miner_key": key}
    if entry.supports_axis_name or axis_name is None:
      return args, {**entry.routed(key=key, axis_name=axis_name, ref=ref),
                    **extra}
    if ref is not None:
      raise ValueError(f"Loss {entry.name!r} cannot see the global batch, so "
                       "it cannot meet a memory sharded over the devices.")
    return args, {**entry.routed(key=key), "axis_name": axis_name, **extra}

  def __call__(self, embeddings, labels, loss_params, *, key, axis_name,
               ref=None):
    args, kwargs = self.arguments(loss_params, key=key, axis_name=axis_name,
                                  ref=ref)
    return self.fn(embeddings, labels, *args, **kwargs)


def make_loss_fn(entry, hyper: Optional[dict] = None, more=(),
                 miner: Optional[dict] = None,
                 more_miners: Optional[dict] = None,
                 extra: Optional[Callable] = None) -> LossFn:
  """Binds a ``circle_jax.losses`` registry entry and its hyperparameters for
  the step, once (unknown names and bad geometry fields fail here).

  Args:
    entry: a ``circle_jax.losses.LossEntry``.
    hyper: the loss hyperparameters (keyword arguments of ``entry.apply``)
      and its regularizers' fields
      (:data:`circle_jax.losses.regularizers.FIELDS`).
    more: ``[(key, entry, weight, hyper)]``, the terms added to the loss
      (``config_facts.more_losses``).
    miner: optional ``config.miner`` as a dict (``name``, ``""`` for none,
      and hyperparameters, ``None`` for the miner's default): the miner's
      masks of the (global) batch become the pair loss's ``pos_mask`` /
      ``neg_mask``; a sampling miner reads a stream of the step's key.
    more_miners: ``{key: miner}``, the miners of the terms of ``more``
      (``config_facts.more_loss_miners``), each as ``miner`` for its term
      alone (PML's ``MultipleLosses(miners=...)``).
    extra: optional hook for a loss that needs more of the model than the
      embeddings: ``extra(params, loss_state, batch, *, apply_fn, key,
      dropout_key, axis_name) -> (keywords, new loss_state)``, called in
      the step's objective (so its outputs carry gradient); the keywords
      go to the loss and ``loss_state`` is carried in the
      :class:`TrainState` (:mod:`circle_jax.train.semantic`).

  Returns:
    A :class:`LossFn`, called as ``loss_fn(embeddings, labels, loss_params,
    *, key, axis_name, ref=None)``; ``ref`` is the loss API's reference
    embeddings (a ``circle_jax.losses.Candidates``; the cross-batch
    memory's, :mod:`circle_jax.train.xbm`). Losses that cannot see the global
    batch are averaged over devices (the gradient of that mean is exact under
    both wrappers, via ``global_sum``).
  """
  hyper = dict(hyper or {})
  regularizers = {k: hyper.pop(k) for k in losses_lib.regularizers.FIELDS
                  if k in hyper}
  centers = hyper.get("centers_per_class", dict(
      getattr(entry, "defaults", {})).get("centers_per_class", 1))
  fn = entry.bind(**hyper)
  mine = _bind_miner(entry, miner)
  if mine is not None:
    fn = functools.partial(_mined, fn, mine)
  if not entry.supports_axis_name:
    fn = functools.partial(_device_mean, fn)
  more_miners = dict(more_miners or {})
  unknown = sorted(set(more_miners) - {k for k, *_ in more})
  if unknown:
    raise ValueError(f"`more_miners` names {unknown}, not terms of `more`.")
  more = tuple((k, weight, make_loss_fn(e, h, miner=more_miners.get(k)))
               for k, e, weight, h in more)
  return LossFn(entry, fn, regularizers, centers, more,
                mined=mine is not None, extra=extra)


def _bind_miner(entry, miner: Optional[dict]):
  """The bound miner of ``config.miner`` (None without one)."""
  miner = dict(miner or {})
  name = miner.pop("name", "")
  if not name:
    return None
  if entry.kind != "pair":
    raise ValueError(f"Loss {entry.name!r} is not a pair loss and takes no "
                     "miner masks: set miner.name=''.")
  return losses_lib.get_miner(name).bind(
      **{k: v for k, v in miner.items() if v is not None})


def _mined(loss, mine, embeddings, labels, *args, miner_key=None,
           axis_name=None, **kwargs):
  """``loss`` with the miner's masks of the (global) batch, or of the
  anchors against the references ``ref`` (the cross-batch memory) when the
  loss gets them."""
  pos_mask, neg_mask = mine(embeddings, labels, key=miner_key,
                            axis_name=axis_name, ref=kwargs.get("ref"))
  if axis_name is not None:
    kwargs["axis_name"] = axis_name
  return loss(embeddings, labels, *args, pos_mask=pos_mask,
              neg_mask=neg_mask, **kwargs)


def _device_mean(loss, embeddings, labels, *args, axis_name=None, **kwargs):
  """The mean over the devices of a loss that cannot see the global batch."""
  local = loss(embeddings, labels, *args, **kwargs)
  if axis_name is None:
    return local
  return ops.global_sum(local, axis_name) / jax.lax.psum(1, axis_name)


def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.stack(leaves).all() if leaves else jnp.array(True)


def _split(tree, sharded):
  """``(replicated leaves, sharded leaves)`` of a tree (by key path)."""
  pairs = jax.tree_util.tree_leaves_with_path(tree)
  if sharded is None:
    return [x for _, x in pairs], []
  return ([x for p, x in pairs if not sharded(p)],
          [x for p, x in pairs if sharded(p)])


def _reduce_grads(grads, *, axis_name, psum_grads, sharded):
  """``(grads, global norm, all finite)`` over the devices.

  ``psum_grads`` (pmap) sums the replicated leaves' gradients; the
  ``sharded`` leaves (a device's own rows, :mod:`circle_jax.train.class_rows`)
  keep their device's gradient, and their squares and finiteness are
  combined over the devices for the norm and the flag.
  """
  if axis_name is not None and psum_grads:
    grads = jax.tree_util.tree_map_with_path(
        lambda p, g: g if sharded is not None and sharded(p)
        else jax.lax.psum(g, axis_name), grads)
  replicated, own = _split(grads, sharded)
  if not own or axis_name is None:
    return grads, optax.global_norm(grads), _all_finite(grads)
  squares = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in own)
  norm = jnp.sqrt(optax.global_norm(replicated) ** 2
                  + jax.lax.psum(squares, axis_name))
  finite = jax.lax.pmin(_all_finite(own).astype(jnp.int32), axis_name) > 0
  return grads, norm, _all_finite(replicated) & finite


def check_batch(batch: dict) -> None:
  """Trace-time check: ``image [b, H, W, C]`` and ``label [b]`` agree."""
  if not isinstance(batch, dict) or not {"image", "label"} <= set(batch):
    raise ValueError("The train step's batch must be a dict with 'image' "
                     f"[b, H, W, C] and 'label' [b]; got {type(batch).__name__}"
                     f" {sorted(batch) if isinstance(batch, dict) else ''}.")
  try:
    chex.assert_rank([batch["image"], batch["label"]], [4, 1])
    chex.assert_equal_shape_prefix([batch["image"], batch["label"]], 1)
  except AssertionError as e:
    raise ValueError(
        f"The train step needs batch['image'] [b, H, W, C] and batch['label'] "
        f"[b] with the same b; got {jnp.shape(batch['image'])} and "
        f"{jnp.shape(batch['label'])}: pass one label per image (grayscale "
        f"images need a trailing channel axis of 1). ({e})") from None


def embed(apply_fn: Callable, model_params: PyTree, batch_stats: PyTree,
          images: jax.Array, *, dropout_key: Optional[jax.Array] = None):
  """The model in training mode on ``images``: part (a) of the step.

  Args:
    apply_fn: the model's ``apply`` (``TrainState.apply_fn``).
    model_params: ``params['model']``.
    batch_stats: the BatchNorm statistics (``{}`` without BatchNorm).
    images: ``[b, H, W, C]``.
    dropout_key: the ``'dropout'`` PRNG key of models with dropout or
      drop-path (the ViTs); models without them ignore it.

  Returns:
    ``(embeddings [b, D], new batch_stats)``.
  """
  variables = state_lib.model_variables(
      {"params": {"model": model_params}, "batch_stats": batch_stats})
  rngs = {} if dropout_key is None else {"dropout": dropout_key}
  if batch_stats:
    embeddings, updates = apply_fn(variables, images, train=True,
                                   mutable=["batch_stats"], rngs=rngs)
    return embeddings, updates.get("batch_stats", batch_stats)
  return apply_fn(variables, images, train=True, rngs=rngs), batch_stats


def train_step(
    state: TrainState,
    batch: dict,
    *,
    loss_fn: LossFn,
    base_key: jax.Array,
    axis_name: Optional[str] = None,
    psum_grads: bool = False,
    embed_chunk_size: int = 0,
    sharded=None,
):
  """One optimisation step on this device's slice of the global batch.

  Args:
    state: the (replicated) :class:`TrainState`; its cross-batch memory, if
      any, is this device's rows (:mod:`circle_jax.train.xbm`).
    batch: ``{'image': [b, H, W, C], 'label': [b] int}``, this device's slice.
    loss_fn: see :func:`make_loss_fn`.
    base_key: PRNG key; the loss key of step ``t`` is ``fold_in(base_key, t)``,
      the same on every device.
    axis_name: the device axis (None on one device).
    psum_grads: sum parameter gradients over ``axis_name`` (``pmap`` only; see
      the module docstring).
    embed_chunk_size: 0, or embed this device's images this many at a time
      without keeping activations and re-run each chunk's forward pass in
      the backward pass (GradCache, :mod:`circle_jax.train.gradcache`; exact
      only without BatchNorm in training mode). The loss is unchanged.
    sharded: the placement's ``sharded(key path)`` predicate: parameters
      split by rows over the devices (a sharded class matrix,
      :mod:`circle_jax.train.class_rows`) keep their device's gradient,
      never summed over devices.

  Returns:
    ``(new_state, metrics)`` with scalar metrics ``loss`` (global batch),
    ``grad_norm`` and ``finite`` (loss and all gradients finite). The state is
    updated even when ``finite`` is False; the loop stops at the next check
    and never saves it.
  """
  check_batch(batch)
  if (state.loss_state is None) != (loss_fn.extra is None):
    raise ValueError(
        f"Loss {loss_fn.entry.name!r}: the state's loss_state and the loss's "
        "extra hook come together: build both from the config "
        "(run.init_state and make_loss_fn(..., extra=run.semantic_hook(...))).")
  key = jax.random.fold_in(base_key, state.step)
  # Dropout masks: a key of their own, different on every device (a chunked
  # embedding reuses it in both passes of a chunk, as it must).
  dropout_key = jax.random.fold_in(key, 1)
  if axis_name is not None:
    dropout_key = jax.random.fold_in(dropout_key,
                                     jax.lax.axis_index(axis_name))
  embed_fn = functools.partial(embed, state.apply_fn, dropout_key=dropout_key)
  if embed_chunk_size:
    embed_fn = gradcache.chunked(embed_fn, embed_chunk_size)

  def objective(params):
    # (a) the embeddings of this device's images; (b) the loss of them
    # (with the cross-batch memory's term, which also updates the memory).
    embeddings, new_stats = embed_fn(params["model"], state.batch_stats,
                                     batch["image"])
    reg = loss_fn.additions(embeddings, batch["label"], params["loss"],
                            key=key, axis_name=axis_name)
    extra, loss_state = {}, state.loss_state
    if loss_fn.extra is not None:  # e.g. VPTSP-G's semantic proxies
      extra, loss_state = loss_fn.extra(
          params, loss_state, batch, apply_fn=state.apply_fn, key=key,
          dropout_key=jax.random.fold_in(dropout_key, 2),
          axis_name=axis_name)
    if state.xbm is None:
      # The bound loss itself (not loss_fn's __call__): the step reaches the
      # loss in one frame.
      args, kwargs = loss_fn.arguments(params["loss"], key=key,
                                       axis_name=axis_name)
      loss = loss_fn.fn(embeddings, batch["label"], *args, **kwargs, **extra)
      return loss if reg is None else loss + reg, (new_stats, None,
                                                    loss_state)
    if extra:
      raise ValueError(f"Loss {loss_fn.entry.name!r} takes no cross-batch "
                       "memory: set xbm.size=0.")
    loss, memory = xbm_lib.loss_with_memory(
        loss_fn, state.xbm, embeddings, batch["label"], params["loss"],
        key=key, step=state.step, axis_name=axis_name)
    return loss if reg is None else loss + reg, (new_stats, memory,
                                                  loss_state)

  (loss, (new_stats, memory, loss_state)), grads = jax.value_and_grad(
      objective, has_aux=True)(state.params)
  grads, grad_norm, finite = _reduce_grads(
      grads, axis_name=axis_name, psum_grads=psum_grads, sharded=sharded)
  if axis_name is not None:
    new_stats = jax.lax.pmean(new_stats, axis_name)
  finite = jnp.isfinite(loss) & finite
  new_state = state.apply_gradients(grads=grads, batch_stats=new_stats,
                                    xbm=memory, loss_state=loss_state)
  metrics = {
      "loss": loss.astype(jnp.float32),
      "grad_norm": grad_norm,
      "finite": finite,
  }
  return new_state, metrics


# ----------------------------------------------------------------------------
# The compiled step.
# ----------------------------------------------------------------------------


def make_train_step(loss_fn: LossFn, *, base_key: jax.Array,
                    placement: parallel.Placement, donate: bool = True,
                    embed_chunk_size: int = 0, sharded=None):
  """:func:`train_step` compiled for a placement.

  Args:
    loss_fn: see :func:`make_loss_fn`.
    base_key: PRNG key of the loss (see :func:`train_step`).
    placement: a :class:`circle_jax.parallel.Placement`. The state must be
      ``placement.replicate``'d (with the same ``sharded``), the batch
      ``placement.shard_batch``'d.
    donate: donate the input state's buffers.
    embed_chunk_size: see :func:`train_step` (0: off).
    sharded: the state's leaves split by rows over the devices (default:
      the cross-batch memory's, ``xbm.is_sharded``; with a sharded class
      matrix :func:`circle_jax.train.class_rows.sharded_leaves`).

  Returns:
    ``step(state, batch) -> (state, metrics)``.
  """
  sharded = xbm_lib.is_sharded if sharded is None else sharded
  fn = functools.partial(train_step, loss_fn=loss_fn, base_key=base_key,
                         embed_chunk_size=embed_chunk_size, sharded=sharded)
  return placement.wrap_step(fn, donate=donate, sharded=sharded)
