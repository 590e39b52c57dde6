r"""SupCon and NT-Xent vs pytorch-metric-learning; their memory at scale.

Part 1, time and memory at ``B`` x ``D`` (float32), for each size in turn
(interleaved, so a change of the shared host's load hits every column):

* the floor: forward+backward of the bare similarity matmul
  (``floor.FLOOR``: ``S = X X^T``, ``dX`` from ``dS = S``);
* ours: ``jit(value_and_grad(loss))`` of the dense ``supcon_loss`` /
  ``nt_xent_loss``, and its peak from XLA's memory analysis of the compiled
  program (arguments + outputs + temporaries - aliased,
  ``timing.compiled_memory``). The floor and our losses are timed
  interleaved (``timing.interleaved_medians``: one warm-up call of each,
  then ``--repeats`` rounds of one call of each; the medians);
* the peer: pytorch-metric-learning's ``SupConLoss`` / ``NTXentLoss`` at the
  same temperature, forward and ``backward()`` on the same inputs, each size
  in a fresh child process of this script: its time and its peak memory,
  the child's peak resident set size (``VmHWM``, reset just before the first
  call) minus its resident set then (inputs already built), so it counts
  everything the library allocates. Its time is the lowest, over the torch
  thread counts ``--threads`` (default 1 and every core), of the median of
  ``--repeats`` calls after two warm-up calls (the thread counts
  interleaved): on a loaded host torch's 2 threads can be 50x slower than
  one (their barriers wait for a descheduled thread). A size
  whose predicted peak (the last measured one scaled by ``B^2`` for SupCon,
  ``B^3`` for NT-Xent, whose ``NTXentLoss`` builds a float matrix of
  positive x negative pairs), or whose lower bound read from the peer's
  source (:func:`least_peak`), exceeds ``--peer-max-gb`` is not run.
  For NT-Xent the peer is also run as ``SupConLoss`` on the two-view labels
  (the same loss with two views), the form of it that scales.

Labels: SupCon ``--per-class`` samples per class, NT-Xent two views per
instance (``B / 2`` instances). The same ``tau`` (our default, 0.1) on both
sides. From the peer's measured peaks, the batch at which it would need
``--ram-gb`` is computed (least squares fit of ``a + b B^k``).

Part 2, large batches, compiled only (XLA's memory analysis; never run
unless ``B <= --run-max``): the blockwise SupCon (``block_size=``) on one
device at ``--large-batches``, and the device ring (``axis_name``,
``collective="ring"``, ``block_size``, under ``shard_map``) at
``--ring-batch`` on 8 simulated CPU devices (per-device figures).

The recorded run (experiments/results/bench/contrastive_cpu.md)::

  python -m experiments.bench.contrastive --record

A quick check::

  python -m experiments.bench.contrastive --batch-sizes 256 --dims 64 \
      --large-batches 4096 --ring-batch 8192
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
from typing import Dict, List, Optional

# First: 8 simulated CPU devices for the ring, before JAX is imported.
from experiments.bench import simulated_devices  # noqa: F401  isort: skip

import jax
import jax.numpy as jnp
import numpy as np

import circle_jax.losses as cj
from experiments.bench import floor
from experiments.bench import peers
from experiments.bench import ring
from experiments.bench import timing

_REPO = pathlib.Path(__file__).resolve().parents[2]

LOSSES = ("supcon", "nt_xent")
# Peer columns: (our loss, the peer's loss in peers.pml_loss, label
# grouping, the exponent of its memory growth in B).
PEERS = (("supcon", "supcon", 2), ("nt_xent", "nt_xent", 3),
         ("nt_xent", "supcon", 2))
_GIB = 2**30


def labels_for(loss: str, batch: int, per_class: int) -> np.ndarray:
  """Shuffled labels: ``per_class`` per class (SupCon), two views (NT-Xent)."""
  group = 2 if loss == "nt_xent" else per_class
  return np.random.default_rng(1).permutation(np.arange(batch) // group)


def embeddings(batch: int, dim: int) -> np.ndarray:
  return np.random.default_rng(0).normal(size=(batch, dim)).astype(np.float32)


# ----------------------------------------------------------------------------
# The peer, in a child process (its peak memory from VmHWM).
# ----------------------------------------------------------------------------


def _status_bytes(field: str) -> int:
  """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> None:
  """Resets ``VmHWM`` to the current resident set (Linux >= 4.0).

  ``getrusage``'s ``ru_maxrss`` would not do: a child inherits its parent's
  peak at ``fork`` and keeps it across ``exec``.
  """
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


def peer_child(loss, peer, batch, dim, per_class, threads, repeats) -> dict:
  """Times the peer's forward+backward here; its value and peak memory.

  ``threads``: the torch thread counts, timed interleaved; the fastest one's
  median is ``seconds`` (all of them in ``by_threads``).
  """
  mods, msg = peers.load_torch()
  if mods is None:
    raise SystemExit(msg)
  torch = mods[0]
  fn, _ = peers.pml_loss(mods, peer, dict(cj.LOSSES[loss].defaults),
                                0, dim)
  x = torch.tensor(embeddings(batch, dim), requires_grad=True)
  labels = torch.tensor(labels_for(loss, batch, per_class))
  _reset_peak_rss()
  before = _status_bytes("VmRSS")
  values = []

  def step(n):
    torch.set_num_threads(n)
    x.grad = None
    v = fn(x, labels)
    v.backward()
    values.append(float(v.detach()))
    return ()

  by_threads = timing.interleaved_medians(
      {n: lambda n=n: step(n) for n in threads}, 2, repeats)
  peak = _status_bytes("VmHWM") - before
  best = min(by_threads, key=by_threads.get)
  return dict(seconds=by_threads[best], threads=best, peak=peak,
              value=values[-1], by_threads=by_threads)


def run_peer(loss, peer, batch, dim, args) -> dict:
  cmd = timing.child_command(
      "experiments.bench.contrastive", "--peer-child",
      json.dumps(dict(loss=loss, peer=peer, batch=batch, dim=dim,
                      per_class=args.per_class, threads=args.threads,
                      repeats=args.repeats_for(batch))))
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                        cwd=timing.REPO)
  if proc.returncode != 0:
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return dict(note=f"peer failed: {tail}"[:160])
  return json.loads(proc.stdout.strip().splitlines()[-1])


def least_peak(peer: str, batch: int) -> float:
  """A lower bound of the peer's peak, read from its source (two views).

  ``SupConLoss``: the float32 ``[B, B]`` similarity matrix. ``NTXentLoss``:
  its bool and float32 ``[positive pairs, negative pairs]`` matrices, ``B``
  x ``B (B - 2)`` with two views (it asks 68.7 GB at ``B = 4096``).
  """
  if peer == "nt_xent":
    return 5.0 * batch * batch * (batch - 2)
  return 4.0 * batch * batch


def predicted_peak(measured: Dict[int, float], batch: int, power: int):
  """The last measured peak scaled by ``(B / B_last) ** power`` (or None)."""
  if not measured:
    return None
  last = max(measured)
  return measured[last] * (batch / last) ** power


def batch_at(measured: Dict[int, float], power: int, budget: float):
  """The batch where the least-squares fit ``a + b B^power`` reaches budget."""
  if len(measured) < 2:
    return None
  bs = np.array(sorted(measured), float)
  b, a = np.polyfit(bs ** power, [measured[int(k)] for k in bs], 1)
  return ((budget - a) / b) ** (1.0 / power) if b > 0 else None


# ----------------------------------------------------------------------------
# Part 1: time and memory against the peer.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
  loss: str
  batch: int
  dim: int
  ours_s: Optional[float]
  floor_s: Optional[float]
  peak: Optional[int]
  value: Optional[float] = None
  note: str = ""
  peers: Dict[str, dict] = dataclasses.field(default_factory=dict)


def compile_ours(loss, x, labels):
  """Our dense loss's compiled forward+backward and its memory analysis."""
  fn = jax.jit(jax.value_and_grad(getattr(cj, f"{loss}_loss")))
  compiled = fn.lower(x, labels).compile()
  return compiled, timing.compiled_memory(compiled)["peak"]


def time_size(losses, batch, dim, args):
  """Rows of one size: the floor and our losses compiled, timed interleaved."""
  x = jnp.asarray(embeddings(batch, dim))
  calls, rows = {}, []
  floor_call = floor.FLOOR.lower(x, x).compile()
  calls["floor"] = lambda: floor_call(x, x)
  for loss in losses:
    labels = jnp.asarray(labels_for(loss, batch, args.per_class), jnp.int32)
    compiled, peak = compile_ours(loss, x, labels)
    row = Row(loss, batch, dim, None, None, peak)
    if peak > args.max_memory_gb * _GIB:
      row.note = f"ours not run: needs {peak / _GIB:.1f} GiB"
    else:
      calls[loss] = lambda c=compiled, y=labels: c(x, y)
      row.value = float(compiled(x, labels)[0])
    rows.append(row)
  seconds = timing.interleaved_medians(calls, 1, args.repeats_for(batch))
  for row in rows:
    row.ours_s, row.floor_s = seconds.get(row.loss), seconds["floor"]
  return rows


def part1(args) -> List[Row]:
  rows, peaks = [], {}
  for dim in args.dims:
    for batch in args.batch_sizes:
      for row in time_size(args.losses, batch, dim, args):
        for mine, peer, power in PEERS:
          if mine != row.loss or args.no_peer:
            continue
          seen = peaks.setdefault((mine, peer, dim), {})
          guess = max(predicted_peak(seen, batch, power) or 0.0,
                      least_peak(peer, batch))
          if guess > args.peer_max_gb * _GIB:
            row.peers[peer] = dict(note=f"not run: predicted {guess / _GIB:.1f}"
                                        " GiB")
            continue
          r = run_peer(mine, peer, batch, dim, args)
          if "peak" in r:
            seen[batch] = r["peak"]
          row.peers[peer] = r
        rows.append(row)
        print("[contrastive]", row_line(row), flush=True)
  args.peer_peaks = peaks
  return rows


def _ms(s):
  return "-" if s is None else f"{s * 1e3:.1f}"


def _mib(b):
  return "-" if b is None else f"{b / 2**20:.0f}"


def _peer_cells(row, peer):
  r = row.peers.get(peer)
  if r is None:
    return "- | - | -"
  if "seconds" not in r:
    return f"{r['note']} | - | -"
  ratio = r["seconds"] / row.ours_s if row.ours_s else None
  return (f"{_ms(r['seconds'])} ({r['threads']}) | {_mib(r['peak'])} | "
          f"{'-' if ratio is None else f'{ratio:.2f}'}")


HEAD1 = ("| loss | B | D | floor ms | ours ms | ours / floor | ours peak MiB | "
         "PML ms | PML peak MiB | PML / ours | PML SupConLoss ms | "
         "its peak MiB | it / ours | ours value, PML value |")


def row_line(r: Row) -> str:
  f, o = r.floor_s, r.ours_s
  ratio = "-" if not f or o is None else f"{o / f:.2f}"
  two = _peer_cells(r, "supcon") if r.loss == "nt_xent" else "- | - | -"
  mine = r.peers.get(r.loss, {})
  vals = r.note or ("-" if r.value is None else f"{r.value:.5f}")
  if "value" in mine:
    vals += f", {mine['value']:.5f}"
  return (f"| {r.loss} | {r.batch} | {r.dim} | {_ms(f)} | {_ms(o)} | {ratio} "
          f"| {_mib(r.peak)} | {_peer_cells(r, r.loss)} | {two} | {vals} |")


# ----------------------------------------------------------------------------
# Part 2: large batches, compiled memory analysis.
# ----------------------------------------------------------------------------


def blockwise_case(batch, dim, block_size, run) -> dict:
  """The blockwise SupCon on one device: compiled memory (and one call)."""
  f = jax.jit(jax.value_and_grad(
      lambda x, y: cj.supcon_loss(x, y, block_size=block_size)))
  shapes = (jax.ShapeDtypeStruct((batch, dim), jnp.float32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))
  t0 = time.perf_counter()
  compiled = f.lower(*shapes).compile()
  out = dict(batch=batch, dim=dim, block_size=block_size, devices=1,
             compile_s=time.perf_counter() - t0,
             **timing.compiled_memory(compiled), run_s=None)
  if run:
    x = jnp.asarray(embeddings(batch, dim))
    y = jnp.asarray(labels_for("supcon", batch, 8), jnp.int32)
    out["run_s"] = timing.median_s(lambda: compiled(x, y), 0, 1)
  return out


def part2(args) -> List[dict]:
  out = []
  for batch in args.large_batches:
    r = blockwise_case(batch, args.large_dim, args.block_size,
                       batch <= args.run_max)
    print("[contrastive] blockwise", r, flush=True)
    out.append(r)
  if args.ring_batch > 0:
    r = ring.measure(
        "supcon", args.ring_batch, args.large_dim, "ring", args.block_size,
        devices=8, run=args.ring_batch <= args.run_max, repeats=1)
    print("[contrastive] ring", r, flush=True)
    out.append(dict(r, engine="ring"))
  return out


def part2_lines(cases) -> List[str]:
  lines = ["| engine | devices | B | D | block | peak per device MiB | "
           "temporaries MiB | one fwd+bwd s |", "|---" * 8 + "|"]
  for c in cases:
    engine = c.get("engine", "blockwise")
    run = "-" if c["run_s"] is None else f"{c['run_s']:.3g}"
    lines.append(f"| {engine} | {c['devices']} | {c['batch']} | {c['dim']} | "
                 f"{c['block_size']} | {c['peak'] / 2**20:.1f} | "
                 f"{c['temp'] / 2**20:.1f} | {run} |")
  return lines


def oom_lines(args) -> List[str]:
  lines = []
  for (mine, peer, dim), seen in sorted(args.peer_peaks.items()):
    power = dict(((m, p), k) for m, p, k in PEERS)[(mine, peer)]
    b = batch_at(seen, power, args.ram_gb * 1e9)
    pts = ", ".join(f"B={k}: {v / _GIB:.2f} GiB"
                    for k, v in sorted(seen.items()))
    lines.append(
        f"- PML {'SupConLoss' if peer == 'supcon' else 'NTXentLoss'} "
        f"({mine} labels), D={dim}: measured {pts or 'nothing'}; fit a + b "
        f"B^{power} reaches {args.ram_gb:g} GB at B = "
        f"{'-' if b is None else f'{b:,.0f}'} (computed, not measured)")
  return lines


def main(argv=None):
  p = timing.parser(__doc__, repeats=3,
                    out="with --record: the results file (default "
                        "experiments/results/bench/contrastive_cpu.md)")
  p.add_argument("--losses", default=",".join(LOSSES))
  p.add_argument("--batch-sizes", default="256,512,1024,4096,16384")
  p.add_argument("--dims", default="128,512")
  p.add_argument("--per-class", type=int, default=8,
                 help="SupCon: samples per class")
  p.add_argument("--big-batch", type=int, default=4096,
                 help="above this batch size: --big-repeats timed calls")
  p.add_argument("--big-repeats", type=int, default=2)
  cores = len(os.sched_getaffinity(0))
  p.add_argument("--threads", default="1" if cores == 1 else f"1,{cores}",
                 help="the peer's torch thread counts (its fastest is shown)")
  p.add_argument("--no-peer", action="store_true")
  p.add_argument("--peer-max-gb", type=float, default=5.0,
                 help="do not run the peer where its predicted peak exceeds")
  p.add_argument("--ram-gb", type=float, default=24.0,
                 help="the RAM for the computed out-of-memory batch")
  p.add_argument("--max-memory-gb", type=float, default=5.0,
                 help="ours: compile only programs needing more")
  p.add_argument("--large-batches", default="65536,262144")
  p.add_argument("--large-dim", type=int, default=128)
  p.add_argument("--ring-batch", type=int, default=1048576,
                 help="the ring's global batch (0: no ring)")
  p.add_argument("--block-size", type=int, default=1024)
  p.add_argument("--run-max", type=int, default=65536,
                 help="part 2: also run one step where B <= this")
  p.add_argument("--record", action="store_true",
                 help="write the results file")
  p.add_argument("--peer-child", default="", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.peer_child:
    print(json.dumps(peer_child(**json.loads(args.peer_child))))
    return
  args.losses = [s for s in args.losses.split(",") if s]
  args.threads = [int(n) for n in str(args.threads).split(",")]
  args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  args.dims = [int(d) for d in args.dims.split(",")]
  args.large_batches = [int(b) for b in args.large_batches.split(",") if b]
  args.repeats_for = lambda b: (args.repeats if b <= args.big_batch
                                else args.big_repeats)
  started = time.time()
  rows = part1(args)
  large = part2(args)
  cmd = "python -m experiments.bench.contrastive" + (
      " " + shlex.join(argv if argv is not None else sys.argv[1:])).rstrip()
  lines = [
      "# SupCon and NT-Xent vs pytorch-metric-learning, and memory at scale "
      "(cpu)", "",
      f"- command: `{cmd}`",
      f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}, "
      f"wall time {time.time() - started:.0f} s; {timing.machine_line()}",
      f"- jax {jax.__version__}; float32; tau = "
      f"{cj.LOSSES['supcon'].defaults['tau']} on both sides; SupCon labels: "
      f"{args.per_class} per class, NT-Xent: 2 views per instance; medians of "
      f"{args.repeats} rounds (B > {args.big_batch}: {args.big_repeats}), "
      "ours and the floor interleaved; the peer in a child process per size"
      f", after ours, its time the fastest of torch threads {args.threads}"
      " (the count in parentheses)",
      "- ours peak: XLA memory analysis (arguments + outputs + temporaries);"
      " PML peak: the child process' peak RSS (VmHWM, reset before the "
      "first call) minus its RSS then",
      "", "## Dense forward+backward vs the peer and the matmul floor", "",
      HEAD1, "|" + "---|" * (HEAD1.count("|") - 1),
      *[row_line(r) for r in rows],
      "", "## The peer's out-of-memory batch (24 GB)", "", *oom_lines(args),
      "", "## Large batches (compiled memory analysis)", "",
      *part2_lines(large)]
  out = args.out or (_REPO / "experiments/results/bench" / "contrastive_cpu.md")
  timing.write_table("\n".join(lines) + "\n", out if args.record else None)


if __name__ == "__main__":
  timing.run(main)
