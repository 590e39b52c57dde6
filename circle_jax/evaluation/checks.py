"""Input checks shared by the evaluation metrics (host side).

Retrieval (:mod:`circle_jax.evaluation.retrieval`) and few-shot
(:mod:`circle_jax.evaluation.fewshot`) accept the same embeddings, labels and
device arguments, checked here once, each bad input naming its argument;
clustering (:mod:`circle_jax.evaluation.clustering`) checks its embeddings'
rank and dtype with the same :func:`check_array`. :func:`run_chunks` feeds
the queries to the retrieval and k-NN programs in chunks of a fixed shape.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh


def to_host(x):
  """``x`` as a host numpy array (fetched from the device if needed)."""
  if isinstance(x, jax.Array):
    return np.asarray(jax.device_get(x))
  return np.asarray(x)


def check_array(x, name: str, *, dims: str, kind, kind_words: str,
                cast: str, nonempty: bool = False):
  """``x`` (an array) if it has the rank of ``dims`` (e.g. ``"[num_items,
  dim]"``), a dtype of ``kind`` (``jnp.floating``, ``jnp.integer``) and, with
  ``nonempty``, at least one row; otherwise a ValueError (rank, emptiness) or
  a TypeError (dtype) naming ``name``, what it must be (``kind_words``) and
  the ``cast`` that fixes the dtype."""
  rank = dims.count(",") + 1
  if x.ndim != rank:
    raise ValueError(
        f"`{name}` must have rank {rank} ({dims}); got shape {x.shape}."
    )
  if not jnp.issubdtype(x.dtype, kind):
    raise TypeError(
        f"`{name}` must be {kind_words}; got dtype {x.dtype}. Cast it with "
        f"`{cast}`."
    )
  if nonempty and x.shape[0] == 0:
    raise ValueError(f"`{name}` is empty (shape {x.shape}).")
  return x


def check_embeddings(x, name: str) -> np.ndarray:
  """``x`` as a finite float32 ``[n, D]`` host array, ``n > 0``; ValueError /
  TypeError naming ``name`` otherwise."""
  x = check_array(to_host(x), name, dims="[num_items, dim]",
                  kind=jnp.floating,
                  kind_words="a floating array (float32, bfloat16, ...)",
                  cast=".astype(np.float32)", nonempty=True)
  x = np.asarray(x, np.float32)
  if not np.all(np.isfinite(x)):
    raise ValueError(
        f"`{name}` contains NaN or infinite values; the ranking would be "
        "undefined. Check the model's outputs."
    )
  return x


def check_labels(labels, size: int, name: str, of: str) -> np.ndarray:
  """``labels`` as an integer ``[size]`` host array (``of``: the embeddings'
  argument they label, for the message)."""
  labels = check_array(to_host(labels), name, dims="[num_items]",
                       kind=jnp.integer,
                       kind_words="an integer array of class ids",
                       cast=".astype(np.int64)")
  if labels.shape[0] != size:
    raise ValueError(
        f"`{name}` has length {labels.shape[0]} but `{of}` has {size} rows; "
        "they must match."
    )
  return labels


def check_ks(ks) -> Tuple[int, ...]:
  """The Recall@K cut-offs (an int or a sequence of positive ints), sorted
  and unique."""
  if isinstance(ks, (int, np.integer)) and not isinstance(ks, bool):
    ks = (ks,)
  try:
    ks = tuple(ks)
  except TypeError:
    raise TypeError(f"`ks` must be a sequence of positive ints; got {ks!r}.")
  if not ks:
    raise ValueError("`ks` must contain at least one K.")
  for k in ks:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
      raise ValueError(f"`ks` must contain positive ints; got {ks!r}.")
  return tuple(sorted(set(int(k) for k in ks)))


def check_positive_int(value, name: str) -> int:
  """``value`` as an int >= 1; TypeError / ValueError naming ``name``."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"`{name}` must be an int; got {value!r}.")
  if value < 1:
    raise ValueError(f"`{name}` must be >= 1; got {value}.")
  return int(value)


def resolve_devices(mesh, devices) -> Tuple[jax.Device, ...]:
  """The devices to shard the gallery over (default: all local devices)."""
  if mesh is not None and devices is not None:
    raise ValueError("Pass either `mesh` or `devices`, not both.")
  if mesh is not None:
    if not isinstance(mesh, Mesh):
      raise TypeError(
          f"`mesh` must be a jax.sharding.Mesh; got {type(mesh).__name__}."
      )
    devs = tuple(mesh.devices.flat)
  elif devices is not None:
    devs = tuple(devices)
    if not devs:
      raise ValueError("`devices` is empty.")
  else:
    devs = tuple(jax.local_devices())
  if len(set(devs)) != len(devs):
    raise ValueError("`devices` contains the same device twice.")
  local = set(jax.local_devices())
  for d in devs:
    if d not in local:
      raise ValueError(
          f"Device {d} is not addressable by this process; retrieval metrics "
          "shard a host-gathered gallery over local devices only."
      )
  return devs


def round_up(x: int, m: int) -> int:
  """The smallest multiple of ``m`` that is >= ``x``."""
  return -(-x // m) * m


# Query chunks are padded to a multiple of this (never a 1-row matrix-vector
# product, whose rounding differs from the matrix-matrix one).
CHUNK_ALIGN = 8


def run_chunks(fn, columns, chunk_size, sharding, on_chunk=None):
  """``fn`` over the queries in chunks of a fixed row count; its outputs
  concatenated over the chunks, cut to the number of queries.

  Args:
    fn: ``fn(*chunk_columns) -> tuple of [C, ...] arrays``, jitted.
    columns: ``[(host array [Q, ...], pad value)]``: the per-query inputs,
      each chunk padded with its pad value to ``C`` rows (one compilation;
      ``C`` a multiple of 8, never a 1-row matrix-vector product).
    chunk_size: ``C`` before rounding (at most ``Q`` rounded up).
    sharding: where the chunks are placed (replicated).
    on_chunk: called with the number of queries done after each chunk has
      been computed (for a progress bar); ``None`` dispatches all chunks
      asynchronously and waits once.

  Returns:
    A tuple of host numpy arrays ``[Q, ...]``.
  """
  num_q = columns[0][0].shape[0]
  c = round_up(min(chunk_size, num_q), CHUNK_ALIGN)
  outputs = []
  for lo in range(0, num_q, c):
    hi = min(lo + c, num_q)
    args = []
    for col, pad in columns:
      a = np.full((c,) + col.shape[1:], pad, col.dtype)
      a[: hi - lo] = col[lo:hi]
      args.append(jax.device_put(a, sharding))
    outputs.append(fn(*args))  # dispatched asynchronously
    if on_chunk is not None:
      outputs[-1] = jax.device_get(outputs[-1])
      on_chunk(hi)
  outputs = jax.device_get(outputs)
  return tuple(np.concatenate([o[i] for o in outputs])[:num_q]
               for i in range(len(outputs[0])))
