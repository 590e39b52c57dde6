"""From a trained run to answers: a saved gallery index, k-nearest-neighbour
search, calibrated match thresholds (docs/search.md).

* :mod:`~circle_jax.search.index`: :class:`GalleryIndex` (embeddings, ids,
  labels, metadata, the :class:`ModelRecord` of its model, cut-points),
  atomic save and :func:`load`.
* :mod:`~circle_jax.search.backends`: :class:`Searcher` (exact on the
  devices, or faiss Flat / HNSW / IVF).
* :mod:`~circle_jax.search.calibrate`: precision/recall/F1/accuracy at every
  threshold, named cut-points, :func:`match`, OPIS.
* :mod:`~circle_jax.search.build`: an index from a run and an image folder.
* :mod:`~circle_jax.search.cli`: ``python -m circle_jax.search``.
"""

from circle_jax.search.index import (
    GalleryIndex,
    IndexFileError,
    ModelMismatchError,
    ModelRecord,
    load,
)
from circle_jax.search.backends import BACKENDS, Neighbors, Searcher, search
from circle_jax.search.calibrate import (
    UNKNOWN,
    calibration_curve,
    cutpoints,
    match,
    opis,
)
