"""Specification of circle_jax.evaluation.fewshot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.evaluation import fewshot, fewshot_accuracy, fewshot_metrics

# Slow (episodes on every device count): not in the fast tier.
pytestmark = pytest.mark.slow


def _clustered(seed, num_classes, per_class, dim, noise=1.2):
  """Noisy clusters (accuracies well inside (0, 1)), norms varied."""
  rng = np.random.default_rng(seed)
  labels = np.repeat(np.arange(num_classes) * 3 + 7, per_class)  # not 0..C-1
  centers = rng.standard_normal((labels.max() + 1, dim))
  x = centers[labels] + noise * rng.standard_normal((len(labels), dim))
  x *= rng.uniform(0.5, 2.0, (len(labels), 1))
  perm = rng.permutation(len(labels))  # classes interleaved in record order
  return x[perm].astype(np.float32), labels[perm]


def _reference(embeddings, labels, episodes, classifier):
  """Per-episode accuracies in float64 numpy, one episode and query at a time."""
  x = np.asarray(embeddings, np.float64)
  x = x / np.linalg.norm(x, axis=1, keepdims=True)
  out = []
  for classes, support, query in zip(episodes.classes, episodes.support,
                                     episodes.query):
    ways, shots = support.shape
    correct = 0
    for n in range(ways):
      for i in query[n]:
        assert labels[i] == classes[n]
        if classifier == "prototype":
          scores = []
          for m in range(ways):
            p = x[support[m]].mean(axis=0)
            scores.append(x[i] @ (p / np.linalg.norm(p)))
          pred = int(np.argmax(scores))
        else:
          sims = [x[i] @ x[j] for m in range(ways) for j in support[m]]
          pred = int(np.argmax(sims)) // shots
        correct += pred == n
    out.append(correct / query.size)
  return np.asarray(out)


# ----------------------------------------------------------------------------
# Hand-computed cases.
# ----------------------------------------------------------------------------


def _unit(*v):
  v = np.asarray(v, np.float64)
  return v / np.linalg.norm(v)


def test_hand_computed_episode_prototype_vs_nn():
  # Class 0 support a1 = (1, 0), a2 = (0, 1): prototype (1, 1)/sqrt2.
  # Class 1 support b1 ~ (0.8, 0.55), b2 = (-1, 0): prototype ~ (-0.30, 0.95).
  # Query x = (0.8, 0.6) of class 0: cos to the prototypes 0.99 vs 0.34 ->
  # class 0; its nearest support image is b1 (cos 0.9996) -> class 1.
  # Query y = (-0.6, -0.8) of class 1: prototypes -0.99 vs -0.59 -> class 1;
  # nearest support b2 (cos 0.6) -> class 1.
  emb = np.stack([_unit(1, 0), _unit(0, 1), _unit(0.8, 0.55), _unit(-1, 0),
                  _unit(0.8, 0.6), _unit(-0.6, -0.8)]).astype(np.float32)
  support = jnp.asarray([[0, 1], [2, 3]])
  query = jnp.asarray([[4], [5]])
  emb = jnp.asarray(emb)
  assert int(fewshot._num_correct(emb, support, query, "prototype")) == 2
  assert int(fewshot._num_correct(emb, support, query, "nn")) == 1


# One data set and two settings for most tests, so the device function is
# compiled a few times only (tests of chunks and devices add their own).
EMB, LABELS = _clustered(0, num_classes=9, per_class=10, dim=16)
PROTO = dict(ways=5, shots=1, queries=4, episodes=40, seed=3,
             classifier="prototype")
NN = dict(ways=4, shots=3, queries=15, episodes=40, seed=3, classifier="nn")


@pytest.mark.parametrize("kw", [PROTO, NN], ids=["prototype", "nn"])
def test_identical_embeddings_classify_everything_to_the_first_class(kw):
  # Every similarity ties; argmax takes the first class position, so each
  # episode gets exactly its first class's Q queries right: accuracy 1/N.
  r = fewshot_accuracy(np.ones_like(EMB), LABELS, **kw)
  np.testing.assert_array_equal(r.per_episode, np.full(40, 1 / kw["ways"]))
  assert r.accuracy == pytest.approx(1 / kw["ways"])
  assert r.std == 0.0 and r.ci95 == 0.0


def test_separated_classes_are_all_correct():
  emb = np.eye(16, dtype=np.float32)[LABELS % 16] * np.linspace(
      0.5, 3, len(LABELS))[:, None]
  r = fewshot_accuracy(emb, LABELS, **PROTO)
  assert r.accuracy == 1.0 and r.ci95 == 0.0 and r.queries == 4


# ----------------------------------------------------------------------------
# The float64 reference on the same episodes; the episodes themselves.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [PROTO, NN], ids=["prototype", "nn"])
def test_matches_float64_reference(kw):
  r = fewshot_accuracy(EMB, LABELS, return_episodes=True, **kw)
  want = _reference(EMB, LABELS, r.episodes, kw["classifier"])
  np.testing.assert_array_equal(r.per_episode, want)
  assert 0.2 < r.accuracy < 0.95  # neither trivial nor hopeless
  assert r.accuracy == pytest.approx(want.mean(), abs=1e-12)
  std = np.sqrt(np.sum((want - want.mean()) ** 2) / (len(want) - 1))
  assert r.std == pytest.approx(std, rel=1e-9)
  assert r.ci95 == pytest.approx(1.96 * std / np.sqrt(40), rel=1e-9)


def test_episodes_are_draws_without_replacement():
  r = fewshot_accuracy(EMB, LABELS, return_episodes=True, **NN)
  ep = r.episodes
  assert r.queries == 7  # 10 images - 3 shots: all the rest
  assert ep.classes.shape == (40, 4)
  assert ep.support.shape == (40, 4, 3) and ep.query.shape == (40, 4, 7)
  for e in range(40):
    assert len(set(ep.classes[e])) == 4
    both = np.concatenate([ep.support[e], ep.query[e]], axis=1)
    assert len(set(both.ravel())) == both.size
    np.testing.assert_array_equal(LABELS[both], np.broadcast_to(
        ep.classes[e][:, None], both.shape))
  # Every class and every image gets drawn (the draws are not stuck).
  assert set(ep.classes.ravel()) == set(LABELS)
  assert len(set(np.concatenate([ep.support.ravel(), ep.query.ravel()]))) == (
      len(LABELS))


def test_queries_per_class():
  # Omniglot-like: 20 images per class -> Q = 15 for 1 and 5 shots.
  labels = np.repeat(np.arange(25), 20)
  for shots in (1, 5):
    _, _, _, q = fewshot._class_table(labels, 20, shots, 15)
    assert q == 15
  # Classes of 20 and of 6 images, 5-way 1-shot: Q = 15 from the N-th largest
  # class, so only the five classes of 20 images can be drawn.
  labels = np.concatenate([np.repeat(np.arange(5), 20),
                           np.repeat(np.arange(5, 10), 6)])
  classes, table, counts, q = fewshot._class_table(labels, 5, 1, 15)
  assert q == 15
  np.testing.assert_array_equal(classes, np.arange(5))
  np.testing.assert_array_equal(counts, np.full(5, 20))
  np.testing.assert_array_equal(labels[table], np.repeat(classes, 20).reshape(
      5, 20))
  # 6-way: the 6th largest class has 6 images -> Q = 5, every class eligible;
  # the table is padded with -1 past each class's images.
  classes, table, counts, q = fewshot._class_table(labels, 6, 1, 15)
  assert q == 5 and len(classes) == 10
  assert (table[5:, 6:] == -1).all() and (table[:, :6] >= 0).all()


# ----------------------------------------------------------------------------
# Determinism: seed, chunks, devices.
# ----------------------------------------------------------------------------


def test_deterministic_from_seed_on_any_devices_and_chunks():
  assert len(jax.devices()) == 8
  base = fewshot_accuracy(EMB, LABELS, return_episodes=True, **PROTO)
  for devices, chunk in ((jax.devices()[:1], None), (jax.devices()[:3], 5),
                         (None, 1)):
    r = fewshot_accuracy(EMB, LABELS, devices=devices, chunk_size=chunk,
                         return_episodes=True, **PROTO)
    np.testing.assert_array_equal(r.per_episode, base.per_episode)
    for field in ("classes", "support", "query"):
      np.testing.assert_array_equal(getattr(r.episodes, field),
                                    getattr(base.episodes, field))
  other = fewshot_accuracy(EMB, LABELS, return_episodes=True,
                           **dict(PROTO, seed=4))
  assert not np.array_equal(other.episodes.support, base.episodes.support)
  # More episodes with the same seed extend the same sequence.
  more = fewshot_accuracy(EMB, LABELS, chunk_size=40, return_episodes=True,
                          **dict(PROTO, episodes=50))
  np.testing.assert_array_equal(more.episodes.query[:40], base.episodes.query)


def test_label_values_and_record_order_do_not_matter():
  r = fewshot_accuracy(EMB, LABELS, return_episodes=True, **PROTO)
  relabelled = fewshot_accuracy(EMB, LABELS * 10 - 3, return_episodes=True,
                                **PROTO)
  np.testing.assert_array_equal(r.per_episode, relabelled.per_episode)
  np.testing.assert_array_equal(r.episodes.classes * 10 - 3,
                                relabelled.episodes.classes)


def test_fewshot_metrics_keys():
  assert fewshot.metric_names((2, 5), (1, 3)) == (
      "fewshot_2way_1shot", "fewshot_2way_1shot_ci95",
      "fewshot_2way_3shot", "fewshot_2way_3shot_ci95",
      "fewshot_5way_1shot", "fewshot_5way_1shot_ci95",
      "fewshot_5way_3shot", "fewshot_5way_3shot_ci95")
  kw = {k: v for k, v in PROTO.items() if k not in ("ways", "shots")}
  m = fewshot_metrics(EMB, LABELS, ways=(5,), shots=(1,), **kw)
  r = fewshot_accuracy(EMB, LABELS, **PROTO)
  assert m == {"fewshot_5way_1shot": r.accuracy,
               "fewshot_5way_1shot_ci95": r.ci95}
  assert all(isinstance(v, float) for v in m.values())


# ----------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------


def _one_line_error(fn, match):
  with pytest.raises(ValueError, match=match) as e:
    fn()
  assert "\n" not in str(e.value)


def test_bad_input():
  emb, labels = EMB[:20], np.repeat(np.arange(4), 5)
  run = lambda **kw: fewshot_accuracy(emb, labels, **{  # noqa: E731
      "ways": 3, "shots": 1, "episodes": 2, **kw})
  _one_line_error(lambda: run(ways=5), r"`ways` = 5 but the split has only 4 "
                  r"classes; lower `ways`")
  _one_line_error(lambda: run(shots=5), r"`shots` = 5 needs 3 classes with at "
                  r"least 5 \+ 1 images .* only 0 of the split's 4 classes")
  _one_line_error(lambda: run(ways=1), r"`ways` must be >= 2")
  _one_line_error(lambda: run(classifier="knn"), r"`classifier` must be one of")
  _one_line_error(lambda: run(episodes=0), r"`episodes` must be >= 1")
  _one_line_error(lambda: fewshot_accuracy(emb[0], labels, ways=2, shots=1),
                  r"`embeddings` must have rank 2")
  _one_line_error(lambda: fewshot_accuracy(emb, labels[:-1], ways=2, shots=1),
                  r"`labels` has length 19 but `embeddings` has 20 rows")
  bad = emb.copy()
  bad[3, 0] = np.nan
  _one_line_error(lambda: fewshot_accuracy(bad, labels, ways=2, shots=1),
                  r"NaN or infinite")
  with pytest.raises(TypeError, match="`queries` must be an int"):
    run(queries=2.5)
