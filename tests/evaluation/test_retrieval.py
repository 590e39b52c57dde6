"""Specification of circle_jax.evaluation.retrieval."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from circle_jax.evaluation import retrieval_metrics
from circle_jax.evaluation import retrieval
from circle_jax.evaluation import tiled_ranking
from tests.evaluation import reference

ONE_DEVICE = jax.devices()[:1]


def _circle(degrees):
  a = np.deg2rad(np.asarray(degrees, np.float64))
  return np.stack([np.cos(a), np.sin(a)], axis=1).astype(np.float32)


def _clustered(seed, num_items, dim, num_classes, noise):
  rng = np.random.default_rng(seed)
  centers = rng.standard_normal((num_classes, dim))
  labels = rng.integers(0, num_classes, num_items)
  x = centers[labels] + noise * rng.standard_normal((num_items, dim))
  x *= rng.uniform(0.5, 2.0, (num_items, 1))  # norms must not matter
  return x.astype(np.float32), labels


# ----------------------------------------------------------------------------
# Hand-computed cases.
# ----------------------------------------------------------------------------


def test_hand_computed_self_retrieval():
  # Angles (deg) and labels. Each query's ranking is by angular distance:
  #   q0 ( 0,A): 1A 2B 3A 4B 5C  R=2 first=1  R-prec 1/2  MAP (1/1)/2
  #   q1 (10,A): 0A 2B 3A 4B 5C  R=2 first=1  R-prec 1/2  MAP 1/2
  #   q2 (25,B): 1A 3A 0A 4B 5C  R=1 first=4  R-prec 0    MAP 0
  #   q3 (42,A): 2B 1A 4B 0A 5C  R=2 first=2  R-prec 1/2  MAP (1/2)/2
  #   q4 (80,B): 3A 2B 1A 0A 5C  R=1 first=2  R-prec 0    MAP 0
  #   q5 (200,C): no other C -> left out.
  x = _circle([0, 10, 25, 42, 80, 200])
  y = np.array([0, 0, 1, 0, 1, 2])
  got = retrieval_metrics(x, y, ks=(1, 2, 3, 4, 8), devices=ONE_DEVICE)
  assert got == {
      "recall@1": 2 / 5,
      "recall@2": 4 / 5,
      "recall@3": 4 / 5,
      "recall@4": 1.0,
      "recall@8": 1.0,  # K larger than the gallery
      "precision@1": 2 / 5,
      "r_precision": pytest.approx(1.5 / 5, abs=1e-15),
      "map@r": pytest.approx(1.25 / 5, abs=1e-15),
      "num_queries": 6,
      "num_queries_without_match": 1,
  }


_ALL_METRICS = retrieval.METRICS


def test_hand_computed_mrr_and_map_and_their_class_averages():
  # The case of test_hand_computed_self_retrieval; the relevant items' ranks:
  #   q0 (A): 1, 3  AP (1/1 + 2/3)/2 = 5/6  RR 1
  #   q1 (A): 1, 3  AP 5/6                 RR 1
  #   q2 (B): 4     AP 1/4                 RR 1/4
  #   q3 (A): 2, 4  AP (1/2 + 2/4)/2 = 1/2 RR 1/2
  #   q4 (B): 2     AP 1/2                 RR 1/2
  # Per class: A (q0, q1, q3) AP 13/18, RR 5/6; B (q2, q4) AP 3/8, RR 3/8.
  x = _circle([0, 10, 25, 42, 80, 200])
  y = np.array([0, 0, 1, 0, 1, 2])
  kw = dict(ks=(1,), metrics=_ALL_METRICS, devices=ONE_DEVICE)
  got = retrieval_metrics(x, y, **kw)
  assert got["mean_average_precision"] == pytest.approx(7 / 12, abs=1e-15)
  assert got["mean_reciprocal_rank"] == pytest.approx(0.65, abs=1e-15)
  assert got["map@r"] == pytest.approx(1.25 / 5, abs=1e-15)
  avg = retrieval_metrics(x, y, avg_of_avgs=True, **kw)
  assert avg["mean_average_precision"] == pytest.approx(
      (13 / 18 + 3 / 8) / 2, abs=1e-15)
  assert avg["mean_reciprocal_rank"] == pytest.approx(
      (5 / 6 + 3 / 8) / 2, abs=1e-15)
  assert avg["recall@1"] == pytest.approx((2 / 3 + 0) / 2, abs=1e-15)
  per = retrieval_metrics(x, y, return_per_class=True, **kw)
  assert per["classes"] == [0, 1]  # class 2 has no match: left out
  np.testing.assert_allclose(per["mean_average_precision"], [13 / 18, 3 / 8],
                             rtol=1e-15)
  np.testing.assert_allclose(per["mean_reciprocal_rank"], [5 / 6, 3 / 8],
                             rtol=1e-15)
  assert per["num_queries_without_match"] == 1
  # Label sets that intersect: item 4 (B) also carries A, so it is relevant
  # to the A queries, at ranks 4 (q0, q1) and 3 (q3, ranking 2B 1A 4AB 0A):
  # APs (1/1 + 2/3 + 3/4)/3 (q0, q1) and (1/2 + 2/3 + 3/4)/3 (q3).
  multi = np.eye(3, dtype=np.int32)[y]
  multi[4, 0] = 1
  per = retrieval_metrics(x, multi, return_per_class=True, **kw)
  assert per["classes"] == [(0, 1, 0), (1, 0, 0), (1, 1, 0)]
  assert per["mean_average_precision"][1] == pytest.approx(
      (2 * (1 + 2 / 3 + 3 / 4) / 3 + (1 / 2 + 2 / 3 + 3 / 4) / 3) / 3,
      abs=1e-15)


@pytest.mark.parametrize("swap", [False, True])
def test_hand_computed_tie_broken_by_gallery_index(swap):
  # Gallery items 1 and 2 are the same vector: an exact tie (similarity 1)
  # resolved in favour of the lower index. Item 0 is orthogonal (similarity 0).
  # Item 1 is also the query vector itself: with a separate gallery nothing is
  # excluded, so it is retrieved first.
  q = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
  q_lab = np.array([0, 7])  # the second query's class is not in the gallery
  g = np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]], np.float32)
  g_lab = np.array([0, 0, 1]) if swap else np.array([0, 1, 0])
  got = retrieval_metrics(q, q_lab, g, g_lab, ks=(1, 2, 3),
                          devices=ONE_DEVICE)
  # Query 0 ranks 1, 2, 0. R = 2.
  if swap:  # relevance 1, 0, 1
    want = {"recall@1": 1.0, "precision@1": 1.0, "r_precision": 0.5,
            "map@r": 0.5}
  else:  # relevance 0, 1, 1
    want = {"recall@1": 0.0, "precision@1": 0.0, "r_precision": 0.5,
            "map@r": 0.25}
  want.update({"recall@2": 1.0, "recall@3": 1.0, "num_queries": 2,
               "num_queries_without_match": 1})
  assert got == want


def test_ties_among_duplicates_in_self_retrieval():
  # Six copies of one vector: every similarity ties, so each ranking is the
  # gallery order without the query itself. Labels a b a b a b, R = 2:
  #   q0: 1b 2a 3b 4a 5b  first=2  top2 0 1  R-prec 1/2  MAP 1/4
  #   q1: 0a 2a 3b 4a 5b  first=3  top2 0 0  R-prec 0    MAP 0
  #   q2: 0a 1b 3b 4a 5b  first=1  top2 1 0  R-prec 1/2  MAP 1/2
  #   q3: 0a 1b 2a 4a 5b  first=2  top2 0 1  R-prec 1/2  MAP 1/4
  #   q4: 0a 1b 2a 3b 5b  first=1  top2 1 0  R-prec 1/2  MAP 1/2
  #   q5: 0a 1b 2a 3b 4a  first=2  top2 0 1  R-prec 1/2  MAP 1/4
  x = np.tile(np.array([[0.6, 0.8]], np.float32), (6, 1))
  y = np.array([0, 1, 0, 1, 0, 1])
  got = retrieval_metrics(x, y, ks=(1, 2, 3), devices=ONE_DEVICE)
  assert got == {"recall@1": 2 / 6, "recall@2": 5 / 6, "recall@3": 1.0,
                 "precision@1": 2 / 6,
                 "r_precision": pytest.approx(2.5 / 6, abs=1e-15),
                 "map@r": pytest.approx(1.75 / 6, abs=1e-15),
                 "num_queries": 6, "num_queries_without_match": 0}


def test_zero_vectors_tie_at_zero_similarity():
  # A zero gallery vector has similarity 0 to everything, like the orthogonal
  # item 0; the tie at 0 goes to the lower index.
  q = np.array([[1.0, 0.0]], np.float32)
  g = np.array([[0.0, 1.0], [0.0, 0.0], [-1.0, 0.0]], np.float32)
  got0 = retrieval_metrics(q, [5], g, np.array([1, 5, 5]), ks=(1, 2),
                           devices=ONE_DEVICE)
  got1 = retrieval_metrics(q, [5], g, np.array([5, 1, 5]), ks=(1, 2),
                           devices=ONE_DEVICE)
  # Ranking 0, 1, 2 in both cases; R = 2.
  assert (got0["recall@1"], got0["recall@2"], got0["map@r"]) == (0.0, 1.0, 0.25)
  assert (got1["recall@1"], got1["map@r"]) == (1.0, 0.5)


@pytest.mark.parametrize("self_mode", [True, False])
def test_match_with_negative_similarity_is_ranked_last(self_mode):
  # The only match points away from the query: ranked after the orthogonal
  # item (and after nothing else: not the query itself, not padding).
  x = _circle([0, 90, 180])
  if self_mode:
    got = retrieval_metrics(x, [5, 1, 5], ks=(1, 2, 3), devices=ONE_DEVICE)
    # Query 0: [90 (other), 180 (match)]; query 2 likewise; query 1: none.
    assert got["num_queries_without_match"] == 1
  else:
    got = retrieval_metrics(x[:1], [5], x[1:], [1, 5], ks=(1, 2, 3),
                            devices=ONE_DEVICE)
  assert (got["recall@1"], got["recall@2"], got["recall@3"]) == (0.0, 1.0, 1.0)
  assert (got["r_precision"], got["map@r"]) == (0.0, 0.0)


def test_no_query_has_a_match(caplog):
  x = _circle([0, 90, 180])
  with caplog.at_level(logging.WARNING):
    got = retrieval_metrics(x, np.array([0, 1, 2]), ks=(1, 5),
                            devices=ONE_DEVICE)
  assert got == {"recall@1": 0.0, "recall@5": 0.0, "precision@1": 0.0,
                 "r_precision": 0.0, "map@r": 0.0, "num_queries": 3,
                 "num_queries_without_match": 3}
  assert "none of the 3 queries" in caplog.text


def test_single_item_self_retrieval():
  got = retrieval_metrics(np.ones((1, 4), np.float32), [3],
                          devices=ONE_DEVICE)
  assert got["num_queries_without_match"] == 1 and got["map@r"] == 0.0


# ----------------------------------------------------------------------------
# Parity with the float64 brute-force reference.
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clustered():
  x, y = _clustered(seed=2, num_items=160, dim=16, num_classes=30, noise=0.9)
  return x, y


def _assert_facts_equal(got, want_facts):
  rank_first, rel, r, _ = got
  for i, f in enumerate(want_facts):
    assert r[i] == f["r"], i
    if f["r"]:
      assert rank_first[i] == f["rank_first"], i
      np.testing.assert_array_equal(rel[i, : f["r"]], f["rel"][: f["r"]])


def test_self_retrieval_matches_reference(clustered):
  x, y = clustered
  ks = (1, 2, 4, 8, 16, 500)
  want_facts = reference.rank_queries(x, y)
  # Precondition: no near-ties where rounding could reorder the ranking.
  assert reference.min_gap_in_top(want_facts, len(x)) > 1e-5
  assert sum(f["r"] == 0 for f in want_facts) > 0  # singleton classes
  got = retrieval_metrics(x, y, ks=ks, chunk_size=48, devices=ONE_DEVICE)
  want = reference.retrieval_metrics(x, y, ks=ks)
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-12, err_msg=key)
  _assert_facts_equal(
      tiled_ranking.rank_queries(x, y, x, y, True, 48, tuple(ONE_DEVICE)),
      want_facts)
  # The two code paths for the first relevant item agree.
  assert got["precision@1"] == got["recall@1"]


def test_query_gallery_retrieval_matches_reference(clustered):
  x, y = clustered
  q, q_lab, g, g_lab = x[:50], y[:50], x[50:], y[50:]
  q_lab = q_lab.copy()
  q_lab[:3] = 99  # classes without gallery items
  ks = (1, 3, 10, 200)
  want_facts = reference.rank_queries(q, q_lab, g, g_lab)
  assert reference.min_gap_in_top(want_facts, len(x)) > 1e-5
  got = retrieval_metrics(q, q_lab, g, g_lab, ks=ks, devices=ONE_DEVICE)
  want = reference.retrieval_metrics(q, q_lab, g, g_lab, ks=ks)
  assert got["num_queries_without_match"] >= 3
  for key in want:
    np.testing.assert_allclose(got[key], want[key], rtol=1e-12, err_msg=key)


# ----------------------------------------------------------------------------
# Chunking, tiling and devices do not change anything.
# ----------------------------------------------------------------------------


@pytest.fixture
def small_tiles(monkeypatch):
  """Gallery tiles of 64 rows, so that 160 items span several tiles, and
  blocks of 4 items, so that the top-k pre-selection picks a few of many
  blocks."""
  monkeypatch.setattr(tiled_ranking, "_MAX_TILE", 64)
  monkeypatch.setattr(tiled_ranking, "_BLOCK", 4)


def _facts(x, y, chunk_size, devices, self_mode=True):
  if self_mode:
    return tiled_ranking.rank_queries(x, y, x, y, True, chunk_size, devices)
  return tiled_ranking.rank_queries(x[:70], y[:70], x[70:], y[70:], False,
                                    chunk_size, devices)


@pytest.mark.parametrize("self_mode", [True, False])
def test_chunked_tiled_and_sharded_results_are_identical(
    clustered, small_tiles, self_mode):
  x, y = clustered
  devs = jax.devices()
  assert len(devs) == 8, "tests/conftest.py simulates 8 CPU devices"
  # Precondition: one device's 40 blocks are many more than the k + 2 that
  # the pre-selection keeps, so it is exercised.
  _, counts = np.unique(y, return_counts=True)
  assert counts.max() + 2 < 160 // 4 // 2
  base = _facts(x, y, 1024, tuple(devs[:1]), self_mode)  # one query chunk
  # Each variant is one compilation: keep the list short.
  if self_mode:
    variants = {"chunk 8": (8, devs[:1]), "3 devices, chunk 40": (40, devs[:3]),
                "8 devices, chunk 40": (40, devs)}
  else:
    variants = {"8 devices, chunk 24": (24, devs)}
  for name, (chunk, d) in variants.items():
    got = _facts(x, y, chunk, tuple(d), self_mode)
    for a, b in zip(got, base):
      np.testing.assert_array_equal(a, b, err_msg=name)
  # And the multi-tile layout agrees with the float64 reference.
  if self_mode:
    _assert_facts_equal(base, reference.rank_queries(x, y))
  else:
    want = reference.rank_queries(x[:70], y[:70], x[70:], y[70:])
    assert reference.min_gap_in_top(want, len(x)) > 1e-5
    _assert_facts_equal(base, want)


def test_one_device_equals_eight_devices_metrics(clustered):
  x, y = clustered
  ks = (1, 2, 4, 8, 16, 500)  # as in test_self_retrieval_matches_reference
  one = retrieval_metrics(x, y, ks=ks, chunk_size=48, devices=ONE_DEVICE)
  default = retrieval_metrics(x, y, ks=ks, chunk_size=48)  # all 8 devices
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  meshed = retrieval_metrics(x, y, ks=ks, chunk_size=48, mesh=mesh)
  assert one == default == meshed


# PML 2.9's AccuracyCalculator names of our metrics.
_PML_NAMES = {"precision@1": "precision_at_1", "r_precision": "r_precision",
              "map@r": "mean_average_precision_at_r",
              "mean_reciprocal_rank": "mean_reciprocal_rank",
              "mean_average_precision": "mean_average_precision"}


def _pml_intersect(a, b):
  """Multi-hot label sets intersect (numpy and torch alike)."""
  return (a * b).sum(-1) > 0


def _pml_accuracy(x, y, xg=None, yg=None, fn=None, **options):
  torch = pytest.importorskip("torch")
  acc = pytest.importorskip("pytorch_metric_learning.utils.accuracy_calculator")
  calc = acc.AccuracyCalculator(
      include=tuple(_PML_NAMES.values()), label_comparison_fn=fn,
      device=torch.device("cpu"), **options)
  t = lambda a: None if a is None else torch.from_numpy(np.asarray(a))
  return calc.get_accuracy(t(x), t(y), t(xg), t(yg))


def _random_retrieval(seed, n, labels):
  """Unit float64 embeddings without near-ties, and their labels."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, 8))
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  s = np.sort(x @ x.T, axis=1)[:, :-1]  # each row without itself
  assert np.diff(s, axis=1).min() > 1e-6  # distinct similarities
  return x, labels(rng, n)


def _assert_equals_pml(split, options, **kwargs):
  multi = split[1].ndim == 2
  want = _pml_accuracy(*split, fn=_pml_intersect if multi else None,
                       **options)
  got = retrieval_metrics(*split, ks=(1,), metrics=_ALL_METRICS, **options,
                          **kwargs)
  for ours, theirs in _PML_NAMES.items():
    np.testing.assert_allclose(got[ours], want[theirs], rtol=1e-6,
                               err_msg=f"{options} {ours}")
  # recall@1 is PML's precision_at_1, averaged alike.
  np.testing.assert_allclose(got["recall@1"], want["precision_at_1"],
                             rtol=1e-6)
  return got


_PML_OPTIONS = ({}, {"avg_of_avgs": True}, {"return_per_class": True})


def test_equals_pytorch_metric_learning_accuracy_calculator():
  # Class ids in self-retrieval, two singleton classes without a match (the
  # multi-hot labels from queries to a gallery: the next test).
  x, y = _random_retrieval(0, 40, lambda rng, n: rng.integers(0, 6, n))
  y[:2] = (7, 8)
  for options in _PML_OPTIONS:
    _assert_equals_pml((x, y), options, devices=ONE_DEVICE)


def test_new_metrics_chunked_tiled_and_sharded_are_identical(small_tiles):
  # Multi-hot label sets (the q_pos relevance path; some empty: no match)
  # from 60 queries to a gallery of 100, and every relevant item's rank
  # (mAP): on one device in one chunk over 2 tiles, and on 8 devices in
  # chunks of 8, each equal to PML 2.9.
  x, y = _random_retrieval(
      5, 160, lambda rng, n: (rng.random((n, 12)) < 0.06).astype(np.int64))
  split = (x[:60], y[:60], x[60:], y[60:])
  for options in _PML_OPTIONS:
    one = _assert_equals_pml(split, options, chunk_size=1024,
                             devices=ONE_DEVICE)
    assert _assert_equals_pml(split, options, chunk_size=8) == one


def test_inputs_as_jax_arrays_and_bfloat16(clustered):
  x, y = clustered
  xb = jnp.asarray(x, jnp.bfloat16)
  got = retrieval_metrics(xb, jnp.asarray(y), ks=(1, 4), chunk_size=48,
                          devices=ONE_DEVICE)
  want = retrieval_metrics(np.asarray(xb.astype(jnp.float32)), y, ks=(1, 4),
                           chunk_size=48, devices=ONE_DEVICE)
  assert got == want
  assert all(type(v) is float for k, v in got.items() if not
             k.startswith("num_"))
  assert type(got["num_queries"]) is int


def test_int64_labels_beyond_int32_range():
  # The hand-computed case with labels that do not fit in int32.
  x = _circle([0, 10, 25, 42, 80, 200])
  a, b = 2**40, -(2**40)
  y = np.array([a, a, b, a, b, 2**62], np.int64)
  got = retrieval_metrics(x, y, ks=(1, 2), devices=ONE_DEVICE)
  assert (got["recall@1"], got["recall@2"]) == (2 / 5, 4 / 5)
  assert got["num_queries_without_match"] == 1


# ----------------------------------------------------------------------------
# Ks and input checks.
# ----------------------------------------------------------------------------


def test_ks_are_sorted_and_deduplicated():
  x = _circle([0, 10, 25, 42, 80, 200])
  got = retrieval_metrics(x, [0, 0, 1, 0, 1, 2], ks=[4, 1, 4],
                          devices=ONE_DEVICE)
  assert [k for k in got if k.startswith("recall")] == ["recall@1", "recall@4"]


_X = np.ones((4, 3), np.float32)
_Y = np.array([0, 0, 1, 1])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(query=_X[0]), ValueError, "rank 2"),
        (dict(query=_X.astype(np.int32)), TypeError, "floating"),
        (dict(query=np.zeros((0, 3), np.float32), query_labels=_Y[:0]),
         ValueError, "empty"),
        (dict(query=np.where(_X > 0, np.nan, 0).astype(np.float32)),
         ValueError, "NaN"),
        (dict(query_labels=_Y[:3]), ValueError, "length 3"),
        (dict(query_labels=_Y.astype(np.float32)), TypeError, "integer"),
        (dict(query_labels=_Y[:, None, None]), ValueError, "rank 1"),
        (dict(query_labels=_Y[:, None] * 2), ValueError, "only 0 and 1"),
        (dict(gallery=_X, gallery_labels=_Y[:, None]), ValueError,
         "past the first axis"),
        (dict(label_comparison_fn=lambda a, b: a == 0), ValueError,
         "must return"),
        (dict(label_comparison_fn=3), TypeError, "callable"),
        (dict(metrics=("mAP",)), ValueError, "Unknown retrieval metric"),
        (dict(avg_of_avgs=True, return_per_class=True), ValueError,
         "mutually exclusive"),
        (dict(gallery=_X), ValueError, "both"),
        (dict(gallery_labels=_Y), ValueError, "both"),
        (dict(gallery=np.ones((4, 5), np.float32), gallery_labels=_Y),
         ValueError, "dimension 5"),
        (dict(gallery=_X, gallery_labels=_Y[:2]), ValueError, "length 2"),
        (dict(ks=()), ValueError, "at least one"),
        (dict(ks=(1, 0)), ValueError, "positive"),
        (dict(ks=(1.5,)), ValueError, "positive"),
        (dict(chunk_size=0), ValueError, ">= 1"),
        (dict(chunk_size=2.0), TypeError, "int"),
        (dict(devices=[]), ValueError, "empty"),
        (dict(mesh="cpu"), TypeError, "Mesh"),
    ],
)
def test_bad_inputs(kwargs, error, match):
  args = dict(query=_X, query_labels=_Y)
  args.update(kwargs)
  with pytest.raises(error, match=match):
    retrieval_metrics(**args)


def test_mesh_and_devices_are_exclusive():
  mesh = Mesh(np.array(jax.devices()), ("d",))
  with pytest.raises(ValueError, match="not both"):
    retrieval_metrics(_X, _Y, mesh=mesh, devices=jax.devices())
  with pytest.raises(ValueError, match="twice"):
    retrieval_metrics(_X, _Y, devices=jax.devices()[:1] * 2)


def test_same_parent_metrics_equal_pmls_with_same_parent_label_tester():
  """Three label levels (class, parent, grandparent): ours equals PML 2.9's
  WithSameParentLabelTester (on L2-normalised embeddings, where its L2 k-NN
  ranks as cosine does) per level and on average; bad labels fail."""
  pytest.importorskip("pytorch_metric_learning")
  import torch
  from pytorch_metric_learning.testers import WithSameParentLabelTester
  from pytorch_metric_learning.utils.accuracy_calculator import (
      AccuracyCalculator)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 4))
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  # Groups of one size per level: two device programs in all.
  child = rng.permutation(np.arange(32) % 8)
  labels = np.stack([child, child // 2, child // 4], 1)
  tester = WithSameParentLabelTester(
      accuracy_calculator=AccuracyCalculator(
          include=("precision_at_1", "r_precision",
                   "mean_average_precision_at_r"), k="max_bin_count"),
      label_hierarchy_level="all")
  want = {}
  tester.do_knn_and_accuracies(
      want, {"val": (torch.tensor(x, dtype=torch.float32),
                     torch.tensor(labels))}, "val", ["val"])
  got = retrieval.same_parent_metrics(x, labels, ks=(1,))
  names = {"precision@1": "precision_at_1", "r_precision": "r_precision",
           "map@r": "mean_average_precision_at_r"}
  for ours, theirs in names.items():
    for level in ("level0", "level1"):
      np.testing.assert_allclose(got[f"{ours}_{level}"],
                                 want[f"{theirs}_{level}"], rtol=1e-6)
    np.testing.assert_allclose(got[f"{ours}_average"],
                               want[f"AVERAGE_{theirs}"], rtol=1e-6)
  assert got["precision@1_level0"] != got["precision@1_level1"]
  with pytest.raises(ValueError, match="H >= 2"):
    retrieval.same_parent_metrics(x, child)
  with pytest.raises(ValueError, match="levels"):
    retrieval.same_parent_metrics(x, labels, levels=(2,))
