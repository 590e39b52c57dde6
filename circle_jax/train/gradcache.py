"""Embedding-gradient caching (GradCache): the train step's embeddings in chunks.

A pair loss couples every embedding of the global batch, so the batch cannot
be split into independent micro-batches. GradCache (Gao et al., 2021) splits
only the *network*: the loss ``L(f_theta(x_1), ..., f_theta(x_b))`` has

  dL/dtheta = sum_c  (d f_theta(x_c) / dtheta)^T  dL/dE_c,

where ``E_c = f_theta(x_c)`` are the embeddings of chunk ``c``. So

1. embed the batch chunk by chunk without keeping activations
   (``lax.map``; only the ``[b, D]`` embeddings are kept);
2. take the loss and its gradient ``dL/dE`` w.r.t. *all* embeddings (and
   the loss parameters) as usual, on the whole (global) batch;
3. re-run each chunk's forward pass under ``jax.vjp``, pull ``dL/dE_c`` back
   to the parameters and accumulate the sum in a ``lax.scan`` carry.

Peak activation memory is that of one chunk instead of the whole batch; the
price is a second forward pass. :func:`chunked` packages steps 1 and 3 as a
``jax.custom_vjp`` embedding function with the signature of
:func:`circle_jax.train.step.embed`, so the train step's loss (step 2), its
``axis_name`` (the global-batch loss under ``shard_map``/``pmap``) and the
optimiser update are unchanged: chunking replaces the embedding's forward and
backward passes only. pytorch-metric-learning's ``anchor_batched_backward``
chunks the loss instead; here the loss already has a blockwise engine.

Exactness. With a model whose forward pass treats images independently (no
BatchNorm, or BatchNorm frozen: ``config.model.freeze_bn``) the result equals
the unchunked step up to float32 summation order. BatchNorm in training mode
normalises with the statistics of the images it sees, so chunking changes the
function itself: each chunk is normalised with its own statistics (in both
passes, so the gradient is the exact gradient of that per-chunk model) and the
returned running statistics are the mean over chunks of each chunk's update.
The trainer refuses this unless ``config.batch.embed_chunk_bn='per_chunk'``
(:mod:`circle_jax.train.config_checks`).

Randomness. The step passes no PRNG key to the model (no registered model has
dropout or other randomness), so both passes of a chunk compute the same
function. A model with dropout would need the same key in a chunk's two
passes (the paper's ``RandContext``); that is not implemented.

Devices. Under ``jax.shard_map`` the replicated parameters' gradient is the
sum over devices; the backward pass accumulates this device's chunks and sums
over the devices once (not once per chunk), which is what autodiff of the
unchunked step returns. Under ``jax.pmap`` it returns this device's gradient
(the step then ``psum``s it, as without chunking).

References:
  Luyu Gao, Yunyi Zhang, Jiawei Han, Jamie Callan, "Scaling Deep Contrastive
  Learning Batch Size under Memory Limited Setup", Workshop on Representation
  Learning for NLP (RepL4NLP), 2021.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Tuple

import jax
import jax.numpy as jnp

from circle_jax import ops

PyTree = Any
# embed_fn(model_params, batch_stats, images [b, ...]) -> (embeddings [b, D],
# new batch_stats)
EmbedFn = Callable[[PyTree, PyTree, jax.Array], Tuple[jax.Array, PyTree]]


def chunked(embed_fn: EmbedFn, chunk_size: int) -> EmbedFn:
  """``embed_fn`` computed ``chunk_size`` images at a time (GradCache).

  Args:
    embed_fn: ``(model_params, batch_stats, images [b, ...]) -> (embeddings
      [b, D], new batch_stats)``, e.g. ``functools.partial(step.embed,
      apply_fn)``. It must treat the images of a chunk as a batch of its own.
    chunk_size: images per chunk ``K`` (a positive divisor of ``b``).

  Returns:
    A function with ``embed_fn``'s signature and values (up to float32
    summation order when the model has no BatchNorm in training mode; see the
    module docstring) whose forward pass keeps no activations and whose
    backward pass re-runs each chunk under ``jax.vjp``. The gradient flows to
    ``model_params`` only; the new statistics are the input statistics plus
    the mean over chunks of each chunk's change (unchanged, bit for bit, when
    BatchNorm is frozen).

  Raises:
    ValueError: at trace time, when ``chunk_size`` is not a positive int
      dividing the batch.
  """
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or (
      chunk_size < 1):
    raise ValueError(f"`chunk_size` must be a positive int; got "
                     f"{chunk_size!r}.")
  return functools.partial(_chunked, embed_fn, chunk_size)


def _split(x: jax.Array, chunk_size: int) -> jax.Array:
  """``[b, ...] -> [b / K, K, ...]``."""
  b = x.shape[0]
  if b % chunk_size:
    raise ValueError(
        f"The batch of {b} images on this device is not divisible by the "
        f"embedding chunk size {chunk_size}; choose a divisor of {b} "
        "(config.batch.embed_chunk_size).")
  return x.reshape((b // chunk_size, chunk_size) + x.shape[1:])


def _forward(embed_fn, chunk_size, params, batch_stats, images):
  chunks = _split(images, chunk_size)
  embeddings, stats = jax.lax.map(
      lambda x: embed_fn(params, batch_stats, x), chunks)
  embeddings = embeddings.reshape((-1,) + embeddings.shape[2:])
  # old + mean(new_c - old): the mean of the chunks' running-average updates,
  # and exactly `old` when the statistics do not change (frozen BatchNorm).
  new_stats = jax.tree.map(lambda old, new: old + jnp.mean(new - old, 0),
                           batch_stats, stats)
  return embeddings, new_stats


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked(embed_fn, chunk_size, params, batch_stats, images):
  return _forward(embed_fn, chunk_size, params, batch_stats, images)


def _chunked_fwd(embed_fn, chunk_size, params, batch_stats, images):
  out = _forward(embed_fn, chunk_size, params, batch_stats, images)
  return out, (params, batch_stats, images)


def _chunked_bwd(embed_fn, chunk_size, residuals, cotangents):
  params, batch_stats, images = residuals
  ct_embeddings, _ = cotangents  # the statistics are not differentiated.
  # Axes the images vary over and the (replicated) parameters do not: under
  # shard_map, accumulate this device's gradient, then sum over them once.
  replicated = jax.tree.leaves(params)
  axes = tuple(sorted(
      ops.varying_axes(images) - (ops.varying_axes(replicated[0]) if replicated
                                     else set())))
  local = jax.lax.pcast(params, axes, to="varying") if axes else params

  def chunk_grad(acc, xs):
    x, ct = xs
    _, vjp = jax.vjp(lambda p: embed_fn(p, batch_stats, x)[0], local)
    (grad,) = vjp(ct)
    return jax.tree.map(jnp.add, acc, grad), None

  zeros = jax.tree.map(jnp.zeros_like, local)
  grads, _ = jax.lax.scan(chunk_grad, zeros,
                          (_split(images, chunk_size),
                           _split(ct_embeddings, chunk_size)))
  if axes:
    grads = jax.lax.psum(grads, axes)
  return grads, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


