"""Benchmark: one XLA matmul on this machine, float32 and bf16.

The floor under every similarity-based computation here (pair losses,
retrieval) is the ``[M, K] x [K, N]`` similarity matmul. This times one such
matmul alone, compiled, on the default JAX backend:

* ``float32``: float32 operands, ``Precision.HIGHEST`` (what the losses and
  ``retrieval_metrics`` use);
* ``bfloat16 -> float32``: bf16 operands with float32 accumulation
  (``preferred_element_type``), which uses AMX tiles on CPUs that have them.

Usage:
  python -m experiments.bench.matmul                       # 1024 x 512 x 3168
  python -m experiments.bench.matmul --shape 4096,512,4096 --repeats 50

Like the other CPU benchmarks it re-executes itself with huge-page malloc
(``circle_jax/hostenv.py``; ``--no-hugepages`` keeps the default).
"""

from __future__ import annotations


import numpy as np

from experiments.bench import timing


def time_matmul(m, k, n, dtype, repeats):
  """(min, median) seconds of a compiled ``[m, k] x [n, k]^T`` matmul."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
  y = jnp.asarray(rng.standard_normal((n, k), np.float32), dtype)
  f = jax.jit(lambda x, y: jax.lax.dot_general(
      x, y, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32))
  times = timing.call_times(lambda: f(x, y), 1, repeats)
  return min(times), float(np.median(times))


def main():
  p = timing.parser(__doc__, repeats=30)
  p.add_argument("--shape", default="1024,512,3168", help="M,K,N")
  args = p.parse_args()
  m, k, n = (int(v) for v in args.shape.split(","))
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  print(f"# [{m} x {k}] x [{k} x {n}]; {timing.machine_line()}")
  print("| operands | min ms | median ms | GFLOP/s (min) |")
  print("| --- | --- | --- | --- |")
  flop = 2.0 * m * k * n
  for name, dtype in (("float32", jnp.float32),
                      ("bfloat16 -> float32", jnp.bfloat16)):
    lo, med = time_matmul(m, k, n, dtype, args.repeats)
    print(f"| {name} | {lo * 1e3:.2f} | {med * 1e3:.2f} | {flop / lo / 1e9:.0f} |")


if __name__ == "__main__":
  timing.run(main)
