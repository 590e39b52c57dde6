"""The class matrix sharded over 8 devices equals the whole matrix on one.

For every proxy / classifier loss with a class matrix: the value, the
gradient w.r.t. the embeddings and the gradient w.r.t. each device's class
rows, under ``jax.shard_map`` and ``jax.pmap``, against the single-device
loss with the whole matrix; with classes absent from the batch and a number
of classes that is not a multiple of the device count (padding rows). Then
PartialFC's negative-class sampling, SubCenter-ArcFace against a float64
reference, and bad input.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from circle_jax import losses

# Slow (every engine compiled per rule): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

_N = 8            # simulated devices (tests/conftest.py)
_B, _D = 16, 8    # global batch: 2 samples per device
_C = 13           # not a multiple of 8: ceil(13 / 8) = 2 rows per device
_LABELS = np.array([0, 0, 1, 2, 2, 4, 5, 5, 6, 8, 8, 9, 10, 12, 12, 1],
                   np.int32)  # classes 3, 7 and 11 absent
_X = np.random.default_rng(0).normal(size=(_B, _D)).astype(np.float32)

# name -> (loss function, K rows per class, hyperparameters).
_LOSSES = {
    "proxy_anchor": (losses.proxy_anchor_loss, 1, {"alpha": 8.0}),
    "ranked_proxy_anchor": (losses.ranked_proxy_anchor_loss, 1,
                            {"alpha": 1.2, "t_neg": 5.0}),
    "proxy_nca": (losses.proxy_nca_loss, 1, {"scale": 4.0}),
    "proxy_nca_with_positive": (losses.proxy_nca_loss, 1,
                                {"scale": 4.0, "include_positive": True}),
    "soft_triple": (losses.soft_triple_loss, 3,
                    {"centers_per_class": 3, "la": 5.0}),
    "normface": (losses.normface_loss, 1, {"scale": 5.0}),
    "cosface": (losses.cosface_loss, 1, {"scale": 5.0}),
    "arcface": (losses.arcface_loss, 1, {"scale": 5.0}),
    "subcenter_arcface": (losses.subcenter_arcface_loss, 3,
                          {"centers_per_class": 3, "scale": 5.0}),
}


def _weights(k):
  return np.random.default_rng(1).normal(size=(_C * k, _D)).astype(np.float32)


def _reference(name):
  fn, k, hyper = _LOSSES[name]
  f = functools.partial(fn, **hyper)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 2)))(
      _X, _LABELS, _weights(k))


def _sharded(name, mode):
  fn, k, hyper = _LOSSES[name]
  local = jax.value_and_grad(
      functools.partial(fn, axis_name="d", shard_classes=True,
                        num_classes=_C, **hyper), argnums=(0, 2))
  rows = losses.pad_rows(jnp.asarray(_weights(k)), _N, k)  # [8, 2 K, D]
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, (gx, gw) = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P("d"), P("d"), P("d")),
        out_specs=(P(), (P("d"), P("d")))))(
            _X, _LABELS, rows.reshape(-1, _D))
    return v, gx, gw.reshape(rows.shape)
  v, (gx, gw) = jax.pmap(local, axis_name="d")(
      _X.reshape(_N, -1, _D), _LABELS.reshape(_N, -1), rows)
  np.testing.assert_array_equal(v, np.full(_N, v[0]))  # same on every device
  return v[0], gx.reshape(_B, _D), gw


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
@pytest.mark.parametrize("name", sorted(_LOSSES))
def test_sharded_class_matrix_equals_the_whole_matrix(name, mode):
  ref_v, (ref_gx, ref_gw) = _reference(name)
  v, gx, gw = _sharded(name, mode)
  k = _LOSSES[name][1]
  np.testing.assert_allclose(v, ref_v, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(gx, ref_gx, rtol=1e-4, atol=1e-6)
  # Each device's row gradient is its slice of the whole gradient; the
  # padding rows (classes 13..15 of the last device) get exactly zero.
  want = np.asarray(losses.pad_rows(ref_gw, _N, k))
  for d in range(_N):
    np.testing.assert_allclose(gw[d], want[d], rtol=1e-4, atol=1e-6,
                               err_msg=f"device {d}")
  np.testing.assert_array_equal(np.asarray(gw[-1][k:]), 0.0)
  assert np.abs(ref_gw).max() > 0 and np.abs(ref_gx).max() > 0


def test_padding_rows_never_count_whatever_they_hold():
  """Huge or NaN-free garbage in the padding rows changes nothing."""
  fn, k, hyper = _LOSSES["proxy_anchor"]
  rows = losses.pad_rows(jnp.asarray(_weights(k)), _N, k)
  junk = rows.at[-1, 1:].set(1e6)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  f = jax.jit(jax.shard_map(
      functools.partial(fn, axis_name="d", shard_classes=True,
                        num_classes=_C, **hyper),
      mesh=mesh, in_specs=(P("d"), P("d"), P("d")), out_specs=P()))
  a = f(_X, _LABELS, rows.reshape(-1, _D))
  b = f(_X, _LABELS, junk.reshape(-1, _D))
  np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------
# PartialFC's negative-class sampling.
# ----------------------------------------------------------------------------

_SAMPLED = ("normface", "cosface", "arcface", "subcenter_arcface",
            "proxy_nca_with_positive", "soft_triple")


@pytest.mark.parametrize("name", _SAMPLED)
def test_sample_rate_one_is_exactly_the_full_loss(name):
  fn, k, hyper = _LOSSES[name]
  key = jax.random.PRNGKey(3)
  full = jax.value_and_grad(functools.partial(fn, **hyper),
                            argnums=(0, 2))(_X, _LABELS, _weights(k))
  rate_one = jax.value_and_grad(
      functools.partial(fn, sample_rate=1.0, key=key, **hyper),
      argnums=(0, 2))(_X, _LABELS, _weights(k))
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(rate_one)):
    np.testing.assert_array_equal(a, b)


def _sampled_sharded(name, rate, key, num_classes=64, batch=8):
  fn, k, hyper = _LOSSES[name]
  rng = np.random.default_rng(4)
  x = rng.normal(size=(batch, _D)).astype(np.float32)
  labels = rng.integers(0, num_classes, batch).astype(np.int32)
  w = rng.normal(size=(num_classes * k, _D)).astype(np.float32)
  rows = losses.pad_rows(jnp.asarray(w), _N, k).reshape(-1, _D)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  local = jax.value_and_grad(
      functools.partial(fn, axis_name="d", shard_classes=True,
                        num_classes=num_classes, sample_rate=rate, key=key,
                        **hyper), argnums=2)
  v, g = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P("d"), P("d"), P("d"), ),
      out_specs=(P(), P("d"))))(x, labels, rows)
  full = jax.jit(functools.partial(fn, **hyper))(x, labels, w)
  return v, g.reshape(_N, -1, k, _D), full, labels


@pytest.mark.parametrize("name", ["arcface", "subcenter_arcface"])
def test_partial_fc_keeps_the_positives_and_a_fixed_number_of_rows(name):
  key = jax.random.PRNGKey(5)
  # 64 classes over 8 devices: 8 rows each; r = 0.1 keeps max(1, batch 8)
  # = 8, i.e. every row: the exact loss.
  v, _, full, _ = _sampled_sharded(name, 0.1, key)
  np.testing.assert_allclose(v, full, rtol=1e-5)
  # 400 classes: 50 rows per device, k = max(ceil(0.3 * 50), 8) = 15.
  v, g, full, labels = _sampled_sharded(name, 0.3, key, num_classes=400)
  rows_with_grad = np.abs(np.asarray(g)).sum(axis=(2, 3)) > 0  # [8, 50]
  assert (rows_with_grad.sum(axis=1) <= 15).all()
  assert rows_with_grad.sum() > 8 * 8  # negatives sampled on every device
  assert rows_with_grad.reshape(-1)[labels].all()  # every positive kept
  # Fewer negatives in the denominator: a smaller loss than the full one.
  assert float(v) < float(full)
  # The same key samples the same classes; another key others.
  again, g2, _, _ = _sampled_sharded(name, 0.3, key, num_classes=400)
  np.testing.assert_array_equal(v, again)
  np.testing.assert_array_equal(g, g2)
  other, _, _, _ = _sampled_sharded(name, 0.3, jax.random.PRNGKey(6),
                                    num_classes=400)
  assert float(other) != float(v)


# ----------------------------------------------------------------------------
# SubCenter-ArcFace against float64 numpy, and bad input.
# ----------------------------------------------------------------------------


def _subcenter_arcface_numpy(x, labels, w, k, margin, scale):
  x = x.astype(np.float64)
  w = w.astype(np.float64)
  total = 0.0
  for i in range(x.shape[0]):
    xi = x[i] / np.linalg.norm(x[i])
    logits = []
    for c in range(w.shape[0] // k):
      cos = max(float(xi @ (w[c * k + j] / np.linalg.norm(w[c * k + j])))
                for j in range(k))
      if c == labels[i]:
        theta = np.arccos(np.clip(cos, -1.0, 1.0))
        if theta + margin <= np.pi:
          cos = np.cos(theta + margin)
        else:
          cos = cos - margin * np.sin(margin)
      logits.append(scale * cos)
    logits = np.array(logits)
    top = logits.max()
    total += np.log(np.exp(logits - top).sum()) + top - logits[labels[i]]
  return total / x.shape[0]


@pytest.mark.parametrize("k", [1, 3])
def test_subcenter_arcface_matches_a_float64_reference(k):
  w = _weights(k)
  got = losses.subcenter_arcface_loss(_X, _LABELS, w, centers_per_class=k,
                                      margin=0.5, scale=16.0)
  want = _subcenter_arcface_numpy(_X, _LABELS, w, k, 0.5, 16.0)
  np.testing.assert_allclose(float(got), want, rtol=2e-5)
  if k == 1:  # K = 1 is ArcFace
    np.testing.assert_array_equal(
        got, losses.arcface_loss(_X, _LABELS, w, scale=16.0))


def test_bad_input_is_one_clear_error():
  w = _weights(3)
  with pytest.raises(ValueError, match="not a multiple of"):
    losses.subcenter_arcface_loss(_X, _LABELS, w[:-1])
  with pytest.raises(ValueError, match="centers_per_class"):
    losses.subcenter_arcface_loss(_X, _LABELS, w, centers_per_class=0)
  with pytest.raises(ValueError, match="needs the mapped `axis_name`"):
    losses.arcface_loss(_X, _LABELS, w, shard_classes=True)
  with pytest.raises(ValueError, match="pass num_classes only with"):
    losses.arcface_loss(_X, _LABELS, w, num_classes=5)
  with pytest.raises(ValueError, match=r"sample_rate must be .* \(0, 1\]"):
    losses.cosface_loss(_X, _LABELS, w, sample_rate=0.0)
  with pytest.raises(ValueError, match="pass the step's PRNG"):
    losses.cosface_loss(_X, _LABELS, w, sample_rate=0.5)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  f = jax.shard_map(
      functools.partial(losses.normface_loss, axis_name="d",
                        shard_classes=True, num_classes=100),
      mesh=mesh, in_specs=(P("d"), P("d"), P("d")), out_specs=P())
  with pytest.raises(ValueError, match="ceil\\(C / n\\) = 13"):
    f(_X, _LABELS, jnp.zeros((16, _D)))
