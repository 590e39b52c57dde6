"""A registry entry: one loss by a short name, with its parameters' init.

Each loss module declares its entries next to the loss, as a module-level
``REGISTRY`` tuple of :func:`entry` (or :func:`classifier`) values: the paper,
the reduction, the kind and the initialiser of the learnable parameters (the
initialisers are here). :mod:`circle_jax.losses.registry` collects them.

``LossEntry.defaults`` are the hyperparameters' defaults, read from the
function's signature (a single source of truth); ``apply`` passes ``params``
positionally as the loss's class-vector argument (``param_name``), the PRNG
key to losses that sample (``needs_key``) and ``axis_name`` to losses that
support it, and rejects unknown hyperparameters by name. ``bind`` sets the
hyperparameters once (what the train step calls).

A pair loss that takes the shared ``geometry`` option has
``entry.geometry``, its default geometry's name; a config then gives the
geometry as fields: ``geometry`` (a name) and the geometries' own
(:data:`GEOMETRY_FIELDS`: the Poincaré ball's curvature ``c`` and clipping
radius ``r``; the ``lp`` and ``snr`` distances' ``p``, ``power`` and
``normalize_embeddings``), which ``apply`` turns into the geometry
(:func:`circle_jax.losses.hyperbolic.geometry_of`).

``entry.hyper_ranges`` are the documented ranges of the hyperparameters that
have one, read from the loss's rule (a single source of truth: the rule
enforces them for concrete values).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
from typing import Any, Callable, Dict, Mapping, Optional

import jax
import jax.numpy as jnp

from circle_jax.losses import class_shard
from circle_jax.losses import engine
from circle_jax.losses import hyperbolic as _hyperbolic
from circle_jax.losses import ranges

Array = jax.Array

KINDS = ("pair", "proxy", "classifier")
# Keyword arguments that are not hyperparameters: routed by `apply`, or
# arrays (miner masks / weights, softmax's optional bias).
_ROUTED = ("axis_name", "key", "ref")
_PER_BATCH = ("pos_mask", "neg_mask", "pair_weights", "bias")
# Execution options that do not change the loss (accepted by `apply`, not
# listed among the hyperparameter defaults): the blockwise engine and the
# device ring of the rule-based pair losses.
_EXECUTION = engine.EXECUTION_OPTIONS
# The config fields of the geometry option, with their defaults (the
# registered geometries' fields: the ball's c and r, the distances' p, power
# and normalize_embeddings; the name is the entry's default geometry).
GEOMETRY_FIELDS = types.MappingProxyType(engine.geometry_fields())
# The config fields of the `reduction` option (circle_jax.losses.engine.
# Reduction: the kind's name and its parameters) with their types; unset,
# the loss's own reduction and the Reduction's defaults.
REDUCTION_FIELDS = types.MappingProxyType({
    "reduction": str, "reduction_low": float, "reduction_high": float,
    "reduction_weights": tuple, "reduction_divisor": float})
# The layout of the class matrix of the proxy and classifier losses
# (circle_jax.losses.class_shard): the rows sharded over the devices and
# PartialFC's negative-class sampling; accepted by `apply`, not defaults.
_CLASS_LAYOUT = class_shard.CLASS_LAYOUT_OPTIONS


# ----------------------------------------------------------------------------
# Parameter initialisers: (key, num_classes, embedding_dim, **hyper) -> array.
# ----------------------------------------------------------------------------


def no_params(key, num_classes, embedding_dim, **hyper):
  del key, num_classes, embedding_dim, hyper
  return None


def normal(std):
  def init(key, num_classes, embedding_dim, **hyper):
    del hyper
    return std * jax.random.normal(key, (num_classes, embedding_dim),
                                   jnp.float32)
  return init


def subcenters_normal(std):
  """Normal ``[C K, D]`` sub-centres, class-major (``centers_per_class``)."""
  def init(key, num_classes, embedding_dim, *, centers_per_class, **hyper):
    del hyper
    return std * jax.random.normal(
        key, (num_classes * centers_per_class, embedding_dim), jnp.float32)
  return init


def kaiming_normal_fan_out(key, num_classes, embedding_dim, **hyper):
  """torch ``kaiming_normal_(mode='fan_out')`` of a ``[C, D]`` tensor."""
  del hyper
  std = math.sqrt(2.0 / num_classes)
  return std * jax.random.normal(key, (num_classes, embedding_dim),
                                 jnp.float32)


def glorot_uniform(key, num_classes, embedding_dim, **hyper):
  del hyper
  limit = math.sqrt(6.0 / (num_classes + embedding_dim))
  return jax.random.uniform(key, (num_classes, embedding_dim), jnp.float32,
                            -limit, limit)


def soft_triple_centers(key, num_classes, embedding_dim, *,
                         centers_per_class, **hyper):
  """Official ``kaiming_uniform_(a=sqrt(5))`` of the ``[D, C*K]`` fc weight:
  ``U(-1/sqrt(C K), 1/sqrt(C K))``, stored here as ``[C*K, D]``."""
  del hyper
  rows = num_classes * centers_per_class
  bound = 1.0 / math.sqrt(rows)
  return jax.random.uniform(key, (rows, embedding_dim), jnp.float32,
                            -bound, bound)


def margin_beta(key, num_classes, embedding_dim, **hyper):
  del key, embedding_dim, hyper
  return jnp.full((num_classes,), 1.2, jnp.float32)


# ----------------------------------------------------------------------------
# Entries.
# ----------------------------------------------------------------------------


# The keywords a loss's ``**name`` stands for: the pair losses' shared
# ``**options`` and the class matrix's ``**layout``.
_VAR_KEYWORDS = {
    "options": engine.OPTIONS,
    "layout": tuple(f.name for f in dataclasses.fields(class_shard.Layout)),
}


def _keywords(fn):
  """``fn``'s keyword-only names, with those its ``**options``
  (:data:`circle_jax.losses.engine.OPTIONS`) or ``**layout``
  (:class:`circle_jax.losses.class_shard.Layout`) stand for."""
  params = inspect.signature(fn).parameters
  names = [name for name, p in params.items()
           if p.kind is inspect.Parameter.KEYWORD_ONLY]
  for name, p in params.items():
    if p.kind is inspect.Parameter.VAR_KEYWORD:
      names += [o for o in _VAR_KEYWORDS[name] if o not in names]
  return names, params


def _signature_defaults(fn) -> Dict[str, Any]:
  _, params = _keywords(fn)
  return {
      name: p.default for name, p in params.items()
      if p.kind is inspect.Parameter.KEYWORD_ONLY
      and p.default is not inspect.Parameter.empty
      and name not in _ROUTED + _PER_BATCH + _EXECUTION + _CLASS_LAYOUT
  }


def _accepted_keywords(fn, execution_options):
  names, _ = _keywords(fn)
  extra = tuple(GEOMETRY_FIELDS) if "geometry" in names else ()
  if "reduction" in names:
    extra += tuple(f for f in REDUCTION_FIELDS if f != "reduction")
  return tuple(n for n in names if n not in _ROUTED
               and (n not in _EXECUTION or n in execution_options)) + extra


@dataclasses.dataclass(frozen=True)
class LossEntry:
  """One registered loss.

  Attributes:
    name: the registry key (what configs use).
    fn: the loss function ``fn(embeddings, labels[, params], **hyper)``.
    kind: ``"pair"`` (in-batch pairs), ``"proxy"`` (learnable proxies) or
      ``"classifier"`` (class weights with a softmax-style loss).
    param_name: the name of the loss's learnable argument (``"proxies"``,
      ``"class_weights"``, ``"centers"``, ``"beta"``) or ``None``.
    init_params: ``init_params(key, num_classes, embedding_dim, **hyper)``
      returns the initial parameter array (``None`` if the loss has none).
      ``hyper`` defaults to ``defaults`` (e.g. ``centers_per_class``).
    defaults: default hyperparameters (read-only), from ``fn``'s signature.
    supports_axis_name: whether ``fn`` computes a global-batch loss across
      devices when given ``axis_name``.
    needs_key: whether ``fn`` samples (takes a PRNG ``key``).
    paper: the reference.
    reduction: how the per-sample / per-pair terms are reduced.
    reduction_note: for a loss with the ``reduction`` option, its terms
      compared with PML's elements and the engines it runs on
      (docs/reductions.md; empty: read from the terms' rank).
    param_init: how ``init_params`` initialises, in words.
    execution_options: keyword options of ``fn`` that change how the loss is
      computed but not its value (``block_size``, ``collective``), accepted
      by ``apply``.
    hyper_ranges: the documented range
      (:class:`circle_jax.losses.ranges.HyperRange`) of each hyperparameter
      that has one (read-only; empty for a loss without documented ranges).
    supports_ref: whether ``fn`` takes reference embeddings (``ref``, a
      :class:`circle_jax.losses.Candidates`; every pair loss, no proxy or
      classifier loss).
    geometry: the name of the loss's default geometry if it takes the
      ``geometry`` option (every pair loss), else ``None``.
    shards_classes: whether ``fn`` takes its class matrix sharded over the
      devices (``shard_classes``, ``num_classes``; and ``sample_rate`` with
      the step's ``key`` where it samples negative classes):
      :mod:`circle_jax.losses.class_shard`.
    samples_classes: whether ``fn`` takes PartialFC's ``sample_rate`` (and
      then the step's ``key``, which ``apply`` passes on).
    layout_options: the fields of :class:`class_shard.Layout` that ``fn``
      takes (its ``**layout``), in the dataclass's order; what the config's
      loss section offers of them is read from here.
    raw_features: whether ``fn`` maps the head's features itself (HIER's
      exponential map onto the ball): with it among a config's losses the
      head does not L2-normalise (the cosine losses normalise themselves).
  """

  name: str
  fn: Callable[..., Array]
  kind: str
  param_name: Optional[str]
  init_params: Callable[..., Optional[Array]]
  defaults: Mapping[str, Any]
  supports_axis_name: bool
  needs_key: bool
  paper: str
  reduction: str = ""
  param_init: str = ""
  execution_options: tuple = ()
  hyper_ranges: Mapping[str, ranges.HyperRange] = dataclasses.field(
      default_factory=lambda: types.MappingProxyType({}))
  supports_ref: bool = False
  shards_classes: bool = False
  samples_classes: bool = False
  layout_options: tuple = ()
  geometry: Optional[str] = None
  raw_features: bool = False
  reduction_note: str = ""

  def geometry_defaults(self) -> Dict[str, Any]:
    """The config fields of the geometry option with their defaults
    (``geometry``, ``c``, ``r``); empty for a loss without it."""
    if self.geometry is None:
      return {}
    return {"geometry": self.geometry, **GEOMETRY_FIELDS}

  def reduction_fields(self) -> Dict[str, type]:
    """The config fields of the ``reduction`` option with their types
    (:data:`REDUCTION_FIELDS`); empty for a loss without it."""
    names, _ = _keywords(self.fn)
    return dict(REDUCTION_FIELDS) if "reduction" in names else {}

  def field_ranges(self) -> Dict[str, ranges.HyperRange]:
    """The ranges of every config field of the loss: ``hyper_ranges`` and,
    with the geometry option, the geometry fields' (the Poincaré ball's
    ``c`` and ``r``, the distances' ``p`` and ``power``)."""
    extra = ({**_hyperbolic.GEOMETRY_RANGES, **engine.geometry.DISTANCE_RANGES}
             if self.geometry is not None else {})
    return {**self.hyper_ranges, **extra}

  def apply(self, embeddings, labels, params=None, *, key=None,
            axis_name=None, ref=None, **hyper) -> Array:
    """Calls the loss uniformly.

    Args:
      embeddings: ``[B, D]`` float32 or bfloat16.
      labels: ``[B]`` integer labels.
      params: the loss's learnable array (``param_name``), or ``None`` for a
        parameter-free loss.
      key: PRNG key, used by losses with ``needs_key`` (``None`` there means
        no sampling) and ignored by the others, so a trainer may always pass
        one.
      axis_name: mapped axis for a global-batch loss; an error for losses
        without ``supports_axis_name``.
      ref: optional :class:`circle_jax.losses.Candidates`, reference
        embeddings (e.g. a cross-batch memory), forwarded to the loss; an
        error for losses without ``supports_ref``.
      **hyper: hyperparameter overrides (and per-batch ``pos_mask`` /
        ``neg_mask`` / ``pair_weights`` where the loss takes them).

    Returns:
      float32 scalar loss.
    """
    loss = self.bind(**hyper)
    if self.param_name is not None and params is None:
      raise ValueError(
          f"Loss {self.name!r} needs its `{self.param_name}`: create them with "
          f"`get_loss({self.name!r}).init_params(key, num_classes, "
          f"embedding_dim)` and pass them as `params`.")
    if self.param_name is None and params is not None:
      raise ValueError(
          f"Loss {self.name!r} has no learnable parameters; pass "
          f"`params=None`.")
    args = (embeddings, labels) + (
        () if self.param_name is None else (params,))
    return loss(*args, **self.routed(key=key, axis_name=axis_name, ref=ref))

  def bind(self, **hyper) -> Callable[..., Array]:
    """The loss with its hyperparameters checked and set, once.

    Args:
      **hyper: as :meth:`apply`.

    Returns:
      ``functools.partial(fn, **hyper)`` (no wrapper, so no Python frame
      between its caller and the loss), called as ``loss(embeddings, labels[,
      params], **routed)`` with ``routed`` from :meth:`routed`.
    """
    accepted = _accepted_keywords(self.fn, self.execution_options)
    unknown = sorted(set(hyper) - set(accepted))
    if unknown:
      raise ValueError(
          f"Loss {self.name!r} got unknown hyperparameter(s) {unknown}; it "
          f"accepts {sorted(accepted)}.")
    if self.geometry is not None and (
        isinstance(hyper.get("geometry"), str) or set(GEOMETRY_FIELDS) & set(
            hyper)):
      fields = {**self.geometry_defaults(), **hyper}
      hyper = {k: v for k, v in hyper.items() if k not in GEOMETRY_FIELDS}
      hyper["geometry"] = _hyperbolic.geometry_of(
          fields["geometry"], **{k: fields[k] for k in GEOMETRY_FIELDS})
    if set(REDUCTION_FIELDS) & set(hyper) and self.reduction_fields():
      hyper = _with_reduction(hyper)
    return functools.partial(self.fn, **hyper)

  def routed(self, *, key=None, axis_name=None, ref=None) -> Dict[str, Any]:
    """The per-call keywords of :meth:`bind`'s loss: ``axis_name``, ``ref``
    and ``key`` where the loss takes them (arguments as :meth:`apply`)."""
    routed = {}
    if axis_name is not None:
      if not self.supports_axis_name:
        raise ValueError(
            f"Loss {self.name!r} does not support `axis_name`; compute it on "
            f"the gathered global batch instead.")
      routed["axis_name"] = axis_name
    if ref is not None:
      if not self.supports_ref:
        raise ValueError(
            f"Loss {self.name!r} does not support reference embeddings "
            "(`ref`); only the pair losses do.")
      routed["ref"] = ref
    if self.needs_key or (self.samples_classes and key is not None):
      routed["key"] = key
    return routed


def _with_reduction(hyper: Dict[str, Any]) -> Dict[str, Any]:
  """``hyper`` with the config's reduction fields (:data:`REDUCTION_FIELDS`)
  made one :class:`circle_jax.losses.engine.Reduction` (a ``reduction``
  already a Reduction, or a name alone, is kept)."""
  hyper = dict(hyper)
  fields = {k: hyper.pop(k) for k in REDUCTION_FIELDS if k in hyper}
  kind = fields.pop("reduction", None)
  if not fields or not isinstance(kind, (str, type(None))):
    return {**hyper, "reduction": kind} if kind is not None else hyper
  if kind is None:
    raise ValueError(f"{sorted(fields)} given without `reduction`: name "
                     f"one of {engine.REDUCTIONS}.")
  defaults = engine.Reduction()
  return {**hyper, "reduction": engine.Reduction(
      kind=kind, low=fields.get("reduction_low"),
      high=fields.get("reduction_high"),
      weights=fields.get("reduction_weights"),
      divisor=fields.get("reduction_divisor", defaults.divisor))}


def classifier(name, fn, *, paper, init=normal(0.01),
                param_init="normal, std 0.01", needs_key=False):
  """The entry of a classifier loss: learnable ``class_weights``, the mean
  over the samples; ``needs_key``: it samples every step."""
  return entry(name, fn, "classifier", param_name="class_weights",
                init=init, param_init=param_init, paper=paper,
                reduction="mean over samples", needs_key=needs_key)


def entry(name, fn, kind, *, paper, reduction, param_name=None,
          init=no_params, param_init="", needs_key=False,
          rule=None, tiled=True, geometry=None,
          raw_features=False, reduction_note="") -> LossEntry:
  """A registry entry; ``rule``: the rule class whose ``ranges`` apply;
  ``tiled``: whether a pair loss runs on the tiled engines (``block_size``,
  ``collective``); ``geometry``: the default geometry's name when it is not
  the rule's (or cosine); ``raw_features``, ``reduction_note``: as
  :class:`LossEntry`."""
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}; got {kind!r}.")
  defaults = _signature_defaults(fn)
  documented = {} if rule is None else {
      k: r for k, r in rule.ranges.items() if k in defaults}
  names, _ = _keywords(fn)
  if "geometry" in names:  # the option's name, the Poincaré ball's c and r
    geometry = geometry or _geometry_name(
        getattr(rule, "geometry", engine.COSINE))

  @functools.wraps(init)
  def init_params(key, num_classes, embedding_dim, **hyper):
    merged = {**defaults, **hyper}
    return init(key, num_classes, embedding_dim, **merged)

  execution = tuple(o for o in _EXECUTION if o in names) if tiled else ()
  return LossEntry(
      name=name, fn=fn, kind=kind, param_name=param_name,
      init_params=init_params,
      defaults=types.MappingProxyType(defaults),
      supports_axis_name="axis_name" in names,
      needs_key=needs_key, paper=paper, reduction=reduction,
      param_init=param_init,
      execution_options=execution,
      hyper_ranges=types.MappingProxyType(documented),
      supports_ref="ref" in names, geometry=geometry,
      shards_classes="shard_classes" in names,
      samples_classes="sample_rate" in names,
      layout_options=tuple(f.name for f in dataclasses.fields(
          class_shard.Layout) if f.name in names),
      raw_features=raw_features, reduction_note=reduction_note)


def _geometry_name(geometry) -> str:
  """The registered name of ``geometry``."""
  return next(n for n in engine.geometry_names()
              if engine.resolve_geometry(n) == geometry)
