r"""P2SGrad: the mean squared error between cosines and one-hot targets.

Zhang et al. (2019) replace the margin softmax's gradient by its "probability
to similarity" form, eq. 11:
``\nabla_{W_j} = (\cos\theta_{i,j} - 1(j = y_i)) \nabla_{W_j}\cos\theta_{i,j}``
(and the same for ``x_i``), which is the gradient of a squared error between
the cosines and the one-hot labels. As pytorch-metric-learning 2.9 (after
Xin Wang's code), this module computes that loss, averaged over the batch
and the classes:

.. math::

  L = \frac{1}{B C} \sum_i \sum_{c=1}^{C}
      \left(\cos\theta_{i,c} - 1(c = y_i)\right)^2,
  \qquad \cos\theta_{i,c} = \hat x_i \cdot \hat W_c

(clipped to ``[-1, 1]``). Its gradient is the paper's up to the constant
``2 / (B C)``.

Difference from PML 2.9, which normalises its weight in place
(``weight.data = weight.data.renorm(...)``) before each call and then
differentiates ``x \cdot W / \|x\|`` as if ``W`` were any matrix: here
``W`` is normalised inside the loss, so its gradient is the paper's,
``(\hat x - \cos\theta\,\hat W_c) / \|W_c\|`` times the error, the part of
PML's gradient orthogonal to ``\hat W_c`` divided by ``\|W_c\|``. The value
and the embeddings' gradient are PML's. The class matrix is ``[C, D]``
(PML's is ``[D, C]``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax import ops
from circle_jax.losses import class_shard
from circle_jax.losses import entries

Array = jax.Array


def p2s_grad_loss(
    embeddings: Array,
    labels: Array,
    class_weights: Array,
    *,
    axis_name: Optional[str] = None,
    shard_classes: bool = class_shard.Layout.shard_classes,
    num_classes: Optional[int] = class_shard.Layout.num_classes,
) -> Array:
  r"""P2SGrad: mean squared error of the cosines to one-hot labels (module
  docstring).

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16 (normalised inside).
    labels: ``[B]`` integer labels in ``[0, C)``.
    class_weights: ``[C, D]`` (normalised inside); with ``shard_classes``
      this device's ``[ceil(C / n), D]`` rows.
    axis_name: the mapped axis of the global batch: the mean runs over the
      global batch (and, with ``shard_classes``, over every device's
      classes).
    shard_classes, num_classes: the sharded class matrix
      (:mod:`circle_jax.losses.class_shard`; padding rows count nowhere).

  Returns:
    float32 scalar: the mean over the (global) batch and the ``C`` classes
    (PML's ``MSELoss``, reduction ``mean``).

  References:
    Zhang, Zhao, Liu, Qiao, Li, Wang, "P2SGrad: Refined Gradients for
    Optimizing Deep Face Models", CVPR 2019, eq. 11.
  """
  layout = class_shard.Layout(shard_classes=shard_classes,
                              num_classes=num_classes)
  x, labels, w, block = class_shard.class_block(
      embeddings, labels, class_weights, axis_name=axis_name, layout=layout)
  cos = jnp.clip(ops.cosine_similarity(x, w), -1.0, 1.0)
  onehot = block.onehot(labels)
  error = jnp.where(block.real[None, :], cos - onehot, 0.0)
  per_sample = block.class_sum(jnp.sum(error * error, axis=1))
  return block.batch_mean(per_sample) / block.num_classes


def unit_rows_uniform(key, num_classes, embedding_dim, **hyper):
  """PML's init: ``U(-1, 1)`` entries, each class vector rescaled to unit
  norm."""
  del hyper
  w = jax.random.uniform(key, (num_classes, embedding_dim), jnp.float32,
                         -1.0, 1.0)
  return ops.l2_normalize(w)


REGISTRY = (
    entries.entry("p2s_grad", p2s_grad_loss, "classifier",
        param_name="class_weights", init=unit_rows_uniform,
        param_init="uniform(-1, 1), unit rows (PML)",
        reduction="mean over samples and classes",
        paper="Zhang et al., \"P2SGrad: Refined Gradients for Optimizing "
              "Deep Face Models\", CVPR 2019"),
)
