"""The Recall@K cut-offs the literature reports for each benchmark.

:data:`DEFAULT_KS` and :func:`default_ks` read them from the dataset registry
(``circle_jax.data.DATASETS[name].ks``, their only home).
"""

from __future__ import annotations

import collections.abc
from typing import Mapping, Tuple

__all__ = ["DEFAULT_KS", "default_ks"]


class _DatasetKs(collections.abc.Mapping):
  """Dataset name -> the Recall@K cut-offs the literature reports for it.

  A read-only view of ``circle_jax.data.DATASETS[name].ks``, their only home.
  The dataset registry (and tensorflow_datasets, which it imports) is loaded
  on first use, so that importing the evaluation does not.
  """

  def _datasets(self):
    from circle_jax.data import registry  # pylint: disable=g-import-not-at-top
    return registry.DATASETS

  def __getitem__(self, name: str) -> Tuple[int, ...]:
    return self._datasets()[name].ks

  def __iter__(self):
    return iter(self._datasets())

  def __len__(self) -> int:
    return len(self._datasets())

  def __repr__(self) -> str:
    return repr(dict(self))


# The Ks reported in the literature for each benchmark (from the registry).
DEFAULT_KS: Mapping[str, Tuple[int, ...]] = _DatasetKs()

_ALIASES = {
    "cub": "cub200",
    "cub_200": "cub200",
    "cub_200_2011": "cub200",
    "cub2011": "cub200",
    "cars": "cars196",
    "cars_196": "cars196",
    "stanford_cars": "cars196",
    "stanford_online_products": "sop",
    "online_products": "sop",
    "in_shop": "inshop",
    "deepfashion_inshop": "inshop",
    "deep_fashion_inshop": "inshop",
}


def default_ks(dataset_name: str) -> Tuple[int, ...]:
  """The Recall@K cut-offs the literature reports for a dataset.

  Args:
    dataset_name: one of ``DEFAULT_KS`` (case-insensitive; ``-`` and ``_``
      are interchangeable, and common long names such as
      ``stanford_online_products`` or ``cub_200_2011`` are accepted).

  Returns:
    A tuple of increasing positive ints, e.g. ``(1, 10, 100, 1000)`` for SOP.
  """
  if not isinstance(dataset_name, str):
    raise TypeError(
        f"`dataset_name` must be a str; got {type(dataset_name).__name__}."
    )
  name = dataset_name.strip().lower().replace("-", "_")
  name = _ALIASES.get(name, name)
  if name not in DEFAULT_KS:
    raise ValueError(
        f"No default Ks for dataset {dataset_name!r}; known datasets are "
        f"{sorted(DEFAULT_KS)}. Pass `ks=` explicitly."
    )
  return DEFAULT_KS[name]
