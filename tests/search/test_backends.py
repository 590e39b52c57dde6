"""Search backends: exact on the devices, faiss where installed."""

import builtins

import jax
import numpy as np
import pytest

from circle_jax.search import backends
from circle_jax.search import index as index_lib
from tests.evaluation import test_knn

try:
  import faiss  # noqa: F401
  HAVE_FAISS = True
except ImportError:
  HAVE_FAISS = False
needs_faiss = pytest.mark.skipif(
    not HAVE_FAISS, reason="faiss-cpu is not installed (pip install "
    "circle_jax[faiss]); requirements-test.txt installs it")


def _data(n=2000, q=50, d=16, seed=0):
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(40, d))
  g = centres[rng.integers(0, 40, n)] + 0.3 * rng.normal(size=(n, d))
  x = centres[rng.integers(0, 40, q)] + 0.3 * rng.normal(size=(q, d))
  index = index_lib.GalleryIndex.from_arrays(
      g.astype(np.float32), labels=np.arange(n) % 7)
  return index, x.astype(np.float32), g


def test_exact_search_equals_numpy_brute_force_with_ids_and_labels():
  index, q, g = _data()
  nb = backends.search(index, q, 10)
  ref_s, ref_i = test_knn.brute_force(q, g, 10)
  np.testing.assert_array_equal(nb.positions, ref_i)
  np.testing.assert_allclose(nb.scores, ref_s, atol=1e-6)
  assert nb.ids[3] == [str(i) for i in ref_i[3]]
  assert nb.labels[3] == [int(i % 7) for i in ref_i[3]]


def test_exact_on_eight_devices_equals_one():
  index, q, _ = _data(seed=2)
  one = backends.search(index, q, 5, devices=jax.devices()[:1])
  eight = backends.search(index, q, 5, devices=jax.devices())
  np.testing.assert_array_equal(one.positions, eight.positions)


def test_queries_of_another_size_are_refused():
  index, _, _ = _data()
  with pytest.raises(index_lib.ModelMismatchError, match="3-d embeddings"):
    backends.search(index, np.ones((2, 3), np.float32), 1)


@needs_faiss
def test_faiss_flat_equals_exact_and_approximate_recall_is_high():
  index, q, _ = _data()
  exact = backends.search(index, q, 10)
  flat = backends.search(index, q, 10, backend="faiss-flat")
  assert np.mean(flat.positions == exact.positions) > 0.99
  np.testing.assert_allclose(flat.scores, exact.scores, atol=1e-5)
  for name in ("faiss-hnsw", "faiss-ivf"):
    approx = backends.search(index, q, 10, backend=name)
    assert backends.recall_at_k(approx.positions, exact.positions) >= 0.9


def test_missing_faiss_is_one_line(monkeypatch):
  real = builtins.__import__

  def no_faiss(name, *a, **kw):
    if name == "faiss":
      raise ImportError("No module named 'faiss'")
    return real(name, *a, **kw)
  monkeypatch.setattr(builtins, "__import__", no_faiss)
  index, _, _ = _data(n=50)
  with pytest.raises(backends.BackendError,
                     match=r"pip install circle_jax\[faiss\]"):
    backends.Searcher(index, "faiss-hnsw")


def test_recall_at_k():
  assert backends.recall_at_k(np.array([[1, 2, 3]]),
                              np.array([[3, 4, 1]])) == pytest.approx(2 / 3)
