"""Compile-time memory and step time of every registered loss (value + grad).

For each entry of ``circle_jax.losses.LOSSES`` this compiles
``value_and_grad`` w.r.t. the embeddings and the loss's parameters on a P x K
batch and reports XLA's temporary-buffer size (``memory_analysis``: shows
whether the ``[B, B, B]`` triplet tensors of ``triplet``/``semi_hard`` are
fused away or materialised) and the median wall time of a step.

Usage (from the repository root)::

    python -m experiments.bench.baseline_losses --batch 256 --dim 128 \\
        --classes_per_batch 64 --repeats 20 [--losses triplet,margin]

Prints one Markdown row per loss. Timings are of the backend JAX picks
(CPU here unless a GPU jaxlib is installed); record the command next to any
figure you quote.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from circle_jax import losses
from experiments.bench import timing


def bench(name, batch, dim, classes_per_batch, repeats, num_classes):
  entry = losses.get_loss(name)
  k = batch // classes_per_batch
  labels = jnp.asarray(np.repeat(np.arange(classes_per_batch), k), jnp.int32)
  x = jax.random.normal(jax.random.PRNGKey(0), (batch, dim), jnp.float32)
  hyper = {"centers_per_class": 10} if name == "soft_triple" else {}
  params = entry.init_params(jax.random.PRNGKey(1), num_classes, dim, **hyper)
  key = jax.random.PRNGKey(2)

  def step(x, params):
    f = lambda x, p: entry.apply(x, labels, p, key=key)
    return jax.value_and_grad(f, argnums=(0, 1))(x, params)

  t0 = time.perf_counter()
  compiled = jax.jit(step).lower(x, params).compile()
  compile_s = time.perf_counter() - t0
  mem = timing.compiled_memory(compiled)
  temp_mb = mem["temp"] / 2**20 if mem is not None else float("nan")
  ms = 1e3 * timing.median_s(lambda: compiled(x, params), 1, repeats)
  return compile_s, temp_mb, ms


def main():
  parser = timing.parser(__doc__, repeats=20, hugepages=False)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--dim", type=int, default=128)
  parser.add_argument("--classes_per_batch", type=int, default=64)
  parser.add_argument("--num_classes", type=int, default=100)
  parser.add_argument("--losses", default="",
                      help="comma-separated registry names (default: all)")
  args = parser.parse_args()
  names = args.losses.split(",") if args.losses else sorted(losses.LOSSES)
  print(f"backend={jax.default_backend()} B={args.batch} D={args.dim} "
        f"P={args.classes_per_batch} C={args.num_classes}")
  print("| loss | compile s | XLA temp MiB | step ms (median) |")
  print("| --- | --- | --- | --- |")
  for name in names:
    c, m, t = bench(name, args.batch, args.dim, args.classes_per_batch,
                    args.repeats, args.num_classes)
    print(f"| `{name}` | {c:.2f} | {m:.1f} | {t:.2f} |", flush=True)


if __name__ == "__main__":
  main()
