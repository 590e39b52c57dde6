r"""Per-device memory of a global-batch pair loss: all-gather vs device ring.

On 8 simulated CPU devices (``--xla_force_host_platform_device_count=8``,
set by :mod:`experiments.bench.simulated_devices` before JAX is imported),
``jit(shard_map(value_and_grad(loss)))``
of a rule-based loss over the global batch ``B`` (``B / 8`` anchors per
device), for each collective (``"all_gather"``, ``"ring"``) and engine
(dense: ``block_size=None``; blockwise: ``--block-size``):

* per-device memory from XLA's memory analysis of the compiled SPMD program
  (the program of one device): arguments + outputs + temporaries - aliased
  bytes (``experiments.bench.timing.compiled_memory``), and the temporaries
  alone. Every case is only compiled (the analysis needs no run), so the
  sizes that would need terabytes are measured too;
* the wall time of one forward+backward for ``B <= --run-max`` (median of
  ``--repeats`` calls after one warm-up).

A second table fixes the per-device batch and varies the device count
(sub-meshes of 2, 4 and 8 devices): all-gather memory grows with it, the
ring's should not. The results file::

  python -m experiments.bench.ring_memory --record

One configuration::

  python -m experiments.bench.ring_memory --batches 65536 --dims 128
"""

from __future__ import annotations

import datetime
import pathlib
import sys

from experiments.bench import ring
from experiments.bench import timing

_REPO = pathlib.Path(__file__).resolve().parents[2]

_GIB = 2**30
COLLECTIVES = ("all_gather", "ring")
BATCHES = (8192, 32768, 131072, 524288, 1048576)
DIMS = (128, 512)


def _gib(v):
  return f"{v / _GIB:.3f}"


def _cases(args):
  engines = [None, args.block_size] if args.dense else [args.block_size]
  for dim in args.dims:
    for batch in args.batches:
      for block in engines:
        for collective in COLLECTIVES:
          yield batch, dim, block, collective


def _table(rows, key):
  """Markdown rows: one per (key..., engine), all-gather and ring side by side."""
  by = {}
  for r in rows:
    by.setdefault(tuple(r[k] for k in key) + (r["block_size"],),
                  {})[r["collective"]] = r
  lines = []
  for k, pair in by.items():
    a, r = pair["all_gather"], pair["ring"]
    engine = "dense" if k[-1] is None else f"block {k[-1]}"
    ratio = a["peak"] / r["peak"]
    times = "-" if a["run_s"] is None else (
        f"{a['run_s']:.2f} / {r['run_s']:.2f}")
    lines.append(
        f"| {' | '.join(str(v) for v in k[:-1])} | {engine} | "
        f"{_gib(a['peak'])} | {_gib(r['peak'])} | {ratio:.2f} | "
        f"{_gib(a['temp'])} | {_gib(r['temp'])} | {times} |")
  return lines


def main(argv=None):
  p = timing.parser(__doc__, repeats=3, hugepages=False,
                    out="with --record: the results file (default experiments"
                        "/results/bench/ring_memory_cpu.md)")
  p.add_argument("--loss", default="circle",
                 choices=("circle", "unified", "multi_similarity",
                          "ranked_list", "contrastive"))
  p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
  p.add_argument("--dims", type=int, nargs="+", default=list(DIMS))
  p.add_argument("--block-size", type=int, default=512)
  p.add_argument("--no-dense", dest="dense", action="store_false",
                 help="skip the dense engines (block_size=None)")
  p.add_argument("--run-max", type=int, default=8192,
                 help="also time the cases with B <= this")
  p.add_argument("--local-batch", type=int, default=16384,
                 help="the per-device batch of the device-count table")
  p.add_argument("--record", action="store_true",
                 help="write the results file")
  args = p.parse_args(argv)
  head = ("| all-gather GiB | ring GiB | all-gather / ring | all-gather temp"
          " GiB | ring temp GiB | fwd+bwd s (all-gather / ring) |")
  rows = []
  for batch, dim, block, collective in _cases(args):
    r = ring.measure(args.loss, batch, dim, collective, block,
                run=batch <= args.run_max, repeats=args.repeats)
    print("[ring]", r, flush=True)
    rows.append(r)
  scaling = []
  for devices in (2, 4, 8):
    for collective in COLLECTIVES:
      r = ring.measure(args.loss, args.local_batch * devices, DIMS[0],
                       collective, args.block_size, devices=devices)
      print("[ring]", r, flush=True)
      scaling.append(r)
  cmd = "python -m experiments.bench.ring_memory" + (
      " " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
  lines = [
      f"# Global-batch {args.loss} loss: per-device memory, all-gather vs "
      "device ring (cpu)",
      "",
      f"- command: `{cmd}`",
      f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; "
      f"{timing.machine_line()} (shared machine)",
      "- 8 simulated CPU devices; `jit(shard_map(value_and_grad(loss)))` "
      "with `axis_name`, B/8 anchors per device, labels in groups of 4. "
      "Memory: XLA's memory analysis of the compiled per-device program, "
      "arguments + outputs + temporaries - aliased (`timing.compiled_memory`"
      "), and temporaries alone; compiled only, never run, except the "
      f"fwd+bwd times (B <= {args.run_max}, median of {args.repeats} after "
      "one warm-up).",
      "",
      "| B | D | engine " + head,
      "|---|---|---|---|---|---|---|---|---|",
      *_table(rows, ("batch", "dim")),
      "",
      f"Device count at a fixed per-device batch of {args.local_batch} "
      f"(D = {DIMS[0]}, block {args.block_size}; sub-meshes of the 8 "
      "devices):",
      "",
      "| devices | B | engine " + head,
      "|---|---|---|---|---|---|---|---|---|",
      *_table(scaling, ("devices", "batch")),
  ]
  out = args.out or (_REPO / "experiments/results/bench" / "ring_memory_cpu.md")
  timing.write_table("\n".join(lines) + "\n", out if args.record else None)


if __name__ == "__main__":
  main()
