"""The class matrix of the proxy and classifier losses: whole, or sharded.

Proxy-Anchor, Ranked Proxy-Anchor, Proxy-NCA, SoftTriple, NormFace, CosFace,
ArcFace and SubCenter-ArcFace keep a ``[C, D]`` matrix of class vectors
(``[C K, D]`` with ``K`` vectors per class). Every one of them computes its
logits through a :class:`ClassBlock` built by :func:`class_block`, which says
which rows this device computes against and over which mapped axes the class
and batch reductions run. With the whole matrix there is nothing to combine
and the block's reductions are the plain ones, so the single-device loss is
the sharded code with one device.

**Sharded** (``shard_classes=True`` with ``axis_name``): each of the ``n``
devices holds ``C_local = ceil(C / n)`` consecutive classes, device ``d``
the classes ``[d C_local, (d + 1) C_local)``; the last rows are padding when
``C`` is not a multiple of ``n`` (:func:`pad_rows` builds that layout).
Each device all-gathers the embeddings and labels (the global batch) and
computes logits against its own rows only. The model-parallel softmax of
PartialFC combines the pieces: the global maximum over classes (``pmax``,
no gradient), the sum over classes of the shifted exponentials
(:func:`circle_jax.ops.global_sum`, exact gradients), and the positive
class's logit from the device that owns it (a global sum of a masked value
that only the owner makes non-zero). Proxy-Anchor, whose anchors are the
proxies, runs its per-proxy sums over the gathered batch on the owner of
each proxy and adds the per-proxy terms, and the count of proxies with
positives, over the devices. The value is the global-batch loss on every
device; the gradient reaches each device's embeddings through the
all-gather's transpose (a reduce-scatter of every device's share) and each
device's class rows directly, under ``jax.shard_map`` and ``jax.pmap`` alike
(the class rows' gradient is not summed over devices: each device owns its
rows).

**Padding** rows (global id ``>= C``) are marked not ``real``: they are
outside every mask (positives, negatives, the softmax's denominator, the
per-proxy sums and counts, SoftTriple's regulariser), each masked entry is
replaced *before* ``exp`` (never multiplied by 0 after it), so they add
nothing to the value and get an exact zero gradient; their contents are
irrelevant (zeros by :func:`pad_rows`).

**Negative-class sampling** (``sample_rate = r < 1``, PartialFC): each step
every device keeps the rows of the positive classes of the global batch and
a random subset of its other rows, ``k = min(C_local, max(ceil(r C_local),
B))`` rows in all (``B`` the global batch: room for every positive, so the
shapes are static and no positive is ever dropped), chosen by the top ``k``
of uniform scores with the positives' scores set above 1, from a key folded
with the device index. The unsampled rows are left out of the softmax and
get zero gradient. ``r = 1`` (or ``k = C_local``) keeps every row in its
place: exactly the full loss. ``r < 1`` is an approximation of the full
softmax, not the same loss: the first Partial FC paper (An et al., arXiv
2020, abstract) reports no loss of accuracy when training with 10% randomly
sampled classes, against the full classes, with state-of-the-art face
recognition models on mainstream benchmarks; the CVPR 2022 paper builds its
sparsely updated FC layer on this sampling. Pass the step's key
(``fold_in(base_key, step)``) so a resumed run samples the same classes.

References:
  An, Deng, Guo, Feng, Zhu, Yang, Liu, "Killing Two Birds with One Stone:
  Efficient and Robust Training of Face Recognition CNNs by Partial FC",
  CVPR 2022 (the model-parallel softmax and the sampling).
  An, Zhu, Xiao, Wu, Zhang, Gao, Qin, Zhang, Fu, "Partial FC: Training 10
  Million Identities on a Single Machine", arXiv:2010.05222, 2020 (the 10%
  claim, checked against its abstract).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import checks
from circle_jax.losses.engine import reductions

Array = jax.Array

# The keywords of a loss's class-matrix layout (:class:`Layout`, less the
# step's ``key``): the config fields, the registry's options that are not
# hyperparameters.
CLASS_LAYOUT_OPTIONS = ("shard_classes", "num_classes", "sample_rate")


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a loss holds its class matrix: the keywords every proxy and
  classifier loss with a class matrix takes (module docstring).

  Attributes:
    shard_classes: the matrix is sharded over ``axis_name``: the loss gets
      this device's ``ceil(C / n)`` classes' rows (:func:`pad_rows`).
    num_classes: ``C`` with ``shard_classes`` (the rows beyond are padding;
      default: no padding).
    sample_rate: PartialFC's negative-class sampling rate ``r`` in (0, 1]
      (1: every class, the exact loss).
    key: the step's PRNG key, needed when ``sample_rate < 1``.
  """

  shard_classes: bool = False
  num_classes: Optional[int] = None
  sample_rate: float = 1.0
  key: Optional[Array] = None


@dataclasses.dataclass(frozen=True)
class ClassBlock:
  """The class rows one device computes against, and where they sit.

  Attributes:
    ids: ``[R]`` global class id of each (kept) row.
    real: ``[R]`` bool, a real class (not padding).
    local_real: ``[C_local]`` bool, ``real`` of every local class before
      sampling (SoftTriple's regulariser runs over all of them).
    num_classes: ``C``, the number of real classes.
    class_axis: the mapped axis the classes are split over (None: whole).
    batch_axis: the mapped axis the batch is still split over (None: the
      batch is whole, on one device or gathered).
  """

  ids: Array
  real: Array
  local_real: Array
  num_classes: int
  class_axis: Any = None
  batch_axis: Any = None

  def onehot(self, labels: Array) -> Array:
    """``[B, R]``: sample ``b``'s class is row ``r``."""
    return (labels[:, None] == self.ids[None, :]) & self.real[None, :]

  def class_sum(self, x: Array) -> Array:
    """Sum over the devices holding classes (exact gradients)."""
    return ops.maybe_global_sum(x, self.class_axis)

  def class_count(self, x: Array) -> Array:
    """Sum over the class devices of a quantity without gradient."""
    x = jax.lax.stop_gradient(x)
    return x if self.class_axis is None else jax.lax.psum(x, self.class_axis)

  def logsumexp(self, logits: Array, mask: Array) -> Array:
    """``[B]`` log-sum-exp over all classes of every device, in ``mask``
    and real."""
    return ops.masked_logsumexp(logits, mask & self.real[None, :], axis=1,
                                axis_name=self.class_axis)

  def target(self, logits: Array, onehot: Array) -> Array:
    """``[B]`` the positive class's logit, from the device that owns it."""
    return self.class_sum(jnp.sum(jnp.where(onehot, logits, 0.0), axis=1))

  def batch_mean(self, per_sample: Array) -> Array:
    """Mean over the (global) batch."""
    return reductions.sum_over_batch(per_sample, self.batch_axis)

  def cross_entropy(self, logits: Array, onehot: Array) -> Array:
    """Mean softmax cross-entropy over the (global) batch."""
    lse = self.logsumexp(logits, jnp.ones_like(onehot))
    return self.batch_mean(lse - self.target(logits, onehot))


def whole(num_classes: int, batch_axis=None) -> ClassBlock:
  """The block of the whole matrix (no class sharding, no sampling)."""
  ids = jnp.arange(num_classes, dtype=jnp.int32)
  real = jnp.ones((num_classes,), bool)
  return ClassBlock(ids, real, real, num_classes, None, batch_axis)


def pad_rows(matrix: Array, num_devices: int, per_class: int = 1) -> Array:
  """``[C K, D] -> [n, C_local K, D]``: each device's rows, zero-padded.

  ``C_local = ceil(C / n)``; device ``d`` gets classes ``[d C_local,
  (d + 1) C_local)`` and the last device(s) padding rows beyond ``C``.
  """
  rows, dim = matrix.shape
  classes = rows // per_class
  local = -(-classes // num_devices)
  padded = jnp.pad(matrix, ((0, (local * num_devices - classes) * per_class),
                            (0, 0)))
  return padded.reshape(num_devices, local * per_class, dim)


def _check_sharding(num_local: int, axis_name, shard_classes: bool,
                    num_classes: Optional[int]) -> int:
  """The number of real classes ``C``, checked against the layout."""
  if not shard_classes:
    if num_classes is not None and num_classes != num_local:
      raise ValueError(
          f"num_classes={num_classes} but the class matrix has {num_local} "
          "classes; pass num_classes only with shard_classes=True.")
    return num_local
  if axis_name is None:
    raise ValueError("shard_classes=True needs the mapped `axis_name` the "
                     "class rows are split over.")
  n = math.prod(jax.lax.axis_size(a) for a in ops.axis_names(axis_name))
  if num_classes is None:
    return n * num_local
  if not -(-num_classes // n) == num_local:
    raise ValueError(
        f"num_classes={num_classes} over {n} devices needs ceil(C / n) = "
        f"{-(-num_classes // n)} classes per device; got {num_local}. Build "
        "the rows with circle_jax.losses.class_shard.pad_rows.")
  return num_classes


def _sample(rows, ids, real, labels, *, per_class, rate, key, axis_name):
  """PartialFC: the positives' rows and a random subset of the others."""
  local = ids.shape[0]
  keep = min(local, max(math.ceil(rate * local), labels.shape[0]))
  if keep == local:
    return rows, ids, real
  if axis_name is not None:
    key = jax.random.fold_in(key, jax.lax.axis_index(axis_name))
  slot = labels - ids[0]
  slot = jnp.where((slot >= 0) & (slot < local), slot, local)
  positive = jnp.zeros((local,), bool).at[slot].set(True, mode="drop")
  score = jax.random.uniform(key, (local,))
  score = jnp.where(positive, 2.0, jnp.where(real, score, -1.0))
  idx = jnp.sort(jax.lax.top_k(score, keep)[1])
  rows = rows.reshape(local, per_class, -1)[idx].reshape(keep * per_class, -1)
  return rows, ids[idx], real[idx]


def class_block(embeddings, labels, vectors, *, name: str = "class_weights",
                per_class: int = 1, axis_name=None,
                layout: Layout = Layout()):
  """Checks the inputs and lays out the class rows (module docstring).

  Args:
    embeddings: ``[b, D]`` this device's embeddings.
    labels: ``[b]`` integer labels.
    vectors: ``[C_local K, D]`` class vectors, class-major (the whole
      matrix, or this device's rows when ``shard_classes``).
    name: the argument's name in error messages.
    per_class: ``K``, vectors per class.
    axis_name: the mapped axis of the batch (and of the classes).
    layout: the :class:`Layout` (sharded rows, PartialFC's sampling).

  Returns:
    ``(x [B, D], labels [B], rows [R K, D], block)``: float32 embeddings and
    int32 labels (gathered when sharded), the rows to compute against and
    their :class:`ClassBlock`.
  """
  shard_classes, num_classes = layout.shard_classes, layout.num_classes
  sample_rate, key = layout.sample_rate, layout.key
  x = checks.check_embeddings(embeddings)
  labels = checks.check_labels(labels, x.shape[0])
  w = checks.check_class_vectors(vectors, x.shape[1], name)
  if w.shape[0] % per_class:
    raise ValueError(
        f"`{name}` has {w.shape[0]} rows, not a multiple of "
        f"centers_per_class={per_class}; it must be [num_classes * "
        f"{per_class}, dim].")
  if not (isinstance(sample_rate, (int, float)) and 0 < sample_rate <= 1):
    raise ValueError(f"sample_rate must be a number in (0, 1]; got "
                     f"{sample_rate!r}.")
  if sample_rate < 1 and key is None:
    raise ValueError("sample_rate < 1 samples classes: pass the step's PRNG "
                     "`key` (fold_in(base_key, step)).")
  num_local = w.shape[0] // per_class
  total = _check_sharding(num_local, axis_name, shard_classes, num_classes)
  ids = jnp.arange(num_local, dtype=jnp.int32)
  class_axis, batch_axis = None, axis_name
  if shard_classes:
    ids = ids + jax.lax.axis_index(axis_name) * num_local
    x = ops.gather_global(x, axis_name)
    labels = ops.gather_global(labels, axis_name)
    class_axis, batch_axis = axis_name, None
  real = ids < total
  rows, kept_ids, kept_real = w, ids, real
  if sample_rate < 1:
    rows, kept_ids, kept_real = _sample(
        w, ids, real, labels, per_class=per_class, rate=sample_rate, key=key,
        axis_name=class_axis)
  block = ClassBlock(kept_ids, kept_real, real, total, class_axis, batch_axis)
  return x, labels, rows, block
