"""Optimisers with parameter groups, learning-rate schedules, warm-up and clipping.

The parameter tree is ``{'model': {'backbone': ..., 'head': ...}, 'loss': ...}``
(see :mod:`circle_jax.train.state`). Every leaf belongs to one of three groups:

* ``backbone``: ``params['model']`` except ``'head'`` (the pretrained trunk);
* ``head``: ``params['model']['head']`` (the embedding layer);
* ``loss``: ``params['loss']`` (proxies, class weights).

Each group gets the base learning rate times its multiplier (Proxy-Anchor
trains the proxies at x100). The update of a group is, as in PyTorch::

  u = -lr_group(t) * scale(g + wd * w)       # adam, sgd, rmsprop ("L2", coupled)
  u = -lr_group(t) * (scale(g) + wd * w)     # adamw (decoupled)

where ``scale`` is the optimiser's moment rescaling and ``t`` the global step.

"Warm-up epochs" in the DML codes (Proxy-Anchor: ``--warm 1``) train only the
head and the loss parameters: the backbone has ``requires_grad=False``, so
PyTorch neither moves it nor updates its optimiser moments. ``freeze_backbone_steps``
reproduces that exactly: during those steps the backbone's update is zero and
its optimiser state (moments and bias-correction count) is left untouched; the
learning-rate schedule runs on the global step, like PyTorch's ``LRScheduler``.
"""

from __future__ import annotations

import fnmatch
import inspect
import types
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from circle_jax import config as config_lib

PyTree = Any
GROUPS = ("backbone", "head", "loss")
OPTIMIZERS = ("adam", "adamw", "sgd", "rmsprop")
SCHEDULES = ("constant", "step", "cosine")
# The defaults of every keyword below are the training config's
# (circle_jax.config.optim_config), written there once.
DEFAULTS = config_lib.optim_config()


def path_keys(path) -> tuple:
  """The keys of a ``jax.tree_util`` key path (or of a tuple of names) as
  strings."""
  return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_group(path: tuple, frozen: frozenset = frozenset()) -> str:
  """The group (``backbone``, ``head``, ``loss`` or ``frozen``) of a path.

  Args:
    path: a key path into ``{'model': ..., 'loss': ...}``.
    frozen: paths under ``params['model']`` that never move (the BatchNorm
      scale/bias of a ``freeze_bn`` model, ``circle_jax.models.frozen_bn_paths``).
  """
  keys = path_keys(path)
  if keys and keys[0] == "loss":
    return "loss"
  if keys[1:] in frozen:
    return "frozen"
  if len(keys) > 1 and keys[0] == "model" and keys[1] == "head":
    return "head"
  return "backbone"


def _matches(keys: tuple, key: str) -> bool:
  """Whether a path (its keys) is under the prefix ``key`` or, for a key
  with a ``*``, ``?`` or ``[``, matches it as a glob pattern (``fnmatch``
  on the slash-joined path; ``*`` spans slashes)."""
  if any(c in key for c in "*?["):
    return fnmatch.fnmatchcase("/".join(keys), key)
  parts = tuple(key.split("/"))
  return keys[:len(parts)] == parts


def param_labels(params: PyTree, frozen: frozenset = frozenset(),
                 prefixes=()) -> PyTree:
  """A tree like ``params`` with each leaf replaced by its label: the most
  specific of the path ``prefixes`` (``'loss/hier'``) or glob patterns
  (``'model/backbone/*bias'``: every bias of the backbone) that matches it
  (the one with the most slash-separated parts, then the longest), else its
  group name. Frozen leaves stay ``frozen``.

  Raises:
    ValueError: a prefix or pattern that matches no leaf (a misspelt path).
  """
  ordered = sorted(prefixes, key=lambda k: (-k.count("/"), -len(k)))
  used = set()

  def label(path, _):
    group = param_group(path, frozen)
    keys = path_keys(path)
    for key in ordered:
      if _matches(keys, key):
        used.add(key)
        return group if group == "frozen" else key
    return group

  labels = jax.tree_util.tree_map_with_path(label, params)
  unused = sorted(set(prefixes) - used)
  if unused:
    raise ValueError(
        f"`optim.lr_multipliers` names {unused[0]!r}, which is above no "
        "parameter: a prefix is the slash-joined keys of the {'model', "
        "'loss'} parameter tree (e.g. 'loss/hier', or a glob pattern such "
        "as 'model/backbone/*bias'); check the spelling against the "
        "checkpoint's parameter names.")
  return labels


class FreezeState(NamedTuple):
  count: jax.Array  # int32, saturates at the number of frozen steps.
  inner: optax.OptState


def freeze_for_steps(
    inner: optax.GradientTransformation, num_steps: int
) -> optax.GradientTransformation:
  """Zero updates and a frozen ``inner`` state for the first ``num_steps`` calls.

  Equivalent to PyTorch's ``requires_grad=False`` for those steps: the
  parameters do not move and ``inner``'s state (e.g. Adam moments and their
  bias-correction count) starts evolving only at step ``num_steps``.
  """
  num_steps = int(num_steps)
  if num_steps <= 0:
    return inner

  def init_fn(params):
    return FreezeState(jnp.zeros([], jnp.int32), inner.init(params))

  def update_fn(updates, state, params=None):
    new_updates, new_inner = inner.update(updates, state.inner, params)
    frozen = state.count < num_steps
    new_updates = jax.tree.map(
        lambda u: jnp.where(frozen, jnp.zeros_like(u), u), new_updates)
    new_inner = jax.tree.map(
        lambda old, new: jnp.where(frozen, old, new), state.inner, new_inner)
    count = jnp.minimum(state.count + 1, num_steps)
    return new_updates, FreezeState(count, new_inner)

  return optax.GradientTransformation(init_fn, update_fn)


def make_schedule(
    learning_rate: float, *, schedule: str = DEFAULTS.schedule,
    num_train_steps: int = 1, lr_warmup_steps: int = DEFAULTS.lr_warmup_steps,
    decay_every_steps: int = DEFAULTS.decay_every_steps,
    decay_factor: float = DEFAULTS.decay_factor,
    cosine_final_fraction: float = DEFAULTS.cosine_final_fraction,
) -> optax.Schedule:
  """Learning rate as a function of the global step.

  Args:
    learning_rate: the peak (base) learning rate.
    schedule: ``constant``; ``step`` (multiply by ``decay_factor`` every
      ``decay_every_steps``, PyTorch's ``StepLR``); ``cosine`` (from the peak to
      ``cosine_final_fraction * learning_rate`` at ``num_train_steps``).
    num_train_steps: total steps (cosine horizon).
    lr_warmup_steps: linear ramp from 0 to the peak over these first steps.
    decay_every_steps: period of the step schedule.
    decay_factor: factor of the step schedule.
    cosine_final_fraction: final learning rate of the cosine, as a fraction.

  Returns:
    An optax schedule ``step -> learning rate``.
  """
  if schedule not in SCHEDULES:
    raise ValueError(
        f"Unknown `optim.schedule` {schedule!r}; use one of {SCHEDULES}.")
  if learning_rate < 0:
    raise ValueError(f"`optim.learning_rate` must be >= 0; got {learning_rate}.")
  warm = max(int(lr_warmup_steps), 0)
  if schedule == "constant":
    main = optax.constant_schedule(learning_rate)
  elif schedule == "step":
    if decay_every_steps <= 0:
      raise ValueError(
          "`optim.decay_every_steps` must be > 0 for the step schedule; got "
          f"{decay_every_steps}.")
    main = optax.exponential_decay(
        learning_rate, transition_steps=int(decay_every_steps),
        decay_rate=decay_factor, staircase=True)
  else:
    main = optax.cosine_decay_schedule(
        learning_rate, decay_steps=max(int(num_train_steps) - warm, 1),
        alpha=cosine_final_fraction)
  if warm == 0:
    return main
  ramp = optax.linear_schedule(0.0, learning_rate, warm)
  return optax.join_schedules([ramp, main], [warm])


# The fields of ``config.optim`` that :func:`make_schedule` reads (its
# keywords but ``num_train_steps``, which is ``config.num_train_steps``).
SCHEDULE_FIELDS = tuple(
    k for k in inspect.signature(make_schedule).parameters
    if k not in ("learning_rate", "num_train_steps"))


def _scale_transform(name: str, *, b1, b2, eps, momentum, nesterov, rms_decay):
  if name in ("adam", "adamw"):
    return optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
  if name == "sgd":
    return optax.trace(decay=momentum, nesterov=nesterov) if momentum else (
        optax.identity())
  if name == "rmsprop":
    # PyTorch RMSprop: g / (sqrt(v) + eps), v = a v + (1 - a) g^2, optional momentum.
    rms = optax.scale_by_rms(decay=rms_decay, eps=eps, eps_in_sqrt=False)
    if momentum:
      return optax.chain(rms, optax.trace(decay=momentum, nesterov=nesterov))
    return rms
  raise ValueError(f"Unknown `optim.name` {name!r}; use one of {OPTIMIZERS}.")


def make_optimizer(
    *,
    name: str = DEFAULTS.name,
    learning_rate: Union[float, optax.Schedule] = DEFAULTS.learning_rate,
    weight_decay: float = DEFAULTS.weight_decay,
    lr_multipliers: Optional[Mapping[str, float]] = types.MappingProxyType(
        DEFAULTS.lr_multipliers.to_dict()),
    freeze_backbone_steps: int = DEFAULTS.freeze_backbone_steps,
    frozen_paths=(),
    grad_clip_norm: float = DEFAULTS.grad_clip_norm,
    grad_clip_value: float = DEFAULTS.grad_clip_value,
    b1: float = DEFAULTS.b1,
    b2: float = DEFAULTS.b2,
    eps: float = DEFAULTS.eps,
    momentum: float = DEFAULTS.momentum,
    nesterov: bool = DEFAULTS.nesterov,
    rms_decay: float = DEFAULTS.rms_decay,
) -> optax.GradientTransformation:
  """Builds the optimiser for a ``{'model', 'loss'}`` parameter tree.

  The defaults are the training config's (:data:`DEFAULTS`, i.e.
  :func:`circle_jax.config.optim_config`: adam at ``1e-3``, ...).

  Args:
    name: ``adam``, ``adamw``, ``sgd`` or ``rmsprop`` (PyTorch semantics).
    learning_rate: the base learning rate (of the backbone group): a
      constant, or an optax schedule ``step -> lr`` (:func:`make_schedule`
      builds the config's; :func:`optimizer_from_config` passes it).
    weight_decay: L2 (coupled) for adam/sgd/rmsprop, decoupled for adamw.
    lr_multipliers: multipliers by group, keys among ``backbone``, ``head``,
      ``loss`` (missing groups get 1; default: 1 for every group), or by
      parameter-path prefix, a key with a slash (``'loss/hier'``,
      ``'model/backbone/prompt'``): every leaf under the longest matching
      prefix gets that multiplier instead of its group's (HIER's proxies
      at x50 beside Proxy-Anchor's at x1e4). A key with ``*`` is a glob
      pattern on the slash-joined path (``'model/backbone/*bias'``:
      BitFit's biases); see :func:`param_labels` for which key wins. A
      prefix or pattern under the backbone is frozen with it for
      ``freeze_backbone_steps``; a frozen path (``frozen_paths``) stays
      frozen whatever key matches it.
    freeze_backbone_steps: warm-up steps during which only ``head`` and
      ``loss`` are trained (see the module docstring).
    frozen_paths: key tuples under ``params['model']`` that are never updated
      (no gradient step, no weight decay, no optimiser moments): the
      BatchNorm affine parameters of a ``freeze_bn`` model, the ViT
      parameters that its ``tune`` (BitFit, prompt tuning) leaves fixed
      (:func:`circle_jax.models.frozen_module_paths`).
    grad_clip_norm: if > 0, clip the global gradient norm to this value.
    grad_clip_value: if > 0, clip each gradient entry to ``[-v, v]``
      (PyTorch's ``clip_grad_value_``, used by the Proxy-Anchor code).
    b1, b2, eps: Adam's moments and epsilon (eps is also RMSprop's).
    momentum, nesterov: SGD / RMSprop momentum.
    rms_decay: RMSprop's smoothing constant (PyTorch's ``alpha``).

  Returns:
    An ``optax.GradientTransformation``.
  """
  multipliers = {g: 1.0 for g in GROUPS}
  for key, value in dict(lr_multipliers or {}).items():
    if "/" in key:
      if key.split("/")[0] not in ("model", "loss") or "" in key.split("/"):
        raise ValueError(
            f"`optim.lr_multipliers` key {key!r} is not a parameter path: a "
            "prefix starts with 'model/' or 'loss/' (e.g. 'loss/hier').")
    elif key not in GROUPS:
      raise ValueError(
          f"Unknown parameter group {key!r} in `optim.lr_multipliers`; use "
          f"{GROUPS} or a parameter-path prefix such as 'loss/hier'.")
    multipliers[key] = float(value)
  prefixes = tuple(k for k in multipliers if "/" in k)
  if weight_decay < 0:
    raise ValueError(f"`optim.weight_decay` must be >= 0; got {weight_decay}.")
  if name not in OPTIMIZERS:
    raise ValueError(f"Unknown `optim.name` {name!r}; use one of {OPTIMIZERS}.")
  base = (learning_rate if callable(learning_rate)
          else make_schedule(learning_rate, schedule="constant"))

  def group_tx(label):
    scale = _scale_transform(name, b1=b1, b2=b2, eps=eps, momentum=momentum,
                             nesterov=nesterov, rms_decay=rms_decay)
    parts = []
    if weight_decay and name != "adamw":
      parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(scale)
    if weight_decay and name == "adamw":
      parts.append(optax.add_decayed_weights(weight_decay))
    inner = optax.chain(*parts)
    group = label if label in GROUPS else param_group(label.split("/"))
    if group == "backbone":
      inner = freeze_for_steps(inner, freeze_backbone_steps)
    mult = multipliers[label]
    lr: Callable = lambda step: base(step) * mult
    return optax.chain(inner, optax.scale_by_learning_rate(lr))

  chain = []
  if grad_clip_value and grad_clip_value > 0:
    chain.append(optax.clip(grad_clip_value))
  if grad_clip_norm and grad_clip_norm > 0:
    chain.append(optax.clip_by_global_norm(grad_clip_norm))
  frozen = frozenset(tuple(str(k) for k in p) for p in frozen_paths)
  transforms = {label: group_tx(label) for label in multipliers}
  if frozen:
    transforms["frozen"] = optax.set_to_zero()
  chain.append(optax.partition(
      transforms, lambda params: param_labels(params, frozen, prefixes)))
  return optax.chain(*chain)


def optimizer_from_config(optim_config, *, num_train_steps: int,
                          frozen_paths=()):
  """:func:`make_optimizer` from an ``ml_collections`` ``config.optim``.

  ``config.optim`` holds :func:`make_schedule`'s keyword arguments (but
  ``num_train_steps``, which comes from ``config.num_train_steps``) and
  :func:`make_optimizer`'s (but ``frozen_paths``); its ``learning_rate`` is
  the schedule's peak.
  """
  kwargs = dict(optim_config)
  kwargs["lr_multipliers"] = dict(kwargs.get("lr_multipliers") or {})
  schedule = make_schedule(kwargs.pop("learning_rate"),
                           num_train_steps=num_train_steps,
                           **{k: kwargs.pop(k) for k in SCHEDULE_FIELDS})
  return make_optimizer(learning_rate=schedule, frozen_paths=frozen_paths,
                        **kwargs)


def learning_rates(optim_config, num_train_steps: int) -> Callable[[int], dict]:
  """``step -> {group or path prefix: lr}`` for logging."""
  c = optim_config
  base = make_schedule(c.learning_rate, num_train_steps=num_train_steps,
                       **{k: c[k] for k in SCHEDULE_FIELDS})
  mult = {g: 1.0 for g in GROUPS}
  mult.update(dict(c.lr_multipliers))
  return lambda step: {g: float(base(step)) * float(m)
                       for g, m in mult.items()}
