"""Tests of VPTSP-G's class-prompt proxy net (models/semantic_proxies.py);
its GRU mix is checked against the official code in
tests/losses/test_vptsp.py."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax.models import semantic_proxies as sp
from tests.models import helpers

C, D, E = 5, 8, 4


def test_class_prompts_drive_the_vit_and_the_mix_updates_batch_rows():
  """Parameters and shapes (prompts ``[C, n_i, D]`` with the step, no
  parameter for a block with zero tokens), the class prompts of a batch
  through a prompted ViT, and the memory rows the batch updates."""
  net = sp.SemanticProxyNet(num_classes=C, width=D, embedding_dim=E,
                            num_prompts=3, prompt_depth=2, prompt_step=3)
  vit = helpers.tiny_vit(patch=4, image_size=8, width=D, num_heads=2,
                         num_prompts=2, head_norm=True)
  labels = jnp.asarray([3, 3, 1, 1])
  rng = np.random.default_rng(0)
  unit = rng.normal(size=(C, E))
  unit /= np.linalg.norm(unit, axis=1, keepdims=True)
  memory = jnp.asarray(unit, jnp.float32)
  x = jnp.asarray(rng.normal(size=(4, 8, 8, 3)), jnp.float32)

  @jax.jit
  def run(x, labels, memory):
    vit_vars = vit.init(jax.random.PRNGKey(0), x, train=False)
    net_vars = net.init(jax.random.PRNGKey(1), jnp.zeros((4, D)), labels,
                        memory, k=2)
    tokens = net.apply(net_vars, labels, method=net.prompt_tokens)
    feats = vit.apply(vit_vars, x, train=False, prompt_tokens=tokens)
    new, classes = net.apply(net_vars, feats[:, 0, 0], labels, memory, k=2)
    return net_vars, tokens, new, classes

  net_vars, tokens, new, classes = run(x, labels, memory)
  shapes = {"/".join(k): v.shape for k, v in
            flax.traverse_util.flatten_dict(net_vars["params"]).items()}
  assert shapes["prompts_0"] == (C, 3, D)
  assert "prompts_1" not in shapes  # 3 - 1 * 3 = 0 tokens
  assert shapes["W_iz"] == (E, E) and shapes["b_in"] == (E,)
  assert [t.shape for t in tokens] == [(4, 3, D), (4, 0, D)]
  np.testing.assert_array_equal(tokens[0][0],
                                net_vars["params"]["prompts_0"][3])
  assert list(np.asarray(classes)) == [3, 1]
  new = np.asarray(new)
  np.testing.assert_allclose(np.linalg.norm(new, axis=1), 1.0, rtol=1e-6)
  np.testing.assert_allclose(new[[0, 2, 4]], unit[[0, 2, 4]], atol=1e-6)
  assert np.abs(new[[1, 3]] - unit[[1, 3]]).max() > 1e-3


def test_bad_options_are_one_line():
  net = sp.SemanticProxyNet(num_classes=C, width=D, embedding_dim=E,
                            gru="lstm")
  with pytest.raises(ValueError, match="`gru` must be one of gru, gru_relu"):
    jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), jnp.zeros((2, D)),
                                    jnp.zeros((2,), jnp.int32),
                                    jnp.zeros((C, E)), k=2))


def test_gru_dropout_needs_its_key_and_drops_updated_entries():
  """The official ``rnn_dropout``: inverted dropout on each GRU output;
  rows stay unit after the re-normalisation."""
  rng = np.random.default_rng(1)
  unit = rng.normal(size=(C, E))
  unit /= np.linalg.norm(unit, axis=1, keepdims=True)
  feats = rng.normal(size=(4, E))
  w = {g: (np.eye(E), np.eye(E), np.zeros(E)) for g in "rzn"}
  labels = jnp.asarray([0, 0, 2, 2])
  mix = jax.jit(sp.gru_mix, static_argnames=("k", "dropout"))
  plain, _ = mix(feats, labels, unit, w, k=2, key=jax.random.PRNGKey(0))
  dropped, _ = mix(feats, labels, unit, w, k=2, dropout=0.5,
                   key=jax.random.PRNGKey(0))
  plain, dropped = np.asarray(plain), np.asarray(dropped)
  assert np.abs(plain[[0, 2]] - dropped[[0, 2]]).max() > 1e-3
  np.testing.assert_allclose(dropped[[1, 3, 4]], unit[[1, 3, 4]], atol=1e-6)
  np.testing.assert_allclose(np.linalg.norm(dropped, axis=1), 1.0, rtol=1e-5)
  with pytest.raises(ValueError, match="`dropout` needs a `key`"):
    sp.gru_mix(feats, labels, unit, w, k=2, dropout=0.5)
