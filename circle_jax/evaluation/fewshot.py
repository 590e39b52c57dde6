"""Episodic N-way K-shot classification of embeddings, on device.

An episode (Vinyals et al. 2016) draws ``N`` classes of a split, and for each
class ``K`` support and ``Q`` query images, all without replacement. Each query
is classified among the episode's ``N`` classes from the support images only:

* ``prototype`` (Snell et al. 2017, with cosine similarity): class ``c``'s
  prototype is the mean of its L2-normalised support embeddings,
  ``p_c = (1/K) sum_k e_ck / ||e_ck||``; a query ``q`` goes to
  ``argmax_c cos(q, p_c)``.
* ``nn``: the class of the support image most cosine-similar to the query
  (1-nearest neighbour).

The episode's accuracy is the fraction of its ``N * Q`` queries classified to
their own class (ties go to the lower class position). Over ``E`` episodes the
result is the mean accuracy and the half-width of its 95% confidence interval,
``1.96 * std / sqrt(E)``, where ``std`` is the *sample* standard deviation of
the per-episode accuracies (``ddof=1``; 0 for one episode).

Queries per class. Every class of every episode has the same ``Q`` (fixed
shapes, so episodes are vmapped, and each class weighs the same in the
accuracy): ``Q = min(queries, n_N - K)`` where ``n_N`` is the ``N``-th largest
class size of the split, and the classes an episode draws from are those with
at least ``K + Q`` images. With the default ``queries=15`` and Omniglot's 20
images per class, 20-way 1-shot and 20-way 5-shot both use ``Q = 15``; a split
whose classes are smaller uses all the images left after the support.

Determinism. Episode ``e`` is a function of ``jax.random.split(PRNGKey(seed),
E)[e]`` and the labels only: the same episodes (and, for given embeddings, the
same accuracies) on any number of devices and any chunk size. Episodes are
drawn and classified on device, vmapped over a chunk of episodes that is
sharded over the devices (``shard_map``), so a device holds
``O(chunk_size / num_devices * N * (K + Q) * D)`` floats.

References:
  Vinyals, Blundell, Lillicrap, Kavukcuoglu, Wierstra, "Matching Networks for
  One Shot Learning", NeurIPS 2016.
  Snell, Swersky, Zemel, "Prototypical Networks for Few-shot Learning",
  NeurIPS 2017.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from circle_jax import ops
from circle_jax.evaluation import checks

CLASSIFIERS = ("prototype", "nn")
_AXIS = "episodes"
# Floats of gathered support + query embeddings a device holds per chunk.
_CHUNK_FLOATS = 1 << 24


@dataclasses.dataclass(frozen=True)
class Episodes:
  """Record indices of ``E`` episodes of ``N`` classes.

  Attributes:
    classes: ``[E, N]`` the class labels of each episode, in class position
      order (query ``(n, q)`` belongs to position ``n``).
    support: ``[E, N, K]`` record indices of the support images.
    query: ``[E, N, Q]`` record indices of the query images.
  """

  classes: np.ndarray
  support: np.ndarray
  query: np.ndarray


@dataclasses.dataclass(frozen=True)
class FewShotResult:
  """The result of :func:`fewshot_accuracy`.

  Attributes:
    accuracy: mean over episodes of the fraction of correct queries, in [0, 1].
    ci95: ``1.96 * std / sqrt(E)``, ``std`` the sample standard deviation
      (``ddof=1``) of the per-episode accuracies (0 for one episode).
    std: that standard deviation.
    per_episode: ``[E]`` float64 per-episode accuracies.
    ways, shots, queries: ``N``, ``K`` and the ``Q`` used.
    episodes: the :class:`Episodes` drawn (with ``return_episodes=True``),
      else None.
  """

  accuracy: float
  ci95: float
  std: float
  per_episode: np.ndarray
  ways: int
  shots: int
  queries: int
  episodes: Optional[Episodes] = None


def metric_name(ways: int, shots: int) -> str:
  """``fewshot_{N}way_{K}shot``: the accuracy's key (``+ '_ci95'``: its CI)."""
  return f"fewshot_{ways}way_{shots}shot"


def metric_names(ways: Sequence[int], shots: Sequence[int]) -> Tuple[str, ...]:
  """The keys :func:`fewshot_metrics` returns, accuracies and their CIs."""
  names = []
  for n in ways:
    for k in shots:
      names += [metric_name(n, k), metric_name(n, k) + "_ci95"]
  return tuple(names)


# ----------------------------------------------------------------------------
# Host side: checks, the class table.
# ----------------------------------------------------------------------------


def _class_table(labels: np.ndarray, ways: int, shots: int, queries: int
                 ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
  """``(class labels [C], table [C, M] of record indices (-1 padded),
  counts [C], Q)`` of the classes with at least ``K + Q`` images."""
  classes, inverse, counts = np.unique(labels, return_inverse=True,
                                       return_counts=True)
  if ways > len(classes):
    raise ValueError(
        f"`ways` = {ways} but the split has only {len(classes)} classes; "
        f"lower `ways` to at most {len(classes)}.")
  nth = int(np.sort(counts)[::-1][ways - 1])  # the N-th largest class size
  if nth < shots + 1:
    raise ValueError(
        f"`shots` = {shots} needs {ways} classes with at least {shots} + 1 "
        f"images (support + a query) but only {int(np.sum(counts > shots))} "
        f"of the split's {len(classes)} classes have them; lower `shots` or "
        "`ways`.")
  q = min(queries, nth - shots)
  keep = np.flatnonzero(counts >= shots + q)
  order = np.argsort(inverse, kind="stable")  # records grouped by class
  starts = np.concatenate([[0], np.cumsum(counts)])
  width = int(counts[keep].max())
  table = np.full((len(keep), width), -1, np.int32)
  for row, c in enumerate(keep):
    table[row, :counts[c]] = order[starts[c]:starts[c + 1]]
  return classes[keep], table, counts[keep].astype(np.int32), q


def _check_settings(ways, shots, queries, episodes, classifier):
  for name, value in (("ways", ways), ("shots", shots), ("queries", queries),
                      ("episodes", episodes)):
    checks.check_positive_int(value, name)
  if ways < 2:
    raise ValueError(f"`ways` must be >= 2 (an episode classifies among N "
                     f"classes); got {ways}.")
  if classifier not in CLASSIFIERS:
    raise ValueError(f"`classifier` must be one of {CLASSIFIERS}; got "
                     f"{classifier!r}.")


# ----------------------------------------------------------------------------
# Device side: one episode, vmapped over a chunk, sharded over devices.
# ----------------------------------------------------------------------------


def _draw(key, table, counts, ways: int, size: int):
  """``(class rows [N], record indices [N, size])`` of one episode.

  Draws without replacement as the top ``N`` (``size``) of uniform numbers,
  one per class (per image of each drawn class, padding below them all).
  """
  k_cls, k_img = jax.random.split(key)
  _, rows = jax.lax.top_k(jax.random.uniform(k_cls, (table.shape[0],)), ways)
  u = jax.random.uniform(k_img, (ways, table.shape[1]))
  u = jnp.where(jnp.arange(table.shape[1]) < counts[rows][:, None], u, -1.0)
  _, pick = jax.lax.top_k(u, size)
  return rows, jnp.take_along_axis(table[rows], pick, axis=1)


def _num_correct(emb, support, query, classifier: str):
  """Correct queries of one episode; ``emb`` L2-normalised ``[n, D]``."""
  ways, shots = support.shape
  s = emb[support]                                   # [N, K, D]
  q = emb[query].reshape(-1, emb.shape[1])           # [N * Q, D]
  truth = jnp.repeat(jnp.arange(ways), query.shape[1])
  if classifier == "prototype":
    refs = ops.l2_normalize(jnp.mean(s, axis=1))     # [N, D]
  else:
    refs = s.reshape(ways * shots, -1)               # [N * K, D]
  sim = jnp.matmul(q, refs.T, precision=jax.lax.Precision.HIGHEST)
  pred = jnp.argmax(sim, axis=1)
  if classifier == "nn":
    pred = pred // shots
  return jnp.sum(pred == truth, dtype=jnp.int32)


@functools.lru_cache(maxsize=32)
def _chunk_fn(devices: Tuple[jax.Device, ...], ways: int, shots: int,
              queries: int, classifier: str):
  """Jitted ``(keys [C, 2], table, counts, emb) -> (rows [C, N], idx [C, N,
  K + Q], correct [C])``, the keys sharded over ``devices``."""
  mesh = Mesh(np.array(devices), (_AXIS,))

  def one(key, table, counts, emb):
    rows, idx = _draw(key, table, counts, ways, shots + queries)
    return rows, idx, _num_correct(emb, idx[:, :shots], idx[:, shots:],
                                   classifier)

  body = jax.vmap(one, in_axes=(0, None, None, None))
  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(_AXIS), P(), P(), P()),
                     out_specs=(P(_AXIS), P(_AXIS), P(_AXIS)), check_vma=False)
  return jax.jit(fn)


# ----------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------


def fewshot_accuracy(
    embeddings,
    labels,
    *,
    ways: int,
    shots: int,
    queries: int = 15,
    episodes: int = 1000,
    seed: int = 0,
    classifier: str = "prototype",
    chunk_size: Optional[int] = None,
    devices: Optional[Sequence[jax.Device]] = None,
    return_episodes: bool = False,
) -> FewShotResult:
  """Mean N-way K-shot accuracy over ``episodes`` episodes, with its 95% CI.

  See the module docstring for the episodes, the classifiers, ``Q`` and the
  confidence interval.

  Args:
    embeddings: ``[n, D]`` float embeddings of a split (any float dtype,
      computed in float32; need not be normalised).
    labels: ``[n]`` integer class ids.
    ways: ``N``, classes per episode (>= 2).
    shots: ``K``, support images per class.
    queries: the most query images per class (``Q = min(queries, n_N - K)``).
    episodes: ``E``.
    seed: episodes are a function of the seed and the labels only.
    classifier: ``prototype`` (Snell et al.) or ``nn`` (1-nearest neighbour).
    chunk_size: episodes per device step (default: as many as fit about 64 MB
      of gathered embeddings per device); does not change the result.
    devices: the devices that share the episodes (default: all local ones);
      does not change the result.
    return_episodes: also return the :class:`Episodes` drawn.

  Returns:
    A :class:`FewShotResult`.

  Raises:
    ValueError / TypeError: bad embeddings or labels; a setting that is not a
      positive int (``ways < 2``) or an unknown classifier; ``ways`` larger
      than the split's classes, or fewer than ``ways`` classes with ``shots +
      1`` images.
  """
  _check_settings(ways, shots, queries, episodes, classifier)
  emb = checks.check_embeddings(embeddings, "embeddings")
  lab = checks.check_labels(labels, emb.shape[0], "labels", "embeddings")
  devs = checks.resolve_devices(None, devices)
  classes, table, counts, q = _class_table(lab, ways, shots, queries)
  if chunk_size is None:
    per_device = max(1, _CHUNK_FLOATS // (ways * (shots + q) * emb.shape[1]))
    chunk_size = per_device * len(devs)
  chunk = checks.round_up(
      min(checks.check_positive_int(chunk_size, "chunk_size"), episodes),
      len(devs))
  fn = _chunk_fn(devs, ways, shots, q, classifier)
  keys = jax.random.key_data(jax.random.split(jax.random.PRNGKey(seed),
                                              episodes))
  keys = np.asarray(keys)
  pad = checks.round_up(episodes, chunk) - episodes
  keys = np.concatenate([keys, np.repeat(keys[-1:], pad, axis=0)])
  emb_n = ops.l2_normalize(jnp.asarray(emb))
  table, counts = jnp.asarray(table), jnp.asarray(counts)
  rows, idx, correct = [], [], []
  for start in range(0, len(keys), chunk):
    out = jax.device_get(fn(jax.random.wrap_key_data(keys[start:start + chunk]),
                            table, counts, emb_n))
    rows.append(out[0])
    idx.append(out[1])
    correct.append(out[2])
  correct = np.concatenate(correct)[:episodes].astype(np.float64)
  per_episode = correct / (ways * q)
  std = float(np.std(per_episode, ddof=1)) if episodes > 1 else 0.0
  drawn = None
  if return_episodes:
    idx = np.concatenate(idx)[:episodes]
    drawn = Episodes(classes=classes[np.concatenate(rows)[:episodes]],
                     support=idx[:, :, :shots], query=idx[:, :, shots:])
  return FewShotResult(
      accuracy=float(np.mean(per_episode)),
      ci95=1.96 * std / math.sqrt(episodes), std=std,
      per_episode=per_episode, ways=ways, shots=shots, queries=q,
      episodes=drawn)


def fewshot_metrics(embeddings, labels, *, ways: Sequence[int],
                    shots: Sequence[int], queries: int = 15,
                    episodes: int = 1000, seed: int = 0,
                    classifier: str = "prototype") -> Dict[str, float]:
  """:func:`fewshot_accuracy` for every ``(N, K)`` of ``ways x shots``.

  Returns:
    ``{'fewshot_{N}way_{K}shot': accuracy, 'fewshot_{N}way_{K}shot_ci95':
    ci95}`` (Python floats) for each pair, each with ``seed``'s episodes.
  """
  out = {}
  for n in ways:
    for k in shots:
      r = fewshot_accuracy(embeddings, labels, ways=n, shots=k,
                           queries=queries, episodes=episodes, seed=seed,
                           classifier=classifier)
      out[metric_name(n, k)] = r.accuracy
      out[metric_name(n, k) + "_ci95"] = r.ci95
  return out
