"""Benchmark: conv4's 2x2 max pools, ``nn.max_pool`` vs ``max_pool_disjoint``.

``circle_jax.models.layers.max_pool_disjoint`` computes the same values and
gradients as ``nn.max_pool`` with window = stride (tested bitwise), as a
reshape and a reduction. This times, compiled, on the default backend:

* each pool of conv4 at Omniglot size (batch 64, 28x28 input, 64 channels),
  forward + backward, both ways;
* conv4's whole forward + backward (BatchNorm in training mode) with each
  pool, the part of a training step that the pool changes.

Usage:
  python -m experiments.bench.max_pool                  # batch 64, 28x28
  python -m experiments.bench.max_pool --batch 256 --size 28 --repeats 20

Like the other CPU benchmarks it re-executes itself with huge-page malloc
(``circle_jax/hostenv.py``; ``--no-hugepages`` keeps the default).
"""

from __future__ import annotations

from unittest import mock

import numpy as np

from experiments.bench import timing


def flax_pool(x, window, padding="VALID"):
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  return nn.max_pool(x, (window, window), strides=(window, window),
                     padding=padding)


def pool_ms(shape, pool, repeats):
  """Median ms of a compiled forward + backward of ``pool(x, 2, 'SAME')``."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
  f = jax.jit(jax.grad(lambda v: jnp.sum(jnp.sin(pool(v, 2, "SAME")))))
  return 1e3 * timing.median_s(lambda: f(x), 2, repeats)


def conv4_ms(batch, size, width, pool, repeats):
  """Median ms of conv4's compiled forward + backward with ``pool``."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from circle_jax.models import conv4  # pylint: disable=g-import-not-at-top
  from circle_jax.models import layers  # pylint: disable=g-import-not-at-top
  model = conv4.Conv4(width=width, pool_padding="VALID")
  x = jnp.asarray(np.random.default_rng(0).normal(
      size=(batch, size, size, 1)), jnp.float32)
  with mock.patch.object(layers, "max_pool_disjoint", pool):
    variables = model.init(jax.random.PRNGKey(0), x, train=False)

    def loss(params):
      y, _ = model.apply({"params": params,
                          "batch_stats": variables["batch_stats"]}, x,
                         train=True, mutable=["batch_stats"])
      return jnp.sum(jnp.sin(y))

    f = jax.jit(jax.grad(loss))
    f(variables["params"])  # traced and compiled with the patched pool
  return 1e3 * timing.median_s(lambda: f(variables["params"]), 2, repeats)


def main():
  p = timing.parser(__doc__, repeats=30)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--size", type=int, default=28)
  p.add_argument("--width", type=int, default=64)
  args = p.parse_args()
  from circle_jax.models import layers  # pylint: disable=g-import-not-at-top
  ours = layers.max_pool_disjoint
  print(f"# conv4 max pools, batch {args.batch}, {args.size}x{args.size}, "
        f"width {args.width}; {timing.machine_line()}")
  print("| fwd + bwd of | nn.max_pool ms | max_pool_disjoint ms | speed-up |")
  print("| --- | --- | --- | --- |")
  size = args.size
  while size >= 2:
    shape = (args.batch, size, size, args.width)
    a, b = (pool_ms(shape, f, args.repeats) for f in (flax_pool, ours))
    print(f"| pool of [{', '.join(map(str, shape))}] | {a:.2f} | {b:.2f} | "
          f"{a / b:.1f}x |")
    size //= 2
  a, b = (conv4_ms(args.batch, args.size, args.width, f, args.repeats)
          for f in (flax_pool, ours))
  print(f"| conv4 (4 blocks) | {a:.2f} | {b:.2f} | {a / b:.2f}x |")


if __name__ == "__main__":
  timing.run(main)
