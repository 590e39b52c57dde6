"""Tests of circle_jax/train/state.py: the train state and its saved tree."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from circle_jax.train import state as state_lib
from circle_jax.train import xbm as xbm_lib
from tests.train import helpers


def _state(use_bn=True, memory=None):
  model = helpers.TinyNet(use_bn=use_bn)
  return helpers.initial_state(
      model, optax.adam(1e-2), jnp.zeros((1, 6, 6, 1)),
      key=jax.random.PRNGKey(0),
      loss_params={"proxies": jnp.ones((3, 4))}, memory=memory)


def test_tree_holds_the_savable_fields_only():
  state = _state()
  tree = state_lib.state_to_tree(state)
  assert set(tree) == {"step", "params", "opt_state", "batch_stats"}
  assert set(tree["params"]) == {"model", "loss"}
  assert tree["params"]["loss"]["proxies"].shape == (3, 4)
  with_memory = state_lib.state_to_tree(
      _state(memory=xbm_lib.init_memory(5, 4)))
  assert set(with_memory["xbm"]) == set(xbm_lib.ARRAY_FIELDS)
  assert with_memory["xbm"]["embeddings"].shape == (5, 4)


def test_tree_round_trip_restores_every_leaf_into_the_template():
  memory = xbm_lib.init_memory(5, 4, start_step=3, weight=0.5)
  trained = _state(memory=memory)
  trained = trained.replace(
      step=jnp.int32(9),
      params=jax.tree.map(lambda x: x + 1.0, trained.params),
      batch_stats=jax.tree.map(lambda x: x - 2.0, trained.batch_stats),
      xbm=trained.xbm.replace(position=np.int32(2),
                              embeddings=np.full((5, 4), 0.25, np.float32)))
  # As a checkpoint holds it: numpy arrays in nested dicts, no optax types.
  tree = jax.tree.map(np.asarray, state_lib.state_to_tree(trained))
  template = _state(memory=memory)
  back = state_lib.state_from_tree(template, tree)
  assert int(back.step) == 9
  assert jax.tree.structure(back.opt_state) == jax.tree.structure(
      template.opt_state)
  for want, got in zip(jax.tree.leaves(trained.params),
                       jax.tree.leaves(back.params)):
    np.testing.assert_array_equal(got, want)
  for want, got in zip(jax.tree.leaves(trained.batch_stats),
                       jax.tree.leaves(back.batch_stats)):
    np.testing.assert_array_equal(got, want)
  assert int(back.xbm.position) == 2 and back.xbm.embeddings[0, 0] == 0.25
  # The memory's static fields come from the template, not the tree.
  assert (back.xbm.start_step, back.xbm.weight) == (3, 0.5)
  assert back.apply_fn is template.apply_fn and back.tx is template.tx


def test_a_tree_of_another_structure_does_not_fit():
  tree = state_lib.state_to_tree(_state())
  tree["params"]["model"] = {"only": np.zeros(2)}
  with pytest.raises(ValueError):
    state_lib.state_from_tree(_state(), tree)


def test_model_variables_of_a_state_and_of_its_tree():
  state = _state()
  for source in (state, state_lib.state_to_tree(state)):
    v = state_lib.model_variables(source)
    assert set(v) == {"params", "batch_stats"}
    assert v["params"] is state.params["model"]
  # A model without BatchNorm is applied without the empty collection.
  bare = _state(use_bn=False)
  assert bare.batch_stats == {}
  v = state_lib.model_variables(bare)
  assert set(v) == {"params"}
  out = bare.apply_fn(v, jnp.zeros((2, 6, 6, 1)), train=False)
  assert out.shape == (2, 4)


def test_count_params_by_hand():
  assert state_lib.count_params({}) == 0
  assert state_lib.count_params(
      {"a": np.zeros((3, 4)), "b": [np.zeros(5), np.zeros(())]}) == 18
  # TinyNet: conv 3x3x1x3 (no bias with BN) + BN scale and bias 3 + 3 +
  # dense 3x4 + bias 4.
  assert state_lib.count_params(_state().params["model"]) == 27 + 6 + 16
