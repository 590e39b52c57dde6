"""Benchmark: HIER's regulariser, value and gradient, compiled.

Times ``circle_jax.losses.hier_loss`` (both levels: the samples' triplets
and the proxies' ``M x T`` triplets, each with two Gumbel-softmax choices
over the ``M`` proxies) with its gradient for the embeddings and proxies,
at the omniglot recipe's size by default (``experiments/configs/
omniglot_fewshot.py:hier``: batch 64, 128-d, the paper's 512 proxies and
50 triplets per anchor), and prints XLA's cost analysis of the program.

Usage:
  python -m experiments.bench.hier
  python -m experiments.bench.hier --batch 64 --dim 128 --proxies 512 \
      --triplets 50 --repeats 10

Figures, the default size, on this project's idle 2-core Xeon (two runs of
each): 679 / 671 ms, 3.92 GFLOP, 7.66 GB at 3e8bfb0; 471 / 514 ms, 2.90
GFLOP, 5.31 GB once the triplet loss's backward pass was written out by
hand (676b19f); 404 / 372 ms, 2.26 GFLOP, 4.72 GB once the Gumbel noise
took two words per Threefry hash (``hier.gumbel_noise``). 89.3 M
transcendentals in all three, mostly the 26 M Gumbel draws of the proxies'
LCA choices.
"""

from __future__ import annotations

import numpy as np

from experiments.bench import timing


def measure(batch: int, dim: int, proxies: int, triplets: int,
            repeats: int) -> dict:
  """Median ms of ``hier_loss``'s compiled value and gradient, and XLA's
  flop, byte and transcendental counts of that program."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from circle_jax.losses import hier  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(batch, dim)), jnp.float32)
  y = jnp.asarray(np.arange(batch) % max(batch // 4, 1))
  p = hier.init_hier_proxies(jax.random.PRNGKey(1), 0, dim,
                             num_proxies=proxies, r=hier.Hier.r)
  f = jax.jit(jax.value_and_grad(
      lambda x, p, key: hier.hier_loss(
          x, y, p, key=key, num_proxies=proxies,
          triplets_per_anchor=triplets), argnums=(0, 1)))
  keys = iter(jax.random.split(jax.random.PRNGKey(2), repeats + 2))
  ms = 1e3 * timing.median_s(lambda: f(x, p, next(keys)), 1, repeats)
  cost = f.lower(x, p, jax.random.PRNGKey(0)).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return {"ms": ms, "gflop": cost.get("flops", 0.0) / 1e9,
          "gb": cost.get("bytes accessed", 0.0) / 1e9,
          "mtrans": cost.get("transcendentals", 0.0) / 1e6}


def main():
  p = timing.parser(__doc__, repeats=10)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--proxies", type=int, default=512)
  p.add_argument("--triplets", type=int, default=50)
  args = p.parse_args()
  r = measure(args.batch, args.dim, args.proxies, args.triplets,
              args.repeats)
  print(f"# hier_loss value and gradient, batch {args.batch}, {args.dim}-d, "
        f"{args.proxies} proxies, {args.triplets} triplets per anchor; "
        f"{timing.machine_line()}")
  print("| ms (median) | GFLOP | GB accessed | M transcendentals |")
  print("| ---: | ---: | ---: | ---: |")
  print(f"| {r['ms']:.1f} | {r['gflop']:.2f} | {r['gb']:.2f} | "
        f"{r['mtrans']:.1f} |")


if __name__ == "__main__":
  timing.run(main)
