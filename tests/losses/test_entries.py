"""Tests of a registry entry (circle_jax/losses/entries.py): the initialisers, apply and bind."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from circle_jax import losses
from tests.losses.test_registry import C, D, X, Y


def test_initialisers_follow_the_papers():
  key = jax.random.PRNGKey(0)
  c, d = 200, 64
  pa = np.asarray(losses.get_loss("proxy_anchor").init_params(key, c, d))
  assert pa.shape == (c, d) and pa.dtype == np.float32
  np.testing.assert_allclose(pa.std(), np.sqrt(2.0 / c), rtol=0.05)
  cw = np.asarray(losses.get_loss("arcface").init_params(key, c, d))
  np.testing.assert_allclose(cw.std(), 0.01, rtol=0.05)
  st = np.asarray(losses.get_loss("soft_triple").init_params(key, c, d))
  assert st.shape == (c * 10, d)
  bound = 1 / np.sqrt(c * 10)
  assert np.abs(st).max() <= bound and np.abs(st).max() > 0.9 * bound
  st3 = losses.get_loss("soft_triple").init_params(key, c, d,
                                                   centers_per_class=3)
  assert st3.shape == (c * 3, d)
  sm = np.asarray(losses.get_loss("softmax").init_params(key, c, d))
  limit = np.sqrt(6.0 / (c + d))
  assert np.abs(sm).max() <= limit and np.abs(sm).max() > 0.9 * limit
  beta = np.asarray(losses.get_loss("margin").init_params(key, c, d))
  np.testing.assert_array_equal(beta, np.full((c,), 1.2, np.float32))
  assert losses.get_loss("circle").init_params(key, c, d) is None


def test_apply_equals_the_direct_call_with_overrides():
  w = losses.get_loss("cosface").init_params(jax.random.PRNGKey(2), C, D)

  @jax.jit
  def run(x, y, w):
    return (losses.get_loss("triplet").apply(x, y, mining="batch_hard",
                                             margin=0.3),
            losses.triplet_margin_loss(x, y, mining="batch_hard", margin=0.3),
            losses.get_loss("cosface").apply(x, y, w, scale=5.0),
            losses.cosface_loss(x, y, w, scale=5.0),
            # Execution options (not hyperparameters) pass through too.
            losses.get_loss("circle").apply(x, y, block_size=8),
            losses.circle_loss(x, y))
  a, b, c, d, e, f = run(X, Y, w)
  assert float(a) == float(b) and float(c) == float(d)
  np.testing.assert_allclose(float(e), float(f), rtol=1e-5)
  assert "block_size" not in losses.get_loss("circle").defaults


def test_apply_rejects_misuse_by_name():
  contrastive = losses.get_loss("contrastive")
  with pytest.raises(ValueError, match="unknown hyperparameter.*'margn'"):
    contrastive.apply(X, Y, margn=0.1)
  with pytest.raises(ValueError, match="has no learnable parameters"):
    contrastive.apply(X, Y, np.ones((C, D), np.float32))
  with pytest.raises(ValueError, match="needs its `proxies`"):
    losses.get_loss("proxy_nca").apply(X, Y)
  unsupported = [n for n, e in losses.LOSSES.items()
                 if not e.supports_axis_name]
  for name in unsupported:
    entry = losses.LOSSES[name]
    params = entry.init_params(jax.random.PRNGKey(0), C, D)
    with pytest.raises(ValueError, match="does not support `axis_name`"):
      entry.apply(X, Y, params, axis_name="d")


def test_apply_routes_axis_name_inside_shard_map():
  entry = losses.get_loss("contrastive")
  mesh = Mesh(np.array(jax.devices()), ("d",))
  got = jax.jit(jax.shard_map(
      functools.partial(entry.apply, axis_name="d"), mesh=mesh,
      in_specs=(P("d"), P("d")), out_specs=P()))(X, Y)
  np.testing.assert_allclose(float(got), float(jax.jit(entry.apply)(X, Y)),
                             rtol=1e-5)


def test_bind_checks_the_hyperparameters_once_and_equals_apply():
  """``bind`` sets the hyperparameters (and builds the geometry from its
  config fields) once; the bound loss with :meth:`routed`'s keywords is
  ``apply``'s value, and a misspelt name fails at bind time."""
  entry = losses.get_loss("circle")
  bound = entry.bind(margin=0.25, gamma=32.0)
  assert isinstance(bound, functools.partial) and bound.func is entry.fn
  np.testing.assert_allclose(
      float(bound(X, Y, **entry.routed(key=jax.random.PRNGKey(0)))),
      float(entry.apply(X, Y, key=jax.random.PRNGKey(0), margin=0.25,
                        gamma=32.0)), rtol=1e-6)
  with pytest.raises(ValueError, match="margn"):
    entry.bind(margn=0.1)
  ball = losses.get_loss("pairwise_ce").bind(c=0.5)
  assert ball.keywords["geometry"] == losses.Poincare(c=0.5)
  assert losses.get_loss("margin").routed(key=None) == {"key": None}
  assert entry.routed(key=jax.random.PRNGKey(0)) == {}
  with pytest.raises(ValueError, match="axis_name"):
    losses.get_loss("circle_class_level").routed(axis_name="d")
