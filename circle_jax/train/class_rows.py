"""The class matrix of the trainer's loss, sharded over the devices.

With ``config.loss.shard_classes`` the ``[C K, D]`` class matrix of a proxy
or classifier loss (its ``param_name`` in ``params['loss']``) and its
optimiser state (Adam's ``mu`` and ``nu``, SGD's momentum: every leaf of the
state whose key path ends in ``('loss', param_name)``) are split by rows
over the devices, as the cross-batch memory is (:mod:`circle_jax.train.xbm`):
:func:`ClassRows.sharded` is the ``sharded`` predicate of
:mod:`circle_jax.parallel`'s placements, the memory's rows included. The loss
then computes against its device's rows only
(:mod:`circle_jax.losses.class_shard`).

Host trees (the checkpoints, the evaluation's, a one-device run's) always
hold the whole matrix, ``C K`` rows, exactly as a one-device run has it:
the matrix is initialised whole with the run's key, and :meth:`ClassRows.pad`
lays it out for ``n`` devices (:func:`circle_jax.losses.pad_rows`: device
``d`` holds classes ``[d C_local, (d + 1) C_local)``, ``C_local = ceil(C /
n)``, zero padding rows at the end) just before the placement puts it on the
devices; :meth:`ClassRows.unpad` drops the padding when it comes back. So a
sharded run starts from the matrix of the one-device run, its checkpoints are
those of a one-device run, and a run saved on ``n`` devices resumes on any
other number (re-sharded by the next :meth:`~ClassRows.pad`), or unsharded.

Padding rows are outside every sum of the loss, so their gradient is exactly
zero and their optimiser state and contents stay zero.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from circle_jax.train import xbm as xbm_lib

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ClassRows:
  """The sharded class matrix of a run.

  Attributes:
    param_name: the loss's parameter (``entry.param_name``).
    num_classes: ``C``.
    per_class: ``K``, rows per class (``centers_per_class``; 1 for most).
  """

  param_name: str
  num_classes: int
  per_class: int = 1

  def is_rows(self, path) -> bool:
    """Whether a leaf is the class matrix or its optimiser state (its key
    path ends in ``('loss', param_name)``)."""
    return xbm_lib.key_names(path)[-2:] == ["loss", self.param_name]

  def sharded(self, path) -> bool:
    """The placements' ``sharded`` predicate: the class rows and the
    cross-batch memory's rows."""
    return self.is_rows(path) or xbm_lib.is_sharded(path)

  def pad(self, tree: PyTree, num_devices: int) -> PyTree:
    """A host tree with the whole matrix -> its rows laid out for
    ``num_devices`` (``n ceil(C / n) K`` rows, zero padding at the end)."""
    local = -(-self.num_classes // num_devices) * self.per_class
    rows = self.num_classes * self.per_class

    def pad(path, x):
      if not self.is_rows(path):
        return x
      x = np.asarray(x)
      if x.shape[0] != rows:
        raise ValueError(
            f"{jax.tree_util.keystr(path)} has {x.shape[0]} rows; the class "
            f"matrix has {rows} (C={self.num_classes} x K={self.per_class}).")
      out = np.zeros((local * num_devices,) + x.shape[1:], x.dtype)
      out[:rows] = x
      return out
    return jax.tree_util.tree_map_with_path(pad, tree)

  def unpad(self, tree: PyTree) -> PyTree:
    """The inverse of :meth:`pad`: the whole ``C K`` rows of every class
    leaf of a host tree."""
    rows = self.num_classes * self.per_class
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x[:rows] if self.is_rows(path) else x, tree)


def from_config(config, entry, num_classes: Optional[int]
                ) -> Optional[ClassRows]:
  """The sharded class matrix of ``config.loss.shard_classes``, else None.

  Args:
    config: the run's config.
    entry: its loss's registry entry.
    num_classes: ``C`` (:func:`circle_jax.config_facts.num_classes`).
  """
  if not config.loss.get("shard_classes", False):
    return None
  per_class = int(config.loss.get("centers_per_class", 1) or 1)
  return ClassRows(entry.param_name, int(num_classes), per_class)


def sharded_leaves(rows: Optional[ClassRows]):
  """The ``sharded`` predicate of a run: ``rows.sharded``, or the memory's
  alone without a sharded class matrix."""
  return xbm_lib.is_sharded if rows is None else rows.sharded


def pad(rows: Optional[ClassRows], tree: PyTree, num_devices: int) -> PyTree:
  """:meth:`ClassRows.pad`; the tree as is without a sharded matrix."""
  return tree if rows is None else rows.pad(tree, num_devices)


def unpad(rows: Optional[ClassRows], tree: PyTree) -> PyTree:
  """:meth:`ClassRows.unpad`; the tree as is without a sharded matrix."""
  return tree if rows is None else rows.unpad(tree)
