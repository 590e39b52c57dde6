"""The loss registry: every loss by a short name, collected from the loss
modules.

Configs select a loss by name; a trainer looks the entry up and calls every
loss the same way::

    entry = get_loss("proxy_anchor")
    params = entry.init_params(key, num_classes, embedding_dim)   # or None
    loss = entry.apply(embeddings, labels, params, key=step_key,
                       axis_name=axis_name, **config_overrides)

or binds the hyperparameters once (``entry.bind(**config_overrides)``, what
the train step does). Each loss module declares its entries next to its
losses (``REGISTRY``: paper, reduction, kind, initialiser;
:mod:`circle_jax.losses.entries`); this module only collects them, in the
order of :data:`LOSSES` (that of the table in ``docs/losses.md``).

:func:`hyper_ranges` gives the documented ranges of a loss's
hyperparameters, read from its rule; :func:`validate_hyper` checks a
config's values against them by name. :func:`loss_table_markdown` renders
the table of ``docs/losses.md``.
"""

from __future__ import annotations

import types
from typing import Mapping

from circle_jax.losses import circle
from circle_jax.losses import classification
from circle_jax.losses import contrastive
from circle_jax.losses import entries
from circle_jax.losses import fastap
from circle_jax.losses import generalized_lifted_structure
from circle_jax.losses import intra_pair_variance
from circle_jax.losses import lifted_structure
from circle_jax.losses import margin
from circle_jax.losses import multi_similarity
from circle_jax.losses import nca
from circle_jax.losses import angular
from circle_jax.losses import n_pair
from circle_jax.losses import nt_xent
from circle_jax.losses import pairwise_ce
from circle_jax.losses import pairwise_sigmoid
from circle_jax.losses import proxy_anchor
from circle_jax.losses import proxy_baselines
from circle_jax.losses import ranges
from circle_jax.losses import ranked_list
from circle_jax.losses import recall_at_k
from circle_jax.losses import smooth_ap
from circle_jax.losses import snr_contrastive
from circle_jax.losses import supcon
from circle_jax.losses import triplet
from circle_jax.losses import tuplet_margin
from circle_jax.losses import large_margin
from circle_jax.losses import p2s_grad
from circle_jax.losses import vicreg
from circle_jax.losses import tcm
from circle_jax.losses import pnp
from circle_jax.losses import manifold
from circle_jax.losses import instance
from circle_jax.losses import histogram
from circle_jax.losses import dynamic_soft_margin
from circle_jax.losses import potential_field
from circle_jax.losses import hier
from circle_jax.losses import vptsp

LossEntry = entries.LossEntry
GEOMETRY_FIELDS = entries.GEOMETRY_FIELDS
KINDS = entries.KINDS

# The loss modules, in the order of their entries in LOSSES: the pair
# similarity losses of the Circle, MS and RLL papers and (Ranked)
# Proxy-Anchor; the pair baselines; the softmax-contrastive and sigmoid pair
# losses; the ranking surrogates; the proxy baselines; classification.
_MODULES = (circle, multi_similarity, ranked_list, proxy_anchor, contrastive,
            triplet, lifted_structure, n_pair, margin, supcon, nt_xent,
            pairwise_ce, pairwise_sigmoid, smooth_ap, fastap,
            proxy_baselines, classification)
_MODULES += (nca, angular, generalized_lifted_structure,
             intra_pair_variance, snr_contrastive, tuplet_margin)
_MODULES += (large_margin, p2s_grad, vicreg, tcm, pnp, manifold)
_MODULES += (instance, histogram, dynamic_soft_margin)
_MODULES += (potential_field,)  # issue 41
_MODULES += (hier,)
_MODULES += (recall_at_k,)
_MODULES += (vptsp,)

LOSSES: Mapping[str, LossEntry] = types.MappingProxyType(
    {e.name: e for module in _MODULES for e in module.REGISTRY})


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
