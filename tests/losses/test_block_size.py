"""The public `block_size=` keyword runs the blockwise engine.

`test_blockwise.py` checks the blockwise algorithms in depth; this file checks
that the public wrappers reach them with every hyperparameter forwarded, and
that the result equals the dense path (values and gradients).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses

# Slow (every engine compiled per rule): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

CASES = [
    (losses.circle_loss, dict(margin=0.3, gamma=64.0)),
    (losses.multi_similarity_loss,
     dict(alpha=3.0, beta=40.0, base=0.4, epsilon=0.2, mining=True)),
    (losses.ranked_list_loss,
     dict(alpha=1.1, margin=0.3, t_neg=8.0, t_pos=1.0, imbalance=0.4)),
    # Every rule-based loss takes block_size (circle_jax.losses.engine).
    (losses.unified_loss, dict(gamma=32.0, margin=0.3)),
    (losses.contrastive_loss, dict(neg_margin=1.2, pos_margin=0.2)),
]


@pytest.mark.parametrize("fn,hyper", CASES, ids=lambda c: getattr(c, "__name__", ""))
@pytest.mark.parametrize("block_size", [4, 7])
def test_block_size_matches_dense_values_and_gradients(fn, hyper, block_size):
  key = jax.random.PRNGKey(3)
  x = jax.random.normal(key, (18, 6))
  labels = jnp.array([0, 1, 2, 3, 4, 5] * 3)
  dense = jax.jit(jax.value_and_grad(lambda x: fn(x, labels, **hyper)))
  block = jax.jit(jax.value_and_grad(
      lambda x: fn(x, labels, block_size=block_size, **hyper)))
  (vd, gd), (vb, gb) = dense(x), block(x)
  assert float(vd) > 0
  np.testing.assert_allclose(float(vb), float(vd), rtol=1e-5)
  # float32 rounding, relative to the largest gradient entry (gamma * |s|
  # amplifies the rounding of the similarities).
  scale = float(np.abs(np.asarray(gd)).max())
  np.testing.assert_allclose(np.asarray(gb), np.asarray(gd), rtol=1e-4,
                             atol=2e-5 * scale)
  # A changed hyperparameter must change the blockwise result too, i.e. it is
  # forwarded and not replaced by a default.
  name, value = next(iter(hyper.items()))
  other = dict(hyper, **{name: value * 0.5})
  assert float(fn(x, labels, block_size=block_size, **other)) != pytest.approx(
      float(vb), rel=1e-4)
