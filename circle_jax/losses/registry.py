"""The loss registry: every loss by a short name, with its parameters' init.

Configs select a loss by name; a trainer looks the entry up and calls every
loss the same way::

    entry = get_loss("proxy_anchor")
    params = entry.init_params(key, num_classes, embedding_dim)   # or None
    loss = entry.apply(embeddings, labels, params, key=step_key,
                       axis_name=axis_name, **config_overrides)

``entry.defaults`` are the hyperparameters' defaults, read from the
function's signature (a single source of truth); ``apply`` passes ``params``
positionally as the loss's class-vector argument (``entry.param_name``), the
PRNG key to losses that sample (``needs_key``) and ``axis_name`` to losses
that support it, and rejects unknown hyperparameters by name.

A pair loss that takes the shared ``geometry`` option has
``entry.geometry``, its default geometry's name; a config then gives the
geometry as three fields, ``geometry`` (a name), ``c`` and ``r`` (the
Poincaré ball's curvature and clipping radius, :data:`GEOMETRY_FIELDS`),
which ``apply`` turns into the geometry
(:func:`circle_jax.losses.hyperbolic.geometry_of`).

``entry.hyper_ranges`` (also :func:`hyper_ranges`) are the documented ranges
of the hyperparameters that have one, read from the loss's rule (a single
source of truth: the rule enforces them for concrete values);
:func:`validate_hyper` checks a config's values against them by name.

:func:`loss_table_markdown` renders the table of ``docs/losses.md``.
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

from circle_jax.losses import circle as _circle
from circle_jax.losses import classification as _classification
from circle_jax.losses import contrastive as _contrastive
from circle_jax.losses import engine
from circle_jax.losses import hyperbolic as _hyperbolic
from circle_jax.losses import lifted_structure as _lifted
from circle_jax.losses import margin as _margin
from circle_jax.losses import multi_similarity as _multi_similarity
from circle_jax.losses import n_pair as _n_pair
from circle_jax.losses import nt_xent as _nt_xent
from circle_jax.losses import pairwise_ce as _pairwise_ce
from circle_jax.losses import pairwise_sigmoid as _pairwise_sigmoid
from circle_jax.losses import proxy_anchor as _proxy_anchor
from circle_jax.losses import proxy_baselines as _proxy
from circle_jax.losses import ranges
from circle_jax.losses import fastap as _fastap
from circle_jax.losses import ranked_list as _ranked_list
from circle_jax.losses import smooth_ap as _smooth_ap
from circle_jax.losses import supcon as _supcon
from circle_jax.losses import triplet as _triplet

Array = jax.Array

KINDS = ("pair", "proxy", "classifier")
# Keyword arguments that are not hyperparameters: routed by `apply`, or
# arrays (miner masks / weights, softmax's optional bias).
_ROUTED = ("axis_name", "key", "ref")
_PER_BATCH = ("pos_mask", "neg_mask", "pair_weights", "bias")
# Execution options that do not change the loss (accepted by `apply`, not
# listed among the hyperparameter defaults): the blockwise engine and the
# device ring of the rule-based pair losses.
_EXECUTION = ("block_size", "collective")
# The config fields of the geometry option (the ball's c and r; the name is
# the entry's default geometry).
GEOMETRY_FIELDS = types.MappingProxyType(
    {"c": _hyperbolic.DEFAULT_C, "r": _hyperbolic.DEFAULT_R})
# The layout of the class matrix of the proxy and classifier losses
# (circle_jax.losses.class_shard): the rows sharded over the devices and
# PartialFC's negative-class sampling; accepted by `apply`, not defaults.
_CLASS_LAYOUT = ("shard_classes", "num_classes", "sample_rate")


# ----------------------------------------------------------------------------
# Parameter initialisers: (key, num_classes, embedding_dim, **hyper) -> array.
# ----------------------------------------------------------------------------


def _no_params(key, num_classes, embedding_dim, **hyper):
  del key, num_classes, embedding_dim, hyper
  return None


def _normal(std):
  def init(key, num_classes, embedding_dim, **hyper):
    del hyper
    return std * jax.random.normal(key, (num_classes, embedding_dim),
                                   jnp.float32)
  return init


def _subcenters_normal(std):
  """Normal ``[C K, D]`` sub-centres, class-major (``centers_per_class``)."""
  def init(key, num_classes, embedding_dim, *, centers_per_class, **hyper):
    del hyper
    return std * jax.random.normal(
        key, (num_classes * centers_per_class, embedding_dim), jnp.float32)
  return init


def _kaiming_normal_fan_out(key, num_classes, embedding_dim, **hyper):
  """torch ``kaiming_normal_(mode='fan_out')`` of a ``[C, D]`` tensor."""
  del hyper
  std = math.sqrt(2.0 / num_classes)
  return std * jax.random.normal(key, (num_classes, embedding_dim),
                                 jnp.float32)


def _glorot_uniform(key, num_classes, embedding_dim, **hyper):
  del hyper
  limit = math.sqrt(6.0 / (num_classes + embedding_dim))
  return jax.random.uniform(key, (num_classes, embedding_dim), jnp.float32,
                            -limit, limit)


def _soft_triple_centers(key, num_classes, embedding_dim, *,
                         centers_per_class, **hyper):
  """Official ``kaiming_uniform_(a=sqrt(5))`` of the ``[D, C*K]`` fc weight:
  ``U(-1/sqrt(C K), 1/sqrt(C K))``, stored here as ``[C*K, D]``."""
  del hyper
  rows = num_classes * centers_per_class
  bound = 1.0 / math.sqrt(rows)
  return jax.random.uniform(key, (rows, embedding_dim), jnp.float32,
                            -bound, bound)


def _margin_beta(key, num_classes, embedding_dim, **hyper):
  del key, embedding_dim, hyper
  return jnp.full((num_classes,), 1.2, jnp.float32)


# ----------------------------------------------------------------------------
# Entries.
# ----------------------------------------------------------------------------


def _keywords(fn):
  """``fn``'s keyword-only names, with the pair options of ``**options``
  (:data:`circle_jax.losses.engine.OPTIONS`)."""
  params = inspect.signature(fn).parameters
  names = [name for name, p in params.items()
           if p.kind is inspect.Parameter.KEYWORD_ONLY]
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    names += [o for o in engine.OPTIONS if o not in names]
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
    param_init: how ``init_params`` initialises, in words.
    execution_options: keyword options of ``fn`` that change how the loss is
      computed but not its value (``block_size``, ``collective``), accepted
      by ``apply``.
    hyper_ranges: the documented range (:class:`HyperRange`) of each
      hyperparameter that has one (read-only; empty for a loss without
      documented ranges).
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
  hyper_ranges: Mapping[str, "HyperRange"] = dataclasses.field(
      default_factory=lambda: types.MappingProxyType({}))
  supports_ref: bool = False
  shards_classes: bool = False
  samples_classes: bool = False
  geometry: Optional[str] = None

  def geometry_defaults(self) -> Dict[str, Any]:
    """The config fields of the geometry option with their defaults
    (``geometry``, ``c``, ``r``); empty for a loss without it."""
    if self.geometry is None:
      return {}
    return {"geometry": self.geometry, **GEOMETRY_FIELDS}

  def field_ranges(self) -> Dict[str, "HyperRange"]:
    """The ranges of every config field of the loss: ``hyper_ranges`` and,
    with the geometry option, the Poincaré ball's ``c`` and ``r``."""
    extra = _hyperbolic.GEOMETRY_RANGES if self.geometry is not None else {}
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
    accepted = _accepted_keywords(self.fn, self.execution_options)
    unknown = sorted(set(hyper) - set(accepted))
    if unknown:
      raise ValueError(
          f"Loss {self.name!r} got unknown hyperparameter(s) {unknown}; it "
          f"accepts {sorted(accepted)}.")
    if self.param_name is not None and params is None:
      raise ValueError(
          f"Loss {self.name!r} needs its `{self.param_name}`: create them with "
          f"`get_loss({self.name!r}).init_params(key, num_classes, "
          f"embedding_dim)` and pass them as `params`.")
    if self.param_name is None and params is not None:
      raise ValueError(
          f"Loss {self.name!r} has no learnable parameters; pass "
          f"`params=None`.")
    if axis_name is not None:
      if not self.supports_axis_name:
        raise ValueError(
            f"Loss {self.name!r} does not support `axis_name`; compute it on "
            f"the gathered global batch instead.")
      hyper["axis_name"] = axis_name
    if ref is not None:
      if not self.supports_ref:
        raise ValueError(
            f"Loss {self.name!r} does not support reference embeddings "
            "(`ref`); only the pair losses do.")
      hyper["ref"] = ref
    if self.needs_key or (self.samples_classes and key is not None):
      hyper["key"] = key
    if self.geometry is not None and (
        isinstance(hyper.get("geometry"), str) or set(GEOMETRY_FIELDS) & set(
            hyper)):
      fields = {**self.geometry_defaults(), **hyper}
      hyper = {k: v for k, v in hyper.items() if k not in GEOMETRY_FIELDS}
      hyper["geometry"] = _hyperbolic.geometry_of(
          fields["geometry"], *(fields[k] for k in GEOMETRY_FIELDS))
    args = (embeddings, labels)
    if self.param_name is not None:
      args = args + (params,)
    return self.fn(*args, **hyper)


def _classifier(name, fn, *, paper, init=_normal(0.01),
                param_init="normal, std 0.01"):
  """The entry of a classifier loss: learnable ``class_weights``, the mean
  over the samples."""
  return _entry(name, fn, "classifier", param_name="class_weights",
                init=init, param_init=param_init, paper=paper,
                reduction="mean over samples")


def _entry(name, fn, kind, *, paper, reduction, param_name=None,
           init=_no_params, param_init="", needs_key=False,
           rule=None, tiled=True, geometry=None) -> LossEntry:
  """A registry entry; ``rule``: the rule class whose ``ranges`` apply;
  ``tiled``: whether a pair loss runs on the tiled engines (``block_size``,
  ``collective``); ``geometry``: the default geometry's name when it is not
  the rule's (or cosine)."""
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}; got {kind!r}.")
  defaults = _signature_defaults(fn)
  ranges = {} if rule is None else {
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
      hyper_ranges=types.MappingProxyType(ranges),
      supports_ref="ref" in names, geometry=geometry,
      shards_classes="shard_classes" in names,
      samples_classes="sample_rate" in names)


def _geometry_name(geometry) -> str:
  """The registered name of ``geometry``."""
  return next(n for n in engine.geometry_names()
              if engine.resolve_geometry(n) == geometry)


_CIRCLE_PAPER = ("Sun et al., \"Circle Loss: A Unified Perspective of Pair "
                 "Similarity Optimization\", CVPR 2020")
_BOTH_SETS = "mean over anchors with >= 1 positive and >= 1 negative"
_PROXY_ANCHOR_PAPER = (
    "Kim, Kim, Cho, Kwak, \"Proxy Anchor Loss for Deep Metric Learning\", "
    "CVPR 2020")

LOSSES: Mapping[str, LossEntry] = types.MappingProxyType({e.name: e for e in [
    # Pair-similarity losses of the Circle, MS and RLL papers, and
    # (Ranked) Proxy-Anchor.
    _entry("circle", _circle.circle_loss, "pair", rule=_circle.Circle,
           paper=_CIRCLE_PAPER + " (eq. 6)", reduction=_BOTH_SETS),
    _entry("unified", _circle.unified_loss, "pair", rule=_circle.Unified,
           paper=_CIRCLE_PAPER + " (eq. 1)", reduction=_BOTH_SETS),
    _entry("circle_class_level", _circle.circle_loss_class_level,
           "classifier", param_name="class_weights",
           init=_normal(0.01), param_init="normal, std 0.01",
           rule=_circle.Circle,
           paper="Sun et al., CVPR 2020 (class-level labels)",
           reduction="mean over samples"),
    _entry("multi_similarity", _multi_similarity.multi_similarity_loss,
           "pair", rule=_multi_similarity.MultiSimilarity,
           paper="Wang et al., \"Multi-Similarity Loss with General Pair "
                 "Weighting for Deep Metric Learning\", CVPR 2019",
           reduction="sum over anchors / batch size (mined-out anchors "
                     "count as 0)"),
    _entry("ranked_list", _ranked_list.ranked_list_loss, "pair",
           rule=_ranked_list.RankedList,
           paper="Wang et al., \"Ranked List Loss for Deep Metric "
                 "Learning\", CVPR 2019",
           reduction="mean over all anchors"),
    _entry("proxy_anchor", _proxy_anchor.proxy_anchor_loss, "proxy",
           param_name="proxies", init=_kaiming_normal_fan_out,
           param_init="kaiming normal, fan_out (std sqrt(2/C))",
           paper=_PROXY_ANCHOR_PAPER,
           reduction="positive term / #proxies with positives + negative "
                     "term / #classes"),
    _entry("ranked_proxy_anchor", _proxy_anchor.ranked_proxy_anchor_loss,
           "proxy", param_name="proxies", init=_kaiming_normal_fan_out,
           rule=_ranked_list.RankedList,
           param_init="kaiming normal, fan_out (std sqrt(2/C))",
           paper="Zhang, Chen, Hou, Yuan, Liu (Nanjing University of "
                 "Aeronautics and Astronautics), Ranked Proxy-Anchor loss "
                 "(Chinese-language journal paper; equations reconstructed "
                 "from its prose, Ranked List and Proxy-Anchor), built on " +
                 _PROXY_ANCHOR_PAPER,
           reduction="positive term / #proxies with positives + negative "
                     "term / #classes"),
    # Pair baselines.
    _entry("contrastive", _contrastive.contrastive_loss, "pair",
           rule=_contrastive.Contrastive,
           paper="Hadsell, Chopra, LeCun, CVPR 2006; two-margin form of "
                 "Musgrave et al., \"A Metric Learning Reality Check\", "
                 "ECCV 2020",
           reduction="mean over non-zero positive pairs + mean over "
                     "non-zero negative pairs"),
    _entry("triplet", _triplet.triplet_margin_loss, "pair", tiled=False,
           paper="Schroff et al., \"FaceNet\", CVPR 2015; Hermans et al., "
                 "\"In Defense of the Triplet Loss\", 2017",
           reduction="all: mean over non-zero triplets; batch_hard: mean "
                     "over anchors; semi_hard: mean over positive pairs"),
    _entry("lifted_structure", _lifted.lifted_structure_loss, "pair",
           paper="Oh Song et al., \"Deep Metric Learning via Lifted "
                 "Structured Feature Embedding\", CVPR 2016 (smooth form)",
           reduction="sum over ordered positive pairs of [J]_+^2 / (2 #pairs)"),
    _entry("n_pair", _n_pair.n_pair_loss, "pair", geometry="dot",
           paper="Sohn, \"Improved Deep Metric Learning with Multi-class "
                 "N-pair Loss Objective\", NeurIPS 2016",
           reduction="mean over positive pairs + l2_reg * mean squared "
                     "norm"),
    _entry("margin", _margin.margin_loss, "pair", param_name="beta",
           tiled=False,
           init=_margin_beta, param_init="constant 1.2 per class",
           needs_key=True,
           paper="Wu et al., \"Sampling Matters in Deep Embedding "
                 "Learning\", ICCV 2017",
           reduction="sum over (sampled) pairs / #pairs with non-zero "
                     "loss"),
    # Softmax-contrastive and sigmoid pair losses.
    _entry("supcon", _supcon.supcon_loss, "pair", rule=_supcon.SupCon,
           paper="Khosla et al., \"Supervised Contrastive Learning\", "
                 "NeurIPS 2020 (L_out, eq. 2)",
           reduction="mean over anchors with >= 1 positive"),
    _entry("nt_xent", _nt_xent.nt_xent_loss, "pair", rule=_nt_xent.NTXent,
           paper="Chen et al., \"A Simple Framework for Contrastive "
                 "Learning of Visual Representations\", ICML 2020; van den "
                 "Oord et al., arXiv 2018 (InfoNCE); labels give the views",
           reduction="mean over positive pairs"),
    _entry("pairwise_ce", _pairwise_ce.pairwise_ce_loss, "pair",
           rule=_nt_xent.NTXent, geometry="poincare",
           paper="Ermolov et al., \"Hyperbolic Vision Transformers: "
                 "Combining Improvements in Metric Learning\", CVPR 2022",
           reduction="mean over positive pairs"),
    _entry("pairwise_sigmoid", _pairwise_sigmoid.pairwise_sigmoid_loss,
           "pair", rule=_pairwise_sigmoid.PairwiseSigmoid,
           paper="Zhai et al., \"Sigmoid Loss for Language Image "
                 "Pre-Training\", ICCV 2023 (label positives, fixed t, b)",
           reduction="sum over pairs / batch size"),
    # Ranking surrogates (tiled, no B^3 tensor; no device ring).
    _entry("smooth_ap", _smooth_ap.smooth_ap_loss, "pair",
           rule=_smooth_ap.SmoothAP,
           paper="Brown, Xie, Kalogeiton, Zisserman, \"Smooth-AP: Smoothing "
                 "the Path Towards Large-Scale Image Retrieval\", ECCV 2020",
           reduction="mean over anchors with >= 1 positive"),
    _entry("fastap", _fastap.fastap_loss, "pair", rule=_fastap.FastAP,
           paper="Cakir, He, Xia, Kulis, Sclaroff, \"Deep Metric Learning "
                 "to Rank\", CVPR 2019",
           reduction="mean over anchors with >= 1 positive"),
    # Proxy baselines.
    _entry("proxy_nca", _proxy.proxy_nca_loss, "proxy",
           param_name="proxies", init=_normal(1.0),
           param_init="standard normal",
           paper="Movshovitz-Attias et al., \"No Fuss Distance Metric "
                 "Learning using Proxies\", ICCV 2017",
           reduction="mean over samples"),
    _entry("soft_triple", _proxy.soft_triple_loss, "proxy",
           param_name="centers", init=_soft_triple_centers,
           param_init="uniform +-1/sqrt(C K) (official kaiming_uniform, "
                      "a=sqrt(5)), [C K, D]",
           paper="Qian et al., \"SoftTriple Loss: Deep Metric Learning "
                 "Without Triplet Sampling\", ICCV 2019",
           reduction="mean over samples + tau * center regulariser"),
    # Classification.
    _classifier("normface", _classification.normface_loss,
                paper="Wang et al., \"NormFace: L2 Hypersphere Embedding "
                      "for Face Verification\", ACM MM 2017"),
    _classifier("cosface", _classification.cosface_loss,
                paper="Wang et al., \"CosFace: Large Margin Cosine Loss for "
                      "Deep Face Recognition\", CVPR 2018 (= AM-Softmax)"),
    _classifier("arcface", _classification.arcface_loss,
                param_init="normal, std 0.01 (insightface)",
                paper="Deng et al., \"ArcFace: Additive Angular Margin Loss "
                      "for Deep Face Recognition\", CVPR 2019"),
    _classifier("subcenter_arcface", _classification.subcenter_arcface_loss,
                init=_subcenters_normal(0.01),
                param_init="normal, std 0.01, [C K, D]",
                paper="Deng, Guo, Liu, Zafeiriou, Kotsia, \"Sub-center "
                      "ArcFace: Boosting Face Recognition by Large-scale "
                      "Noisy Web Faces\", ECCV 2020"),
    _classifier("softmax", _classification.softmax_loss,
                init=_glorot_uniform, param_init="glorot (xavier) uniform",
                paper="softmax cross-entropy on a linear classifier"),
]})


def get_loss(name: str) -> LossEntry:
  """The registry entry called ``name``; ValueError listing the known names."""
  try:
    return LOSSES[name]
  except (KeyError, TypeError):
    raise ValueError(
        f"Unknown loss {name!r}; known losses: {', '.join(sorted(LOSSES))}."
    ) from None


HyperRange = ranges.HyperRange


def hyper_ranges(name: str) -> Mapping[str, HyperRange]:
  """The documented range of each range-checked hyperparameter of a loss.

  Args:
    name: a registered loss name.

  Returns:
    ``{parameter: HyperRange(low, high, low_inclusive, high_inclusive)}``
    (read-only), empty for a loss without documented ranges.

  Raises:
    ValueError: for an unknown loss (as :func:`get_loss`).
  """
  return get_loss(name).hyper_ranges


def validate_hyper(name: str, **hyper) -> None:
  """Checks hyperparameter values of loss ``name`` against their ranges.

  The ranges are :meth:`LossEntry.field_ranges` (with the Poincaré ball's
  ``c`` and ``r`` for a pair loss). Names without a documented range are
  ignored (``LossEntry.apply`` rejects unknown names), and so are traced or
  non-numeric values.

  Raises:
    ValueError: for an unknown loss, or naming the first parameter outside
      its range, the loss and the range.
  """
  ranges.check_ranges(hyper, get_loss(name).field_ranges(), f"loss {name!r}")


def _format_default(value):
  if isinstance(value, str):
    return f'"{value}"'
  return repr(value)


def loss_table_markdown() -> str:
  """The Markdown table of every registered loss (kept in docs/losses.md)."""
  lines = [
      "| name | function | kind | parameters (init) | defaults | "
      "reduction | `axis_name` | paper |",
      "| --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for entry in LOSSES.values():
    params = (f"`{entry.param_name}`: {entry.param_init}"
              if entry.param_name else "none")
    if entry.needs_key:
      params += "; PRNG `key` (sampler)"
    defaults = ", ".join(f"`{k}={_format_default(v)}`"
                         for k, v in entry.defaults.items()) or "none"
    lines.append(
        f"| `{entry.name}` | `{entry.fn.__name__}` | {entry.kind} | {params} "
        f"| {defaults} | {entry.reduction} | "
        f"{'yes' if entry.supports_axis_name else 'no'} | {entry.paper} |")
  return "\n".join(lines) + "\n"
