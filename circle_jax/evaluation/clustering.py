"""Clustering quality of embeddings: k-means on device, then NMI and AMI.

:func:`kmeans` runs Lloyd's algorithm in JAX from a k-means++ initialisation
(Arthur & Vassilvitskii 2007): the first center is drawn uniformly, each next
one with probability proportional to ``D(x)^2``, the squared distance of ``x``
to its nearest chosen center; as in scikit-learn, each step draws a few
candidates and keeps the one that lowers ``sum_x D(x)^2`` most ("greedy"
k-means++). Lloyd iterations then alternate

* assignment: ``a(x) = argmin_c ||x - mu_c||^2`` (lowest ``c`` among ties),
  computed in chunks of rows so memory is ``O(chunk_size * k)``;
* update: ``mu_c = mean {x : a(x) = c}``; an empty cluster keeps its center,

until no assignment changes or ``max_iterations`` updates were made.

:func:`mutual_information_scores` compares two labellings ``U`` (classes) and
``V`` (clusters) of ``N`` items through their contingency table ``n_ij``
(``a_i``, ``b_j`` its row and column sums), in float64 on the host:

* ``MI = sum_ij (n_ij / N) log(N n_ij / (a_i b_j))``;
* ``NMI = MI / ((H(U) + H(V)) / 2)`` (Strehl & Ghosh 2002, arithmetic mean);
* ``AMI = (MI - E[MI]) / ((H(U) + H(V)) / 2 - E[MI])`` (Vinh, Epps & Bailey
  2010), with ``E[MI]`` the expected MI of two random labellings with the same
  class and cluster sizes (hypergeometric model).

``E[MI]`` depends on ``(a_i, b_j)`` only through the pair of sizes, so it is
summed over distinct size pairs, weighted by their multiplicities: fast even
for SOP's 11,316 classes. The degenerate cases follow scikit-learn's
``normalized_mutual_info_score`` / ``adjusted_mutual_info_score``
(``average_method='arithmetic'``): both labellings with a single group give 1;
NMI is 0 when MI is 0; AMI is 0 when exactly one labelling has a single group.

References:
  Arthur, Vassilvitskii. "k-means++: The Advantages of Careful Seeding".
  SODA 2007.
  Strehl, Ghosh. "Cluster Ensembles: A Knowledge Reuse Framework for
  Combining Multiple Partitions". JMLR 2002.
  Vinh, Epps, Bailey. "Information Theoretic Measures for Clusterings
  Comparison". JMLR 2010.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from scipy.special import gammaln

from circle_jax import ops
from circle_jax.evaluation import checks

Array = jax.Array

__all__ = [
    "KMeansResult",
    "clustering_metrics",
    "kmeans",
    "mutual_information_scores",
]

_EPS64 = np.finfo(np.float64).eps
_HIGHEST = jax.lax.Precision.HIGHEST


class KMeansResult(NamedTuple):
  """Output of :func:`kmeans`.

  Attributes:
    centers: ``[k, D]`` float32 cluster centers.
    assignments: ``[N]`` int32 cluster index of each point.
    inertia: float32 scalar, ``sum_x min_c ||x - mu_c||^2`` at the final
      assignment and centers.
    num_iterations: int32 scalar, the number of center updates made.
  """

  centers: Array
  assignments: Array
  inertia: Array
  num_iterations: Array


# ----------------------------------------------------------------------------
# k-means in JAX.
# ----------------------------------------------------------------------------


def _sq_dist_to(x: Array, x_sq: Array, c: Array) -> Array:
  """``[N]`` squared distances of the rows of ``x`` to one center ``c``."""
  d = x_sq + jnp.sum(c * c) - 2.0 * jnp.matmul(x, c, precision=_HIGHEST)
  return jnp.maximum(d, 0.0)


def _kmeans_plus_plus(key, x, x_sq, valid, num_clusters, num_local_trials):
  """Greedy k-means++ seeding over the valid rows of ``x``: ``[k, D]`` centers.

  Each step draws ``num_local_trials`` candidates with probability
  proportional to ``D(x)^2`` and keeps the one that most lowers the potential
  ``sum_x D(x)^2`` (one trial is the original k-means++).
  """
  uniform = jnp.where(valid, 0.0, -jnp.inf)
  key, sub = jax.random.split(key)
  first = x[jax.random.categorical(sub, uniform)]
  d2 = jnp.where(valid, _sq_dist_to(x, x_sq, first), 0.0)
  centers = jnp.zeros((num_clusters, x.shape[1]), x.dtype).at[0].set(first)

  def step(i, carry):
    centers, d2, key = carry
    key, sub = jax.random.split(key)
    positive = d2 > 0
    # All remaining points coincide with a center: draw uniformly instead.
    logits = jnp.where(
        jnp.any(positive),
        jnp.where(positive, jnp.log(jnp.where(positive, d2, 1.0)), -jnp.inf),
        uniform,
    )
    cand = jax.random.categorical(sub, logits, shape=(num_local_trials,))
    c = x[cand]                                               # [L, D]
    dc = jnp.maximum(
        x_sq[None, :] + jnp.sum(c * c, axis=1)[:, None]
        - 2.0 * jnp.matmul(c, x.T, precision=_HIGHEST), 0.0)  # [L, N]
    new_d2 = jnp.where(valid[None, :], jnp.minimum(d2[None, :], dc), 0.0)
    best = jnp.argmin(jnp.sum(new_d2, axis=1))
    return centers.at[i].set(c[best]), new_d2[best], key

  centers, _, _ = jax.lax.fori_loop(1, num_clusters, step, (centers, d2, key))
  return centers


def _assign(x_chunks, x_sq_chunks, centers):
  """Nearest center of each row: ``([N'] int32, [N'] squared distance)``."""
  c_sq = jnp.sum(centers * centers, axis=-1)

  def one(args):
    xc, xc_sq = args
    d = c_sq[None, :] - 2.0 * jnp.matmul(xc, centers.T, precision=_HIGHEST)
    a = jnp.argmin(d, axis=1).astype(jnp.int32)
    dmin = jnp.maximum(jnp.min(d, axis=1) + xc_sq, 0.0)
    return a, dmin

  a, dmin = jax.lax.map(one, (x_chunks, x_sq_chunks))
  return a.reshape(-1), dmin.reshape(-1)


@functools.partial(jax.jit, static_argnames=("num_clusters", "chunk_rows",
                                             "normalize", "num_local_trials"))
def _kmeans_impl(x, key, max_iterations, *, num_clusters, chunk_rows,
                 normalize, num_local_trials):
  x = x.astype(jnp.float32)
  if normalize:
    x = ops.l2_normalize(x)
  n, dim = x.shape
  x_sq = jnp.sum(x * x, axis=-1)
  # The seeding sees exactly the N points (independent of the chunking).
  centers = _kmeans_plus_plus(key, x, x_sq, jnp.ones((n,), bool), num_clusters,
                              num_local_trials)
  # Assignments run over row chunks; padded rows are masked out.
  padded = -(-n // chunk_rows) * chunk_rows
  valid = jnp.arange(padded) < n
  x = jnp.pad(x, ((0, padded - n), (0, 0)))
  x_sq = jnp.pad(x_sq, (0, padded - n))
  x_chunks = x.reshape(padded // chunk_rows, chunk_rows, dim)
  x_sq_chunks = x_sq.reshape(padded // chunk_rows, chunk_rows)
  weight = valid.astype(jnp.float32)

  def update(centers, assign):
    sums = jax.ops.segment_sum(x * weight[:, None], assign, num_clusters)
    counts = jax.ops.segment_sum(weight, assign, num_clusters)
    return jnp.where(counts[:, None] > 0,
                     sums / jnp.maximum(counts, 1.0)[:, None], centers)

  # One loop body for the first assignment (it == -1, no update) and for the
  # Lloyd iterations (update, then re-assign): a single copy of each step in
  # the compiled program.
  def cond(state):
    _, _, it, changed, _ = state
    return (it < max_iterations) & changed

  def body(state):
    centers, assign, it, _, _ = state
    centers = jax.lax.cond(it >= 0, update, lambda c, a: c, centers, assign)
    new_assign, dmin = _assign(x_chunks, x_sq_chunks, centers)
    changed = (it < 0) | jnp.any((new_assign != assign) & valid)
    return centers, new_assign, it + 1, changed, dmin

  init = (centers, jnp.zeros((padded,), jnp.int32), jnp.int32(-1),
          jnp.bool_(True), jnp.zeros((padded,), jnp.float32))
  centers, assign, it, _, dmin = jax.lax.while_loop(cond, body, init)
  inertia = jnp.sum(jnp.where(valid, dmin, 0.0))
  return KMeansResult(centers, assign[:n], inertia, it)


def _check_embeddings(x, name="embeddings"):
  return checks.check_array(jnp.asarray(x), name, dims="[num_items, dim]",
                            kind=jnp.floating, kind_words="a floating array",
                            cast=".astype(jnp.float32)", nonempty=True)


def _check_int(value, name, low, high=None):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"`{name}` must be an int; got {value!r}.")
  if value < low or (high is not None and value > high):
    rng = f"[{low}, {high}]" if high is not None else f">= {low}"
    raise ValueError(f"`{name}` must be in {rng}; got {value}.")
  return int(value)


def kmeans(
    embeddings,
    num_clusters: int,
    *,
    key,
    max_iterations: int = 100,
    normalize: bool = True,
    chunk_size: int = 4096,
    num_local_trials: Optional[int] = None,
) -> KMeansResult:
  """k-means (Lloyd) with k-means++ seeding, in JAX on the default device.

  Args:
    embeddings: ``[N, D]`` float array (computed in float32).
    num_clusters: ``k``, in ``[1, N]``.
    key: a ``jax.random`` key; the seeding is its only randomness.
    max_iterations: the most center updates (Lloyd iterations) to make; it
      stops earlier once no assignment changes.
    normalize: L2-normalise the embeddings first (the geometry of cosine
      retrieval; the convention of the metric-learning papers' evaluations).
    chunk_size: rows per assignment step; memory is ``O(chunk_size * k)``.
    num_local_trials: candidates drawn per seeding step (greedy k-means++);
      default ``2 + floor(ln k)``, scikit-learn's choice. 1 gives the original
      k-means++.

  Returns:
    A :class:`KMeansResult` of device arrays.

  Cost: the seeding is ``k`` sequential ``O(L N D)`` steps (``L`` the local
  trials); each iteration is ``O(N k D)``. A single seeding is run (no
  restarts), so the result depends on ``key``.
  """
  x = _check_embeddings(embeddings)
  n = x.shape[0]
  num_clusters = _check_int(num_clusters, "num_clusters", 1, n)
  max_iterations = _check_int(max_iterations, "max_iterations", 0)
  chunk_size = _check_int(chunk_size, "chunk_size", 1)
  if num_local_trials is None:
    num_local_trials = 2 + int(math.log(num_clusters))
  num_local_trials = _check_int(num_local_trials, "num_local_trials", 1)
  if not bool(jnp.all(jnp.isfinite(x))):
    raise ValueError("`embeddings` contains NaN or infinite values.")
  # float32 before jit: one compilation whatever the input float dtype.
  res = _kmeans_impl(x.astype(jnp.float32), key, jnp.int32(max_iterations),
                     num_clusters=num_clusters,
                     chunk_rows=min(chunk_size, n),
                     normalize=bool(normalize),
                     num_local_trials=num_local_trials)
  return res


# ----------------------------------------------------------------------------
# NMI / AMI from the contingency table (float64, host).
# ----------------------------------------------------------------------------


def _entropy(sizes: np.ndarray, n: int) -> float:
  if sizes.size <= 1:
    return 0.0
  p = sizes / n
  return float(-np.sum(p * (np.log(sizes) - np.log(n))))


def _expected_mutual_information(a: np.ndarray, b: np.ndarray, n: int) -> float:
  """``E[MI]`` under the hypergeometric model (Vinh et al. 2010, eq. 24a).

  ``sum_ij sum_{nij=max(1, a_i+b_j-N)}^{min(a_i, b_j)} (nij/N)
  log(N nij / (a_i b_j)) * a_i! b_j! (N-a_i)! (N-b_j)! /
  (N! nij! (a_i-nij)! (b_j-nij)! (N-a_i-b_j+nij)!)``, summed once per distinct
  pair of sizes ``(a, b)`` and weighted by the number of such pairs.
  """
  if a.size <= 1 or b.size <= 1:
    return 0.0
  ua, ca = np.unique(a, return_counts=True)
  ub, cb = np.unique(b, return_counts=True)
  sa = np.repeat(ua, ub.size).astype(np.int64)         # every (a, b) pair
  sb = np.tile(ub, ua.size).astype(np.int64)
  weight = np.repeat(ca, ub.size).astype(np.float64) * np.tile(cb, ua.size)
  start = np.maximum(1, sa + sb - n)
  stop = np.minimum(sa, sb)                             # inclusive
  length = np.maximum(stop - start + 1, 0)
  # Ragged ranges nij = start..stop of every pair, flattened.
  pair = np.repeat(np.arange(sa.size), length)
  offsets = np.arange(pair.size) - np.repeat(np.cumsum(length) - length, length)
  nij = (start[pair] + offsets).astype(np.float64)
  a_, b_ = sa[pair].astype(np.float64), sb[pair].astype(np.float64)
  log_term = np.log(n) + np.log(nij) - np.log(a_) - np.log(b_)
  log_hyper = (gammaln(a_ + 1) + gammaln(b_ + 1) + gammaln(n - a_ + 1)
               + gammaln(n - b_ + 1) - gammaln(n + 1) - gammaln(nij + 1)
               - gammaln(a_ - nij + 1) - gammaln(b_ - nij + 1)
               - gammaln(n - a_ - b_ + nij + 1))
  terms = (nij / n) * log_term * np.exp(log_hyper)
  return float(np.sum(weight[pair] * terms))


def _as_label_vector(x, name):
  x = np.asarray(jax.device_get(x))
  if x.ndim != 1:
    raise ValueError(f"`{name}` must have rank 1; got shape {x.shape}.")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(
        f"`{name}` must be an integer array; got dtype {x.dtype}."
    )
  return x


def mutual_information_scores(labels, assignments) -> Dict[str, float]:
  """NMI and AMI of two labellings of the same items (float64, host).

  Args:
    labels: ``[N]`` integer ground-truth classes.
    assignments: ``[N]`` integer cluster ids (e.g. ``kmeans(...).assignments``).

  Returns:
    ``{'nmi': float, 'ami': float}``, equal (up to float64 rounding) to
    scikit-learn's ``normalized_mutual_info_score`` and
    ``adjusted_mutual_info_score`` with the arithmetic mean.
  """
  u = _as_label_vector(labels, "labels")
  v = _as_label_vector(assignments, "assignments")
  if u.shape != v.shape:
    raise ValueError(
        f"`labels` ({u.shape[0]}) and `assignments` ({v.shape[0]}) must have "
        "the same length."
    )
  n = u.shape[0]
  if n == 0:
    return {"nmi": 1.0, "ami": 1.0}
  _, ui = np.unique(u, return_inverse=True)
  _, vi = np.unique(v, return_inverse=True)
  ui, vi = ui.reshape(-1).astype(np.int64), vi.reshape(-1).astype(np.int64)
  a = np.bincount(ui).astype(np.float64)
  b = np.bincount(vi).astype(np.float64)
  if a.size == 1 and b.size == 1:
    return {"nmi": 1.0, "ami": 1.0}

  # Sparse contingency table: the non-zero cells (i, j) and their counts.
  cells, nij = np.unique(ui * b.size + vi, return_counts=True)
  ci, cj = cells // b.size, cells % b.size
  nij = nij.astype(np.float64)
  if a.size == 1 or b.size == 1:
    mi = 0.0
  else:
    mi = np.sum((nij / n) * (np.log(nij) + np.log(n) - np.log(a[ci])
                             - np.log(b[cj])))
    mi = float(max(mi, 0.0))
  h_u, h_v = _entropy(a, n), _entropy(b, n)
  mean_h = (h_u + h_v) / 2.0

  nmi = 0.0 if mi == 0.0 else mi / mean_h
  if a.size == 1 or b.size == 1:
    ami = 0.0
  else:
    emi = _expected_mutual_information(a, b, n)
    den = mean_h - emi
    den = min(den, -_EPS64) if den < 0 else max(den, _EPS64)
    num = mi - emi
    num = min(num, -_EPS64) if num < 0 else max(num, _EPS64)
    ami = num / den
  return {"nmi": float(nmi), "ami": float(ami)}


def clustering_metrics(
    embeddings,
    labels,
    *,
    key=None,
    num_clusters: Optional[int] = None,
    max_iterations: int = 100,
    normalize: bool = True,
    chunk_size: int = 4096,
    num_local_trials: Optional[int] = None,
    kmeans_func: Optional[Callable[[np.ndarray, int], Any]] = None,
) -> Dict[str, float]:
  """NMI and AMI of a k-means clustering of the embeddings against the labels.

  Args:
    embeddings: ``[N, D]`` float embeddings (numpy or JAX).
    labels: ``[N]`` integer classes.
    key: ``jax.random`` key for the k-means++ seeding (unused with
      ``kmeans_func``, required otherwise).
    num_clusters: ``k``; default the number of distinct labels.
    max_iterations, normalize, chunk_size, num_local_trials: see
      :func:`kmeans`.
    kmeans_func: optional ``kmeans_func(embeddings, num_clusters) ->
      [N]`` cluster ids, on the host numpy embeddings as given, used
      instead of :func:`kmeans` (PML's ``AccuracyCalculator(kmeans_func=)``,
      e.g. a faiss k-means).

  Returns:
    ``{'nmi': float, 'ami': float}`` (see :func:`mutual_information_scores`).
  """
  x = _check_embeddings(embeddings)
  y = _as_label_vector(labels, "labels")
  if y.shape[0] != x.shape[0]:
    raise ValueError(
        f"`labels` has length {y.shape[0]} but `embeddings` has "
        f"{x.shape[0]} rows; they must match."
    )
  if num_clusters is None:
    num_clusters = int(np.unique(y).size)
  if kmeans_func is not None:
    assignments = np.asarray(kmeans_func(np.asarray(embeddings),
                                         num_clusters))
    return mutual_information_scores(y, assignments.reshape(-1))
  if key is None:
    raise ValueError("clustering_metrics needs `key` (the k-means++ seed) "
                     "unless `kmeans_func` clusters.")
  res = kmeans(x, num_clusters, key=key, max_iterations=max_iterations,
               normalize=normalize, chunk_size=chunk_size,
               num_local_trials=num_local_trials)
  return mutual_information_scores(y, res.assignments)
