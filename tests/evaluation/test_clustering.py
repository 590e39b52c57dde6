"""Specification of circle_jax.evaluation.clustering."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.metrics import adjusted_mutual_info_score as sk_ami
from sklearn.metrics import normalized_mutual_info_score as sk_nmi

from circle_jax.evaluation import (
    clustering_metrics,
    kmeans,
    mutual_information_scores,
)


def _blobs(seed, num_classes, per_class, dim, spread):
  rng = np.random.default_rng(seed)
  centers = rng.standard_normal((num_classes, dim))
  centers /= np.linalg.norm(centers, axis=1, keepdims=True)
  labels = np.repeat(np.arange(num_classes), per_class)
  x = centers[labels] + spread * rng.standard_normal((labels.size, dim))
  perm = rng.permutation(labels.size)
  return x[perm].astype(np.float32), labels[perm]


# ----------------------------------------------------------------------------
# NMI / AMI.
# ----------------------------------------------------------------------------


def test_hand_computed_nmi_ami():
  # Identical partitions (up to renaming): NMI = AMI = 1.
  got = mutual_information_scores([0, 0, 1, 1], [5, 5, 3, 3])
  assert got == {"nmi": pytest.approx(1.0, abs=1e-15),
                 "ami": pytest.approx(1.0, abs=1e-15)}
  # Independent partitions of 4 items into pairs: MI = 0 so NMI = 0.
  # E[MI]: 4 cells with a = b = 2, N = 4; n_ij = 2 has probability 1/6 and
  # contributes (2/4) log(4*2/(2*2)) = log(2)/2, so E[MI] = 4 * log(2)/12.
  # H(U) = H(V) = log 2, AMI = (0 - log(2)/3) / (log 2 - log(2)/3) = -1/2.
  got = mutual_information_scores([0, 0, 1, 1], [0, 1, 0, 1])
  assert got["nmi"] == 0.0
  assert got["ami"] == pytest.approx(-0.5, abs=1e-14)
  # One class, two clusters: MI = 0; NMI 0, AMI 0 (scikit-learn convention).
  assert mutual_information_scores([1, 1, 1], [0, 0, 1]) == {"nmi": 0.0,
                                                             "ami": 0.0}
  # One class and one cluster: a perfect match by convention.
  assert mutual_information_scores([4, 4], [2, 2]) == {"nmi": 1.0, "ami": 1.0}


@pytest.mark.parametrize(
    "n, num_u, num_v, seed",
    [
        (100, 5, 7, 0),
        (1000, 50, 50, 1),
        (300, 300, 10, 2),   # every item its own class
        (2000, 600, 550, 3),  # many small classes, like SOP
        (37, 1, 3, 4),
        (37, 3, 1, 5),
        (6, 6, 6, 6),
    ],
)
def test_nmi_ami_match_scikit_learn(n, num_u, num_v, seed):
  rng = np.random.default_rng(seed)
  u = rng.integers(0, num_u, n) * 3 - 7  # arbitrary, non-contiguous ids
  # Correlated clusters: half the items copy their class (mod num_v).
  v = np.where(rng.random(n) < 0.5, u % num_v, rng.integers(0, num_v, n))
  got = mutual_information_scores(u, v)
  np.testing.assert_allclose(got["nmi"], sk_nmi(u, v), rtol=1e-12, atol=1e-14)
  # AMI is a difference of nearly equal numbers: agree to 1e-10 absolute.
  np.testing.assert_allclose(got["ami"], sk_ami(u, v), rtol=0, atol=1e-10)


def test_mutual_information_bad_inputs():
  with pytest.raises(ValueError, match="same length"):
    mutual_information_scores([0, 1], [0, 1, 1])
  with pytest.raises(TypeError, match="integer"):
    mutual_information_scores([0.0, 1.0], [0, 1])
  with pytest.raises(ValueError, match="rank 1"):
    mutual_information_scores([[0, 1]], [[0, 1]])


# ----------------------------------------------------------------------------
# k-means.
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blobs():
  return _blobs(seed=0, num_classes=6, per_class=20, dim=8, spread=0.05)


@pytest.fixture(scope="module")
def blobs_result(blobs):
  x, _ = blobs
  return kmeans(x, 6, key=jax.random.key(0))


def test_kmeans_recovers_well_separated_classes(blobs, blobs_result):
  _, y = blobs
  got = mutual_information_scores(y, blobs_result.assignments)
  assert got == {"nmi": pytest.approx(1.0, abs=1e-12),
                 "ami": pytest.approx(1.0, abs=1e-12)}
  assert 1 <= int(blobs_result.num_iterations) < 100


def test_kmeans_result_is_a_lloyd_fixed_point(blobs, blobs_result):
  x, _ = blobs
  xn = x.astype(np.float64)
  xn /= np.linalg.norm(xn, axis=1, keepdims=True)
  centers = np.asarray(blobs_result.centers, np.float64)
  a = np.asarray(blobs_result.assignments)
  assert a.shape == (x.shape[0],) and a.dtype == np.int32
  d = ((xn[:, None, :] - centers[None]) ** 2).sum(-1)
  np.testing.assert_array_equal(a, d.argmin(1))  # nearest center
  for c in range(6):  # each center is the mean of its points
    np.testing.assert_allclose(centers[c], xn[a == c].mean(0), atol=1e-6)
  np.testing.assert_allclose(float(blobs_result.inertia), d.min(1).sum(),
                             rtol=1e-4)


def test_kmeans_is_deterministic_and_chunk_invariant(blobs, blobs_result):
  x, _ = blobs
  again = kmeans(x, 6, key=jax.random.key(0), chunk_size=7)
  np.testing.assert_array_equal(again.assignments, blobs_result.assignments)
  np.testing.assert_array_equal(again.centers, blobs_result.centers)


def test_kmeans_plus_plus_seeding_spreads_centers():
  # Three tight pairs of points far apart: D^2 sampling picks one point of
  # each pair almost surely, so seeding alone (no Lloyd step) separates them.
  x = np.array([[0, 0], [0, 1e-3], [10, 0], [10, 1e-3], [0, 10], [1e-3, 10]],
               np.float32)
  for seed in range(5):
    res = kmeans(x, 3, key=jax.random.key(seed), max_iterations=0,
                 normalize=False)
    a = np.asarray(res.assignments)
    assert int(res.num_iterations) == 0
    assert a[0] == a[1] and a[2] == a[3] and a[4] == a[5]
    assert len(set(a.tolist())) == 3


def test_kmeans_with_more_clusters_than_distinct_points():
  # Only 2 distinct points but k = 3 (same shapes as the seeding test, so no
  # new compilation): no NaN, every point at distance 0 from its center.
  x = np.array([[1, 0], [1, 0], [0, 1], [0, 1], [1, 0], [0, 1]], np.float32)
  res = kmeans(x, 3, key=jax.random.key(3), normalize=False)
  assert np.all(np.isfinite(np.asarray(res.centers)))
  assert float(res.inertia) == 0.0
  a = np.asarray(res.assignments)
  assert a[0] == a[1] == a[4] and a[2] == a[3] == a[5] and a[0] != a[2]


def test_kmeans_accepts_bfloat16_jax_arrays(blobs, blobs_result):
  x, _ = blobs
  xb = jnp.asarray(x * 50.0, jnp.bfloat16)  # scale is irrelevant once normalised
  res = kmeans(xb, 6, key=jax.random.key(0))
  want = kmeans(np.asarray(xb.astype(jnp.float32)), 6, key=jax.random.key(0))
  np.testing.assert_array_equal(res.assignments, want.assignments)


def test_clustering_metrics_default_k_and_agreement_with_sklearn():
  # Overlapping blobs (same shapes as `blobs`, so no new compilation).
  x, y = _blobs(seed=1, num_classes=6, per_class=20, dim=8, spread=0.5)
  key = jax.random.key(7)
  got = clustering_metrics(x, y + 100, key=key)
  a = np.asarray(kmeans(x, 6, key=key).assignments)  # default k = 6 classes
  assert got["nmi"] == pytest.approx(sk_nmi(y, a), abs=1e-12)
  assert got["ami"] == pytest.approx(sk_ami(y, a), abs=1e-10)
  assert 0.0 < got["ami"] < got["nmi"] < 1.0  # not a trivial case
  assert clustering_metrics(x, y, key=key, num_clusters=6) == got


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(embeddings=np.ones(4, np.float32)), ValueError, "rank 2"),
        (dict(embeddings=np.ones((4, 2), np.int32)), TypeError, "floating"),
        (dict(labels=np.zeros(3, np.int32)), ValueError, "length 3"),
        (dict(num_clusters=0), ValueError, r"\[1, 4\]"),
        (dict(num_clusters=5), ValueError, r"\[1, 4\]"),
        (dict(max_iterations=-1), ValueError, ">= 0"),
        (dict(embeddings=np.full((4, 2), np.inf, np.float32)), ValueError,
         "NaN or infinite"),
    ],
)
def test_clustering_bad_inputs(kwargs, error, match):
  args = dict(embeddings=np.eye(4, 2, dtype=np.float32),
              labels=np.array([0, 0, 1, 1]), key=jax.random.key(0))
  args.update(kwargs)
  with pytest.raises(error, match=match):
    clustering_metrics(**args)


def test_a_custom_kmeans_func_equals_pmls_accuracy_calculator():
  """``kmeans_func`` (PML's AccuracyCalculator option) clusters instead of
  our k-means: NMI and AMI equal PML 2.9's with the same function."""
  pytest.importorskip("pytorch_metric_learning")
  import torch
  from pytorch_metric_learning.utils.accuracy_calculator import (
      AccuracyCalculator)
  x = np.random.default_rng(0).normal(size=(40, 3))
  y = np.repeat(np.arange(4), 10)
  seen = []

  def by_octant(emb, k):  # a deterministic "k-means": the sign pattern
    seen.append(k)
    emb = np.asarray(emb)
    return ((emb[:, 0] > 0) * 2 + (emb[:, 1] > 0)) % k

  pml = AccuracyCalculator(
      include=("NMI", "AMI"),
      kmeans_func=lambda e, k: torch.tensor(by_octant(e.numpy(), k)))
  want = pml.get_accuracy(torch.tensor(x), torch.tensor(y))
  got = clustering_metrics(x, y, kmeans_func=by_octant)
  assert seen == [4, 4]
  np.testing.assert_allclose(got["nmi"], want["NMI"], rtol=1e-9)
  np.testing.assert_allclose(got["ami"], want["AMI"], rtol=1e-9)
  with pytest.raises(ValueError, match="needs `key`"):
    clustering_metrics(x, y)
