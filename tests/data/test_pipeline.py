"""train_iterator / eval_iterator / global_batch."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from circle_jax import data
from tests.data import fixtures

N = 41
LABELS = np.arange(N) % 5


@pytest.fixture(scope="module")
def source():
  """An in-memory random-access source (a list) of 41 PNG records."""
  return [{"image": fixtures.encode("PNG", i, size=(11 + i % 3, 9)),
           "label": int(LABELS[i]), "path": f"im/{i:03d}.png".encode()}
          for i in range(N)]


TRAIN = data.get_preprocess("imagenet", train=True, image_size=8)
EVAL = data.get_preprocess("imagenet", train=False, image_size=8, resize_size=9)


def pk(seed=0):
  return data.PKSampler(LABELS, classes_per_batch=4, images_per_class=2,
                        seed=seed)


def take(it, n):
  out = [next(it) for _ in range(n)]
  if hasattr(it, "close"):
    it.close()
  return out


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_train_batches(source):
  s = pk()
  batches = take(data.train_iterator(source, sampler=s, preprocess=TRAIN,
                                     process_index=0, process_count=1), 5)
  for step, b in enumerate(batches):
    assert b["image"].shape == (8, 8, 8, 3) and b["image"].dtype == np.float32
    assert b["label"].dtype == np.int32
    np.testing.assert_array_equal(b["index"], s.indices(step))
    np.testing.assert_array_equal(b["label"], LABELS[b["index"]])
    assert (b["label"].reshape(4, 2) == b["label"].reshape(4, 2)[:, :1]).all()


def test_restart_continues_the_same_stream(source):
  kw = dict(sampler=pk(1), preprocess=TRAIN, process_index=0, process_count=1)
  it = data.train_iterator(source, num_threads=2, **kw)
  first = [next(it) for _ in range(2)]
  state = json.loads(json.dumps(it.get_state()))  # checkpointable as JSON
  assert state == {"step": 2}
  rest = [next(it) for _ in range(3)]
  it.close()
  resumed = data.train_iterator(source, start_step=2, num_threads=0, **kw)
  assert_batches_equal(take(resumed, 3), rest)
  other = data.train_iterator(source, num_threads=3, **kw)
  other.set_state(state)
  assert other.step == 2
  assert_batches_equal(take(other, 3), rest)
  assert not np.array_equal(first[0]["image"], rest[0]["image"])
  with pytest.raises(RuntimeError, match="closed"):
    next(it)


@pytest.mark.parametrize("sampler", [pk(2), data.RandomSampler(N, batch_size=8,
                                                              seed=2)])
def test_process_shards_assemble_the_single_process_batch(source, sampler):
  kw = dict(sampler=sampler, preprocess=TRAIN, start_step=4)
  whole = take(data.train_iterator(source, process_index=0, process_count=1,
                                   **kw), 2)
  parts = [take(data.train_iterator(source, process_index=p, process_count=4,
                                    **kw), 2) for p in range(4)]
  for step in range(2):
    for k in ("image", "label", "index"):
      np.testing.assert_array_equal(
          np.concatenate([parts[p][step][k] for p in range(4)]),
          whole[step][k])


def test_worker_processes_give_identical_batches(digits_dir):
  src = data.load_split("digits", "train", data_dir=digits_dir)
  kw = dict(sampler=data.PKSampler(data.split_labels(src), classes_per_batch=5,
                                   images_per_class=4, seed=0),
            preprocess=data.get_preprocess("grayscale", train=True,
                                           image_size=16, flip=True),
            start_step=7, process_index=0, process_count=1)
  threads = take(data.train_iterator(src, num_threads=2, **kw), 3)
  procs = take(data.train_iterator(src, num_workers=1, **kw), 3)
  assert_batches_equal(threads, procs)
  assert threads[0]["image"].shape == (20, 16, 16, 1)


@pytest.mark.parametrize("count", [1, 2])
def test_eval_covers_every_record_once_with_padding(source, count):
  seen = []
  for p in range(count):
    it = data.eval_iterator(source, preprocess=EVAL, batch_size=8,
                            process_index=p, process_count=count)
    assert len(it) == 6  # ceil(41 / 8)
    batches = list(it)
    assert len(batches) == 6
    for b in batches:
      assert b["image"].shape == (8 // count, 8, 8, 3)
      assert b["mask"].dtype == bool
      valid = b["index"][b["mask"]]
      np.testing.assert_array_equal(b["label"][b["mask"]], LABELS[valid])
      assert (b["label"][~b["mask"]] == -1).all()
      assert (b["image"][~b["mask"]] == 0).all()
      for i, x in zip(valid, b["image"][b["mask"]]):
        np.testing.assert_array_equal(x, EVAL(source[i]["image"]))
      seen.extend(valid.tolist())
  assert sorted(seen) == list(range(N))


def test_corrupt_record_is_named(source):
  bad = list(source)
  bad[3] = dict(bad[3], image=b"not an image")
  it = data.eval_iterator(bad, preprocess=EVAL, batch_size=8, process_index=0,
                          process_count=1)
  with pytest.raises(Exception, match="im/003.png"):
    list(it)


def test_global_batch_on_eight_devices(source):
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  sharding = NamedSharding(mesh, PartitionSpec("data"))
  local = take(data.train_iterator(
      source, sampler=data.PKSampler(LABELS, classes_per_batch=4,
                                     images_per_class=4, seed=0),
      preprocess=TRAIN, process_index=0, process_count=1), 1)[0]
  g = data.global_batch(local, sharding)
  assert g["image"].shape == (16, 8, 8, 3) and g["label"].shape == (16,)
  assert g["image"].sharding == sharding
  assert len(g["image"].addressable_shards) == 8
  np.testing.assert_array_equal(np.asarray(g["image"]), local["image"])
  np.testing.assert_array_equal(np.asarray(g["label"]), local["label"])


def test_bad_arguments(source):
  with pytest.raises(TypeError, match="get_preprocess"):
    data.train_iterator(source, sampler=pk(), preprocess=lambda b, r: b,
                        process_index=0, process_count=1)
  with pytest.raises(ValueError, match="not divisible"):
    data.train_iterator(source, sampler=pk(), preprocess=TRAIN,
                        process_index=0, process_count=3)
  with pytest.raises(ValueError, match="eval variant"):
    data.eval_iterator(source, preprocess=TRAIN, batch_size=8)
  with pytest.raises(ValueError, match="divisible"):
    data.eval_iterator(source, preprocess=EVAL, batch_size=9, process_index=0,
                       process_count=2)
  with pytest.raises(ValueError, match="get_state"):
    data.train_iterator(source, sampler=pk(), preprocess=TRAIN,
                        process_index=0, process_count=1).set_state({"s": 1})


def test_views_sampler_batches_two_augmented_views_labelled_by_image(source):
  """Each image twice in a row, labelled by its record index (not its
  class), and the two copies augmented differently."""
  s = data.ViewSampler(N, images_per_batch=4, views=2, seed=3)
  batches = take(data.train_iterator(source, sampler=s, preprocess=TRAIN,
                                     process_index=0, process_count=1), 3)
  for step, b in enumerate(batches):
    idx = b["index"].reshape(4, 2)
    np.testing.assert_array_equal(idx[:, 0], idx[:, 1])
    assert len(set(idx[:, 0])) == 4  # distinct images
    np.testing.assert_array_equal(b["label"], b["index"])
    np.testing.assert_array_equal(b["index"], s.indices(step))
    img = b["image"].reshape((4, 2) + b["image"].shape[1:])
    for i in range(4):  # random crops/flips: the views differ
      assert not np.array_equal(img[i, 0], img[i, 1])
  np.testing.assert_array_equal(s.indices(7), s.indices(7))
  assert not np.array_equal(s.indices(7), s.indices(8))


@pytest.mark.parametrize("kw, match", [
    (dict(images_per_batch=4, views=1), "views"),
    (dict(images_per_batch=0, views=2), "images_per_batch"),
    (dict(images_per_batch=N + 1, views=2), "images_per_batch"),
    (dict(images_per_batch=4, views=2, seed=-1), "seed")])
def test_views_sampler_bad_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    data.ViewSampler(N, **kw)
