"""k-nearest-neighbour search of a :class:`~circle_jax.search.index.GalleryIndex`.

Backends (:data:`BACKENDS`):

* ``exact`` (default): exact top-k by cosine similarity on the devices,
  chunked and sharded, by the retrieval evaluation's own device program
  (:func:`circle_jax.evaluation.knn.nearest_neighbors`); ties go to the
  lower gallery position.
* ``faiss-flat``: faiss ``IndexFlatIP`` (exact, on the CPU).
* ``faiss-hnsw``: faiss ``IndexHNSWFlat`` (approximate; ``hnsw_m`` links per
  node, ``ef_construction``, ``ef_search``).
* ``faiss-ivf``: faiss ``IndexIVFFlat`` (approximate; ``nlist`` k-means
  cells trained on the gallery, ``nprobe`` visited per query).

faiss (Johnson, Douze, Jegou, "Billion-scale similarity search with GPUs",
IEEE Transactions on Big Data 2019) is an optional extra: ``pip install
circle_jax[faiss]``. The embeddings are unit-norm, so inner product is the
cosine similarity every backend ranks by.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence

import numpy as np

from circle_jax.errors import UserError
from circle_jax.evaluation import knn
from circle_jax.search import index as index_lib

BACKENDS = ("exact", "faiss-flat", "faiss-hnsw", "faiss-ivf")


class BackendError(UserError, ValueError):
  """A backend that is unknown or not installed."""


def import_faiss():
  """The ``faiss`` module, or a one-line :class:`BackendError`."""
  try:
    import faiss  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise BackendError(
        "faiss is not installed: `pip install circle_jax[faiss]` (faiss-cpu), "
        "or use --backend exact.") from e
  return faiss


@dataclasses.dataclass
class Neighbors:
  """The ``k`` nearest gallery items of each query, best first.

  Attributes:
    scores: ``[Q, k]`` float32 cosine similarities (``-inf`` past the
      gallery's size).
    positions: ``[Q, k]`` int64 rows of the index (-1 past its size).
    ids: ``Q`` lists of ``k`` item ids (None past its size).
    labels: ``Q`` lists of labels, or None for an unlabelled index.
  """

  scores: np.ndarray
  positions: np.ndarray
  ids: List[List[Optional[str]]]
  labels: Optional[List[list]]


@dataclasses.dataclass(frozen=True)
class FaissOptions:
  """Parameters of the approximate faiss indexes."""

  hnsw_m: int = 32
  ef_construction: int = 200
  ef_search: int = 128
  nlist: int = 0          # 0: 4 sqrt(N), at least 1
  nprobe: int = 16


def build_faiss(embeddings: np.ndarray, backend: str,
                options: FaissOptions = FaissOptions()):
  """A faiss index of ``embeddings`` (unit-norm rows) for ``backend``."""
  faiss = import_faiss()
  x = np.ascontiguousarray(embeddings, np.float32)
  d = x.shape[1]
  if backend == "faiss-flat":
    fi = faiss.IndexFlatIP(d)
  elif backend == "faiss-hnsw":
    fi = faiss.IndexHNSWFlat(d, options.hnsw_m, faiss.METRIC_INNER_PRODUCT)
    fi.hnsw.efConstruction = options.ef_construction
    fi.hnsw.efSearch = options.ef_search
  elif backend == "faiss-ivf":
    nlist = options.nlist or max(1, int(4 * np.sqrt(x.shape[0])))
    nlist = min(nlist, x.shape[0])
    fi = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist,
                            faiss.METRIC_INNER_PRODUCT)
    fi.train(x)
    fi.nprobe = min(options.nprobe, nlist)
  else:
    raise BackendError(f"unknown backend {backend!r}; choose one of "
                       f"{', '.join(BACKENDS)}.")
  fi.add(x)
  return fi


class Searcher:
  """Searches one index with one backend; the gallery is laid out once.

  Args:
    index: the gallery.
    backend: one of :data:`BACKENDS`.
    devices: the devices of the exact backend (default: all local ones).
    options: the faiss indexes' parameters.
    chunk_size: query rows per device step (exact backend).
  """

  def __init__(self, index: index_lib.GalleryIndex, backend: str = "exact",
               *, devices=None, options: FaissOptions = FaissOptions(),
               chunk_size: int = 1024):
    if backend not in BACKENDS:
      raise BackendError(f"unknown backend {backend!r}; choose one of "
                         f"{', '.join(BACKENDS)}.")
    if not len(index):
      raise index_lib.IndexContentError("the index is empty; add items "
                                        "first.")
    self.index, self.backend, self.chunk_size = index, backend, chunk_size
    if backend == "exact":
      self._engine = knn.shard_gallery(index.embeddings, devices=devices)
    else:
      self._engine = build_faiss(index.embeddings, backend, options)

  def search(self, queries, k: int, *,
             model: Optional[index_lib.ModelRecord] = None,
             on_chunk: Optional[Callable[[int], None]] = None) -> Neighbors:
    """The ``k`` nearest items of ``queries [Q, D]``.

    ``model`` is the record of the model that embedded the queries; another
    model than the index's (or another size) is refused in one line
    (:class:`~circle_jax.search.index.ModelMismatchError`).
    """
    q = np.asarray(queries)
    if q.ndim != 2:
      raise index_lib.IndexContentError(
          f"queries must be [num_queries, dim]; got shape {q.shape}.")
    self.index.check_model(model, q.shape[1])
    if self.backend == "exact":
      scores, pos = knn.nearest_neighbors(q, self._engine, k=k,
                                          chunk_size=self.chunk_size,
                                          on_chunk=on_chunk)
    else:
      from circle_jax.evaluation import tiled_ranking  # pylint: disable=g-import-not-at-top
      qn = np.ascontiguousarray(tiled_ranking.l2_normalize_rows(q))
      scores, pos = self._engine.search(qn, k)
      pos = pos.astype(np.int64)
      scores = np.where(pos >= 0, scores, -np.inf).astype(np.float32)
      if on_chunk:
        on_chunk(q.shape[0])
    return neighbors_of(self.index, scores, pos)


def neighbors_of(index: index_lib.GalleryIndex, scores: np.ndarray,
                 positions: np.ndarray) -> Neighbors:
  """:class:`Neighbors` with the ids and labels of ``positions``."""
  ids = [[index.ids[p] if p >= 0 else None for p in row] for row in positions]
  labels = None
  if index.labels is not None:
    labels = [[index.labels[p].item() if p >= 0 else None for p in row]
              for row in positions]
  return Neighbors(scores, positions, ids, labels)


def search(index: index_lib.GalleryIndex, queries, k: int, *,
           backend: str = "exact",
           model: Optional[index_lib.ModelRecord] = None,
           devices: Optional[Sequence] = None) -> Neighbors:
  """One search (:class:`Searcher` for many)."""
  return Searcher(index, backend, devices=devices).search(queries, k,
                                                          model=model)


def recall_at_k(approx: np.ndarray, exact: np.ndarray) -> float:
  """Recall@k of approximate neighbours against the exact ones: the mean
  fraction of each query's exact top-k found in its approximate top-k."""
  hits = [len(set(a[a >= 0]) & set(e[e >= 0])) / max(1, int((e >= 0).sum()))
          for a, e in zip(approx, exact)]
  return float(np.mean(hits))
