"""The miners by name: ``--config.miner.name`` to a miner of
:mod:`circle_jax.losses.miners` or :mod:`circle_jax.losses.pml_miners`, with
its hyperparameters bound (:meth:`MinerEntry.bind`)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, Tuple

import jax

from circle_jax.losses import miners
from circle_jax.losses.pml_miners import (
    angular_miner,
    batch_easy_hard_miner,
    hdc_miner,
    triplet_margin_miner,
    uniform_histogram_miner,
)

Array = jax.Array


# The stream of the step's key that a sampling miner reads (the loss reads
# the key itself).
_MINER_STREAM = 0x6D696E


@dataclasses.dataclass(frozen=True)
class MinerEntry:
  """A miner by name.

  Attributes:
    name: the registry key (``--config.miner.name``).
    fn: the miner, ``fn(embeddings, labels[, key], **hyper, axis_name=)``.
    needs_key: whether ``fn`` samples (takes a PRNG ``key``).
    returns_weights: whether ``fn`` returns ``pair_weights`` (draw counts)
      rather than ``(pos_mask, neg_mask)``.
  """

  name: str
  fn: Callable[..., Any]
  needs_key: bool = False
  returns_weights: bool = False

  @property
  def defaults(self) -> Dict[str, Any]:
    """The hyperparameters with their defaults (``fn``'s keyword-only
    arguments but ``axis_name``)."""
    params = inspect.signature(self.fn).parameters.values()
    return {p.name: p.default for p in params
            if p.kind is p.KEYWORD_ONLY and p.name not in ("axis_name", "ref")}

  @property
  def takes_ref(self) -> bool:
    """Whether the miner mines against reference embeddings (``ref``)."""
    return "ref" in inspect.signature(self.fn).parameters

  def bind(self, **hyper) -> Callable[..., Tuple[Array, Array]]:
    """``masks(embeddings, labels, *, key=None, axis_name=None, ref=None) ->
    (pos_mask, neg_mask)`` with ``hyper`` bound; a weight miner's masks are
    its pairs drawn at least once (both masks ``w > 0``: the loss
    intersects them with its label masks).

    Raises:
      ValueError: a hyperparameter this miner does not take.
    """
    unknown = sorted(set(hyper) - set(self.defaults))
    if unknown:
      raise ValueError(f"miner {self.name!r} has no hyperparameter(s) "
                       f"{unknown}; it takes {sorted(self.defaults)}.")

    def masks(embeddings, labels, *, key=None, axis_name=None, ref=None):
      args = ()
      if self.needs_key:
        if key is None:
          raise ValueError(f"miner {self.name!r} samples: pass a PRNG key.")
        args = (jax.random.fold_in(key, _MINER_STREAM),)
      if ref is not None and not self.takes_ref:
        raise ValueError(f"miner {self.name!r} mines the batch only; it "
                         "takes no reference embeddings (`ref`).")
      refs = {} if ref is None else {"ref": ref}
      out = self.fn(embeddings, labels, *args, axis_name=axis_name, **hyper,
                    **refs)
      return (out > 0, out > 0) if self.returns_weights else out
    return masks


MINERS: Dict[str, MinerEntry] = {e.name: e for e in (
    MinerEntry("multi_similarity", miners.multi_similarity_miner),
    MinerEntry("batch_hard", miners.batch_hard_miner),
    MinerEntry("semi_hard", miners.semi_hard_miner),
    MinerEntry("pair_margin", miners.pair_margin_miner),
    MinerEntry("distance_weighted", miners.distance_weighted_miner,
               needs_key=True, returns_weights=True),
    MinerEntry("angular", angular_miner),
    MinerEntry("batch_easy_hard", batch_easy_hard_miner),
    MinerEntry("hdc", hdc_miner),
    MinerEntry("triplet_margin", triplet_margin_miner),
    MinerEntry("uniform_histogram", uniform_histogram_miner, needs_key=True,
               returns_weights=True),
)}


def get_miner(name: str) -> MinerEntry:
  """The :data:`MINERS` entry ``name``; a one-line ValueError otherwise."""
  if name not in MINERS:
    raise ValueError(f"unknown miner {name!r}; the miners are "
                     f"{sorted(MINERS)}.")
  return MINERS[name]
