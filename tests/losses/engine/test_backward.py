"""Tests of the tiled engines' backward pass
(circle_jax/losses/engine/backward.py): values and gradients of the
blockwise engine, on one device and across devices, equal the dense
engine's."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

import circle_jax.losses as losses
from tests.losses.engine import cases
from tests.losses.engine.cases import B, LABELS, PUBLIC, embeddings, miner_masks


def _assert_vg_close(got, want):
  """Value to float32 rounding; gradient to rounding of its largest entry."""
  scale = float(jnp.max(jnp.abs(want[1])))
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(got[1], want[1], rtol=1e-5, atol=2e-5 * scale)


def _vg(fn, x, **kw):
  return jax.jit(jax.value_and_grad(
      lambda x: fn(x, jnp.asarray(LABELS), **kw)))(jnp.asarray(x))


@functools.lru_cache(maxsize=None)
def _dense(name):
  """The dense engine's value and gradient of PUBLIC[name] on
  ``embeddings()``: the reference of every block size and device layout
  below, compiled once per loss and process."""
  fn, hyper = PUBLIC[name]
  return _vg(fn, embeddings(), **hyper)


# The fast tier (CONTRIBUTING.md) keeps the smallest block (the most tiles)
# and shard_map; CI runs every case.
@pytest.mark.parametrize("block_size", [
    3, pytest.param(5, marks=pytest.mark.slow),
    pytest.param(16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_blockwise_equals_dense(name, block_size):
  fn, hyper = PUBLIC[name]
  x = embeddings()
  want = _dense(name)
  got = _vg(fn, x, block_size=block_size, **hyper)
  assert float(jnp.max(jnp.abs(want[1]))) > 1e-4
  _assert_vg_close(got, want)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_blockwise_equals_dense_with_miner_masks(name):
  fn, hyper = PUBLIC[name]
  pm, nm = miner_masks()
  x = embeddings(seed=4)
  want = _vg(fn, x, pos_mask=pm, neg_mask=nm, **hyper)
  got = _vg(fn, x, pos_mask=pm, neg_mask=nm, block_size=5, **hyper)
  _assert_vg_close(got, want)


@pytest.mark.parametrize("name", ["circle", "ms", "rll"])
def test_blockwise_all_sets_empty_gives_zero_and_zero_gradient(name):
  fn, hyper = PUBLIC[name]
  labels = jnp.arange(B, dtype=jnp.int32)  # no positives at all
  x = jnp.asarray(embeddings())
  for block_size in (None, 5):
    v, g = jax.value_and_grad(lambda x: fn(x, labels, block_size=block_size,
                                           **hyper))(x)
    if name != "rll":  # RLL still has its negative term
      assert float(v) == 0.0
      np.testing.assert_array_equal(np.asarray(g), 0.0)
    assert np.all(np.isfinite(np.asarray(g)))


def _mesh():
  return Mesh(np.array(jax.devices()), ("d",))


@pytest.mark.parametrize("mode", [
    "shard_map", pytest.param("pmap", marks=pytest.mark.slow)])
@pytest.mark.parametrize("block_size", [None, 3])
@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_axis_name_equals_single_device(name, block_size, mode):
  fn, hyper = PUBLIC[name]
  x = embeddings()
  want = _dense(name)
  n = jax.device_count()

  def local(x, labels):
    return jax.value_and_grad(lambda x: fn(
        x, labels, axis_name="d", block_size=block_size, **hyper))(x)

  if mode == "shard_map":
    v, g = jax.jit(jax.shard_map(local, mesh=_mesh(), in_specs=(P("d"), P("d")),
                                 out_specs=(P(), P("d"))))(
                                     jnp.asarray(x), jnp.asarray(LABELS))
  else:
    v, g = jax.pmap(local, axis_name="d")(
        jnp.asarray(x).reshape(n, B // n, -1),
        jnp.asarray(LABELS).reshape(n, B // n))
    np.testing.assert_allclose(np.asarray(v), float(v[0]), rtol=1e-6)
    v, g = v[0], g.reshape(B, -1)
  _assert_vg_close((v, g), want)


def test_traced_hyperparameters_run_blockwise_without_gradient():
  x = jnp.asarray(embeddings())
  labels = jnp.asarray(LABELS)

  @jax.jit
  def f(gamma):
    return losses.circle_loss(x, labels, gamma=gamma, block_size=5)

  np.testing.assert_allclose(float(f(32.0)), float(
      losses.circle_loss(x, labels, gamma=32.0)), rtol=1e-6)
  assert float(jax.grad(f)(32.0)) == 0.0  # hyperparameters are constants


@pytest.mark.slow
@pytest.mark.parametrize("case", ["supcon", "nt_xent_poincare",
                                  "pairwise_ce", "pairwise_sigmoid"])
def test_contrastive_family_check_grads_dense_and_blockwise(case):
  _, fn, hyper = cases.family_case(case)
  x = jnp.asarray(cases.family_batch(seed=3))
  labels = jnp.asarray(cases.FAMILY_LABELS)
  hyper = cases.geometry_kw(hyper)
  for block_size in (None, 4):
    f = jax.jit(lambda x, bs=block_size: fn(x, labels, block_size=bs,
                                            **hyper))
    check_grads(f, (x,), order=1, modes=("rev",), eps=1e-3, atol=2e-3,
                rtol=2e-3)
