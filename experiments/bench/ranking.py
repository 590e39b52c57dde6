r"""Ranking losses (Smooth-AP, FastAP): time and memory against the peer.

For each batch size ``B`` (``D = 512`` by default) this script measures

* ours: ``jit(value_and_grad(loss))`` of :func:`circle_jax.losses.smooth_ap_loss`
  and :func:`circle_jax.losses.fastap_loss` (tiled, ``--block-size``): the
  median forward+backward time of ``--repeats`` calls after one warm-up (a
  warm-up slower than ``--budget-s`` is the only call timed), and the compiled
  program's memory analysis (arguments + outputs + temporaries, and the
  temporaries alone);
* the peer: pytorch-metric-learning's ``SmoothAPLoss`` / ``FastAPLoss`` (the
  ``[bench]`` extra), forward+backward on the same inputs with
  ``--torch-threads`` threads, each size in a fresh subprocess whose peak
  resident set size (``getrusage``, the whole process) is reported. A size
  whose peer tensors would exceed ``--peer-max-gb`` is skipped (its
  ``SmoothAPLoss`` builds several ``[B, B, B]`` float32 tensors).

The batches have ``sqrt(B)`` classes of ``sqrt(B)`` samples, contiguous by
class: PML 2.9.0's ``SmoothAPLoss`` needs equal class sizes and groups the
batch by the number of classes (see :mod:`circle_jax.losses.smooth_ap`), so
with as many classes as samples per class both libraries rank the same
positives. The values still differ: the official form that PML ports
counts the anchor as its own positive.

The recorded CPU run (experiments/results/bench/ranking_cpu.md)::

  python -m experiments.bench.ranking --batch-sizes 256,1024,4096 \
      --out experiments/results/bench/ranking_cpu.md
"""

from __future__ import annotations

import json
import math
import subprocess
import time


from experiments.bench import timing

_GIB = 2**30
_MIB = 2**20
LOSSES = ("smooth_ap", "fastap")


def batch(b: int, dim: int, seed: int = 0):
  """``(x [b, dim] float32, labels [b])``: sqrt(b) classes of sqrt(b)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  per_class = math.isqrt(b)
  if per_class * per_class != b:
    raise ValueError(f"batch size {b} must be a square (sqrt(B) classes of "
                     "sqrt(B) samples, what PML's SmoothAPLoss needs).")
  x = np.random.default_rng(seed).normal(size=(b, dim)).astype(np.float32)
  return x, np.repeat(np.arange(per_class), per_class).astype(np.int64)


def peer_bytes(loss: str, b: int) -> int:
  """What the peer's largest tensors need: five ``[B, B, B]`` float32 for
  SmoothAPLoss (the repeated similarities, differences, mask, sigmoid and
  its gradient), ``L + 1 = 11`` ``[B, B]`` for FastAPLoss, times 3 for the
  backward."""
  return 5 * 4 * b**3 if loss == "smooth_ap" else 3 * 11 * 4 * b * b


def ours(loss: str, b: int, dim: int, block: int, repeats: int,
         budget_s: float) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from circle_jax import losses  # pylint: disable=import-outside-toplevel
  fn = getattr(losses, f"{loss}_loss")
  x, y = batch(b, dim)
  x, y = jnp.asarray(x), jnp.asarray(y, jnp.int32)
  f = jax.jit(jax.value_and_grad(lambda x, y: fn(x, y, block_size=block)))
  t0 = time.perf_counter()
  compiled = f.lower(x, y).compile()
  compile_s = time.perf_counter() - t0
  mem = timing.compiled_memory(compiled)
  t0 = time.perf_counter()
  value = float(compiled(x, y)[0])  # the warm-up call
  first = time.perf_counter() - t0
  times = ([first] if first > budget_s else
           timing.call_times(lambda: compiled(x, y), 0, repeats))
  return dict(value=value, seconds=sorted(times)[len(times) // 2],
              calls=len(times), compile_s=compile_s, **mem)


def memory(loss: str, b: int, dim: int, block: int) -> dict:
  """Compile-only memory analysis of ours, tiled and as one tile."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from circle_jax import losses  # pylint: disable=import-outside-toplevel
  fn = getattr(losses, f"{loss}_loss")
  x = jax.ShapeDtypeStruct((b, dim), jnp.float32)
  y = jax.ShapeDtypeStruct((b,), jnp.int32)
  out = {}
  for name, bs in (("tiled", block), ("one_tile", b)):
    f = jax.jit(jax.value_and_grad(lambda x, y, bs=bs: fn(x, y,
                                                          block_size=bs)))
    out[name] = timing.compiled_memory(f.lower(x, y).compile())
  return out


def peer(loss: str, b: int, dim: int, repeats: int, threads: int) -> dict:
  """One peer measurement (run in a fresh process by :func:`main`)."""
  import resource  # pylint: disable=import-outside-toplevel

  import torch  # pylint: disable=import-outside-toplevel
  from pytorch_metric_learning import losses as pml  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(threads)
  x_np, y_np = batch(b, dim)
  fn = pml.SmoothAPLoss() if loss == "smooth_ap" else pml.FastAPLoss()
  labels = torch.tensor(y_np)
  times, value = [], None
  for i in range(repeats + 1):
    x = torch.tensor(x_np, requires_grad=True)
    t0 = time.perf_counter()
    out = fn(x, labels)
    out.backward()
    if i:  # the first call warms up
      times.append(time.perf_counter() - t0)
    value = float(out)
  times.sort()
  return dict(value=value, seconds=times[len(times) // 2],
              rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def run_peer(loss, b, args) -> dict:
  cmd = timing.child_command(
      "experiments.bench.ranking", "--peer-one", f"{loss}:{b}",
      "--dim", str(args.dim), "--repeats", str(args.repeats),
      "--torch-threads", str(args.torch_threads), "--no-hugepages")
  out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                       cwd=timing.REPO)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _table(rows, memory_rows, args, started) -> str:
  lines = [
      "# Ranking losses: forward+backward against pytorch-metric-learning",
      "",
      "Command (from the repository root):",
      "",
      "```",
      timing.command_line("experiments.bench.ranking"),
      "```",
      "",
      timing.machine_line(),
      f"Shared machine: 2 CPU cores used by several sessions at once "
      f"(other jobs running), so times are indicative. D = {args.dim}, "
      f"our tile `block_size={args.block_size}`, peer with "
      f"`torch.set_num_threads({args.torch_threads})`; timed calls: the "
      f"median of `--repeats {args.repeats}` after one warm-up (ours: a "
      f"warm-up over {args.budget_s:g} s is the only call timed). Batches: sqrt(B) "
      "classes of sqrt(B) samples (what PML's SmoothAPLoss needs). Memory: "
      "ours from the compiled program's memory analysis (arguments + "
      "outputs + temporaries; temporaries alone); the peer's is the peak "
      "resident set of its whole process (Python and torch included).",
      "",
      "| loss | B | ours s | ours peak MiB | ours temp MiB | ours value | "
      "PML s | PML peak RSS MiB | PML value | PML / ours time |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
  ]
  for r in rows:
    p = r.get("peer")
    if p is None:
      peer_cols = f"skipped ({r['skip']}) | - | - | -"
    else:
      peer_cols = (f"{p['seconds']:.3f} | {p['rss'] / _MIB:.0f} | "
                   f"{p['value']:.4f} | {p['seconds'] / r['seconds']:.1f}x")
    lines.append(
        f"| {r['loss']} | {r['b']} | {r['seconds']:.3f} "
        f"({r['calls']} calls) | {r['peak'] / _MIB:.0f} | "
        f"{r['temp'] / _MIB:.0f} | {r['value']:.4f} | {peer_cols} |")
  lines += [
      "",
      "## Compiled memory (compile only), the growth with B",
      "",
      "XLA's memory analysis of `jit(value_and_grad(loss))` at D = "
      f"{args.dim}: tiled (`block_size={args.block_size}`) and as one tile "
      "(`block_size=B`, what forming the whole `[B, B, B]` / `[B, B, L+1]` "
      "tensor costs; compiled, never run).",
      "",
      "| loss | B | tiled peak MiB | tiled temp MiB | one-tile peak MiB | "
      "tiled peak / previous B |",
      "| --- | --- | --- | --- | --- | --- |",
  ]
  previous = {}
  for r in memory_rows:
    tiled, one = r["tiled"], r["one_tile"]
    prev = previous.get(r["loss"])
    growth = f"{tiled['peak'] / prev:.2f}x" if prev else "-"
    previous[r["loss"]] = tiled["peak"]
    lines.append(
        f"| {r['loss']} | {r['b']} | {tiled['peak'] / _MIB:.0f} | "
        f"{tiled['temp'] / _MIB:.0f} | {one['peak'] / _MIB:,.0f} | "
        f"{growth} |")
  lines += [
      "",
      "Values differ for Smooth-AP by design: PML (as the official code) "
      "counts each anchor as its own top-ranked positive; we follow the "
      "paper's sets (circle_jax/losses/smooth_ap.py). FastAP values agree.",
      "",
      f"Total wall time {time.time() - started:.0f} s.",
      "",
  ]
  return "\n".join(lines)


def main():
  p = timing.parser(__doc__, repeats=2, out="results file (Markdown)")
  p.add_argument("--batch-sizes", default="256,1024,4096")
  p.add_argument("--dim", type=int, default=512)
  p.add_argument("--memory-sizes", default="1024,2048,4096",
                 help="batch sizes of the compile-only memory table")
  p.add_argument("--block-size", type=int, default=128)
  p.add_argument("--losses", default=",".join(LOSSES))
  p.add_argument("--torch-threads", type=int, default=2)
  p.add_argument("--peer-max-gb", type=float, default=6.0)
  p.add_argument("--budget-s", type=float, default=20.0)
  p.add_argument("--peer-one", default="", help=argparse_hidden())
  args = p.parse_args()
  if args.peer_one:
    loss, b = args.peer_one.split(":")
    print(json.dumps(peer(loss, int(b), args.dim, args.repeats,
                          args.torch_threads)))
    return
  started = time.time()
  memory_rows = []
  for loss in args.losses.split(","):
    for b in map(int, args.memory_sizes.split(",")):
      memory_rows.append(dict(loss=loss, b=b, **memory(
          loss, b, args.dim, args.block_size)))
      print(memory_rows[-1], flush=True)
  rows = []
  for loss in args.losses.split(","):
    for b in map(int, args.batch_sizes.split(",")):
      row = dict(loss=loss, b=b, **ours(loss, b, args.dim, args.block_size,
                                        args.repeats, args.budget_s))
      need = peer_bytes(loss, b)
      if need > args.peer_max_gb * _GIB:
        row["skip"] = (f"needs ~{need / _GIB:.0f} GiB > "
                       f"{args.peer_max_gb:g} GiB")
      else:
        row["peer"] = run_peer(loss, b, args)
      print(row, flush=True)
      rows.append(row)
  timing.write_table(_table(rows, memory_rows, args, started), args.out)


def argparse_hidden():
  import argparse  # pylint: disable=import-outside-toplevel
  return argparse.SUPPRESS


if __name__ == "__main__":
  timing.run(main)
