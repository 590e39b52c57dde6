"""Every pair loss on every engine: dense == blockwise == ring (8 simulated
devices under ``jax.shard_map``) == its float64 reference, or a one-line
error naming why a loss that is not a rule has only the dense engine; the
unified loss chosen by name through the registry.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.grad_check import check_grads

from circle_jax import config as config_lib
from circle_jax import losses
from tests.losses import reference as ref
from tests.losses.engine_checks import close
from tests.losses.engine_checks import sharded_vg as _sharded_vg
from tests.losses.engine_checks import vg as _vg
from tests.losses.reference import contrastive_ref, triplet_ref

# Slow (every engine compiled per rule): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

# 16 samples, 2 per device; label 9 has no positive.
LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 4, 9, 0], np.int32)
B = len(LABELS)


def _x(seed=0):
  return np.random.default_rng(seed).normal(size=(B, 5)).astype(np.float32)


def _unified_ref(x, y, gamma, margin):
  """Eq. 1 anchor by anchor, float64 (``reference.ref_unified_anchor``)."""
  return ref.ref_pair_loss(ref.ref_unified_anchor, ref.cos(x), y,
                           gamma=gamma, margin=margin)


# The rule-based embedding forms: (function, hyperparameters, float64 ref).
RULES = {
    "unified": (losses.unified_loss, dict(gamma=8.0, margin=0.25),
                functools.partial(_unified_ref, gamma=8.0, margin=0.25)),
    "contrastive": (losses.contrastive_loss,
                    dict(pos_margin=0.2, neg_margin=1.3),
                    functools.partial(contrastive_ref, pos_margin=0.2,
                                      neg_margin=1.3)),
    "triplet_batch_hard": (
        losses.triplet_margin_loss, dict(margin=0.3, mining="batch_hard"),
        functools.partial(triplet_ref, margin=0.3, mining="batch_hard")),
}

# Losses that are not rules: only the dense engine.
DENSE_ONLY = {
    "triplet_all": (losses.triplet_margin_loss, dict(mining="all"), ()),
    "triplet_semi_hard": (losses.triplet_margin_loss,
                          dict(mining="semi_hard"), ()),
    "margin": (losses.margin_loss, {}, (jnp.float32(1.2),)),
}


_close = functools.partial(close, rtol=1e-5, grad_atol=2e-5)


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_dense_blockwise_ring_equal_the_float64_reference(name):
  assert jax.device_count() == 8
  fn, hyper, reference = RULES[name]
  x = _x()
  labels = jnp.asarray(LABELS)
  dense = _vg(fn, x, labels, **hyper)
  assert float(dense[0]) > 0
  np.testing.assert_allclose(float(dense[0]), reference(x, LABELS),
                             rtol=2e-5)
  _close(_vg(fn, x, labels, block_size=3, **hyper), dense)
  for block_size in (None, 1):  # one tile per ring step; 1-row tiles
    _close(_sharded_vg(fn, x, labels, collective="ring",
                       block_size=block_size, **hyper), dense)
  _close(_sharded_vg(fn, x, labels, block_size=3, **hyper), dense)


def test_batch_hard_triplet_check_grads_dense_and_blockwise():
  x = jnp.asarray(_x(seed=3))
  labels = jnp.asarray(LABELS)
  for block_size in (None, 4):
    f = jax.jit(lambda x, bs=block_size: losses.triplet_margin_loss(
        x, labels, margin=0.3, mining="batch_hard", block_size=bs))
    check_grads(f, (x,), order=1, modes=("rev",), eps=1e-3, atol=2e-3,
                rtol=2e-3)


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_empty_sets_give_zero_and_zero_gradient_on_every_engine(name):
  fn, hyper, _ = RULES[name]
  if name == "contrastive":  # its sets are per pair: no pair at all
    labels = jnp.zeros(B, jnp.int32)
    hyper = dict(hyper, pos_margin=2.0)  # every positive within the margin
  else:  # all labels distinct: no anchor has a positive
    labels = jnp.arange(B, dtype=jnp.int32)
  x = _x()
  for got in (_vg(fn, x, labels, **hyper),
              _vg(fn, x, labels, block_size=3, **hyper),
              _sharded_vg(fn, x, labels, collective="ring", block_size=3,
                          **hyper)):
    assert float(got[0]) == 0.0
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)


@pytest.mark.parametrize("name", sorted(DENSE_ONLY))
def test_losses_that_are_not_rules_refuse_the_tiled_engines(name):
  fn, hyper, extra = DENSE_ONLY[name]
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  assert np.isfinite(float(fn(x, labels, *extra, **hyper)))
  with pytest.raises(ValueError, match="only the dense engine") as info:
    fn(x, labels, *extra, block_size=4, **hyper)
  assert "\n" not in str(info.value)
  entry = losses.get_loss(name.split("_")[0] if "triplet" in name else name)
  assert entry.execution_options == ()


def test_unified_loss_by_name_through_the_registry_and_the_config():
  entry = losses.get_loss("unified")
  assert entry.fn is losses.unified_loss and entry.kind == "pair"
  assert dict(entry.defaults) == {"gamma": 80.0, "margin": 0.4}
  assert set(entry.hyper_ranges) == {"gamma", "margin"}
  assert entry.execution_options == ("block_size", "collective")
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  np.testing.assert_array_equal(
      entry.apply(x, labels, gamma=8.0, margin=0.25),
      losses.unified_loss(x, labels, gamma=8.0, margin=0.25))
  np.testing.assert_allclose(
      float(entry.apply(x, labels, gamma=8.0, margin=0.25)),
      _unified_ref(_x(), LABELS, 8.0, 0.25), rtol=2e-5)
  with pytest.raises(ValueError, match="gamma"):
    losses.validate_hyper("unified", gamma=0.0)
  c = config_lib.loss_config("unified", margin=0.3)
  assert (c.name, c.gamma, c.margin) == ("unified", 80.0, 0.3)


def test_distance_matrix_loss_reads_distances_and_names_them():
  """A rule with ``on_distance`` on a given distance matrix (hand-computed
  contrastive: positives ``[0.3 - 0]_+`` twice, negatives ``[1 - d]_+`` =
  0.1, 0.1, 0.2, 0.2: 0.3 + 0.15); bad input is named ``distance``; a rule
  without the field is refused."""
  from circle_jax.losses.circle import Circle
  from circle_jax.losses.contrastive import Contrastive
  d = jnp.array([[0.0, 0.3, 0.9], [0.3, 0.0, 0.8], [0.9, 0.8, 0.0]])
  labels = jnp.array([0, 0, 1])
  rule = Contrastive(neg_margin=1.0)
  np.testing.assert_allclose(
      losses.engine.distance_matrix_loss(rule, d, labels), 0.45, rtol=1e-6)
  with pytest.raises(ValueError, match="distance"):
    losses.engine.distance_matrix_loss(rule, d[:2], labels)
  with pytest.raises(ValueError, match="on_distance"):
    losses.engine.distance_matrix_loss(Circle(), d, labels)
