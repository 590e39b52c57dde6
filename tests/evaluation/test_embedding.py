"""Tests of circle_jax/evaluation/embedding.py: the evaluation's forward pass.

The shifted views and their mean by hand, the model without a normalising
head, and one split embedded in padded batches, back in record order. The
trainer's use of ``config.eval_shift`` is in tests/train/test_eval_shift.py;
the three placements embedding a split alike in tests/test_parallel.py.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import config_facts
from circle_jax import data as data_lib
from circle_jax import parallel
from circle_jax.evaluation import embedding as embedding_lib
from circle_jax.train import run as run_lib
from tests.evaluation import reference
from tests.train import helpers


def test_shifted_views_by_hand():
  x = np.arange(9.0).reshape(1, 3, 3, 1)
  views = np.asarray(embedding_lib.shifted_views(jnp.asarray(x), 1)
                     )[:, 0, :, :, 0]
  np.testing.assert_array_equal(views[0], [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
  # Down, up, right, left; the uncovered row or column repeats the edge.
  np.testing.assert_array_equal(views[1], [[0, 1, 2], [0, 1, 2], [3, 4, 5]])
  np.testing.assert_array_equal(views[2], [[3, 4, 5], [6, 7, 8], [6, 7, 8]])
  np.testing.assert_array_equal(views[3], [[0, 0, 1], [3, 3, 4], [6, 6, 7]])
  np.testing.assert_array_equal(views[4], [[1, 2, 2], [4, 5, 5], [7, 8, 8]])


class _Tiny(nn.Module):

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Conv(3, (3, 3))(x)
    return nn.Dense(4)(jnp.tanh(x).reshape(x.shape[0], -1))


@pytest.mark.parametrize("shift", [1, 2])
def test_model_apply_averages_unit_outputs_of_the_views(shift):
  model = _Tiny()
  x = np.random.default_rng(0).normal(size=(3, 6, 5, 2)).astype(np.float32)
  variables = model.init(jax.random.PRNGKey(0), x)
  plain = embedding_lib.model_apply(model)
  want = np.zeros((3, 4))
  for dy, dx in ((0, 0), (shift, 0), (-shift, 0), (0, shift), (0, -shift)):
    out = np.asarray(plain(variables, reference.shifted(x, dy, dx)),
                     np.float64)
    want += out / np.linalg.norm(out, axis=1, keepdims=True) / 5
  got = jax.jit(embedding_lib.model_apply(model, shift))(variables, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(
      embedding_lib.model_apply(model, 0)(variables, x), plain(variables, x))


def test_shifted_views_stay_sharded_with_the_batch():
  """On 8 devices each device embeds its own eighth of the batch's views:
  the per-device program does 1/8 of the one-device program's work. (Views
  stacked view-major made XLA's partitioner run the whole batch on every
  device: 8x the work on each.)"""
  model = _Tiny()
  x = np.zeros((64, 6, 5, 2), np.float32)
  variables = model.init(jax.random.PRNGKey(0), x)
  apply = embedding_lib.model_apply(model, 1)

  def flops(placement):
    fn = placement.embed_fn(apply)
    args = (placement.replicate(variables), placement.shard_batch(x))
    return fn.lower(*args).compile().cost_analysis()["flops"]

  one = flops(parallel.get_placement("none"))
  eight = flops(parallel.get_placement("shard_map"))
  assert eight == pytest.approx(one / 8, rel=0.1)


class _Raw(nn.Module):
  """Features that no head normalises (as a model for the Poincare ball)."""

  normalize: bool = False

  @nn.compact
  def __call__(self, x, train: bool = False):
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


def test_a_model_without_normalising_head_is_evaluated_on_unit_features():
  x = np.random.default_rng(1).normal(size=(4, 2, 2, 1)).astype(np.float32)
  model = _Raw()
  variables = model.init(jax.random.PRNGKey(0), x)
  raw = np.asarray(model.apply(variables, x), np.float64)
  assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
  got = embedding_lib.model_apply(model)(variables, x)
  np.testing.assert_allclose(
      got, raw / np.linalg.norm(raw, axis=1, keepdims=True), rtol=1e-5)
  assert embedding_lib.model_apply(model.clone(normalize=True))(
      variables, x).shape == (4, 3)
  np.testing.assert_allclose(
      embedding_lib.model_apply(model.clone(normalize=True))(variables, x),
      raw, rtol=1e-5)


def test_eval_apply_reads_the_configs_shift():
  model = _Tiny()
  x = np.random.default_rng(2).normal(size=(2, 5, 5, 2)).astype(np.float32)
  variables = model.init(jax.random.PRNGKey(0), x)
  c = helpers.digits_config(eval_shift=0)
  np.testing.assert_array_equal(
      embedding_lib.eval_apply(c, model)(variables, x),
      embedding_lib.model_apply(model)(variables, x))
  c.eval_shift = 2
  np.testing.assert_array_equal(
      embedding_lib.eval_apply(c, model)(variables, x),
      embedding_lib.model_apply(model, 2)(variables, x))


def test_embed_split_returns_every_record_once_in_order(tmp_path):
  """896 digits records in batches of 100: the last batch is padded, the
  padding is dropped, and output ``i`` is record ``i`` preprocessed."""
  c = helpers.digits_config(**{"dataset.data_dir": str(tmp_path)})
  info = data_lib.get_dataset_info("digits")
  source = run_lib.load_split(c, info, info.eval_splits[0])
  preprocess = config_facts.eval_preprocess(c, info)

  def apply_fn(variables, images):  # any trailing shape is kept
    return images[:, ::4, ::4, 0] * variables["scale"]

  out, labels = embedding_lib.embed_split(
      {"scale": np.float32(2.0)}, apply_fn, source, preprocess,
      placement=parallel.SingleDevice(), batch_size=100, num_threads=2)
  n = len(source)
  assert n % 100 and out.shape == (n, 4, 4) and out.dtype == np.float32
  np.testing.assert_array_equal(labels, [source[i]["label"] for i in range(n)])
  for i in (0, 1, 99, 100, n - 1):
    want = 2.0 * preprocess(source[i]["image"])[::4, ::4, 0]
    np.testing.assert_allclose(out[i], want, rtol=1e-6)


def _bilinear_rotated(x, angle, dy, dx):
  """Naive float64 loop: ``x`` [n, H, W, C] rotated by ``angle`` degrees
  counter-clockwise about its centre, then moved by ``(dy, dx)``; positions
  outside take the nearest edge pixel."""
  n, h, w, c = x.shape
  t = np.deg2rad(angle)
  cy, cx = (h - 1) / 2, (w - 1) / 2
  out = np.zeros(x.shape, np.float64)
  for i in range(h):
    for j in range(w):
      y0, x0 = i - cy - dy, j - cx - dx
      sy = min(max(np.cos(t) * y0 + np.sin(t) * x0 + cy, 0), h - 1)
      sx = min(max(-np.sin(t) * y0 + np.cos(t) * x0 + cx, 0), w - 1)
      fy, fx = int(np.floor(sy)), int(np.floor(sx))
      gy, gx = min(fy + 1, h - 1), min(fx + 1, w - 1)
      ay, ax = sy - fy, sx - fx
      out[:, i, j] = ((1 - ay) * (1 - ax) * x[:, fy, fx]
                      + (1 - ay) * ax * x[:, fy, gx]
                      + ay * (1 - ax) * x[:, gy, fx] + ay * ax * x[:, gy, gx])
  return out


def test_affine_views_shift_exactly_and_rotate_like_a_naive_loop():
  x = np.random.default_rng(3).normal(size=(2, 7, 6, 2)).astype(np.float32)
  views = np.asarray(embedding_lib.affine_views(jnp.asarray(x), shift=1,
                                                angles=(0.0, 10.0)))
  assert views.shape == (18, 2, 7, 6, 2)
  grid = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
  for k, (dy, dx) in enumerate(grid):  # angle 0: exact integer shifts
    np.testing.assert_allclose(views[k], reference.shifted(x, dy, dx),
                               atol=1e-6)
    np.testing.assert_allclose(views[9 + k],
                               _bilinear_rotated(x, 10.0, dy, dx), atol=1e-5)
  square = np.arange(16.0, dtype=np.float32).reshape(1, 4, 4, 1)
  turned = embedding_lib.affine_views(jnp.asarray(square), shift=0,
                                      angles=(90.0,))[0, 0, :, :, 0]
  np.testing.assert_allclose(turned, np.rot90(square[0, :, :, 0]), atol=1e-5)


def test_views_apply_embeds_each_view_to_a_unit_vector():
  model = _Tiny()
  x = np.random.default_rng(4).normal(size=(3, 6, 6, 2)).astype(np.float32)
  variables = model.init(jax.random.PRNGKey(0), x)
  got = np.asarray(jax.jit(embedding_lib.views_apply(
      model, shift=1, angles=(-10.0, 0.0)))(variables, x))
  assert got.shape == (3, 18, 4)
  views = embedding_lib.affine_views(jnp.asarray(x), shift=1,
                                     angles=(-10.0, 0.0))
  for v in range(18):
    out = np.asarray(model.apply(variables, views[v]), np.float64)
    np.testing.assert_allclose(
        got[:, v], out / np.linalg.norm(out, axis=1, keepdims=True),
        rtol=1e-5, atol=1e-6)
