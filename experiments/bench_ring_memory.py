r"""Per-device memory of a global-batch pair loss: all-gather vs device ring.

On 8 simulated CPU devices (``--xla_force_host_platform_device_count=8``,
set here before JAX is imported), ``jit(shard_map(value_and_grad(loss)))``
of a rule-based loss over the global batch ``B`` (``B / 8`` anchors per
device), for each collective (``"all_gather"``, ``"ring"``) and engine
(dense: ``block_size=None``; blockwise: ``--block-size``):

* per-device memory from XLA's memory analysis of the compiled SPMD program
  (the program of one device): arguments + outputs + temporaries - aliased
  bytes (``experiments.timing.compiled_memory``), and the temporaries
  alone. Every case is only compiled (the analysis needs no run), so the
  sizes that would need terabytes are measured too;
* the wall time of one forward+backward for ``B <= --run-max`` (median of
  ``--repeats`` calls after one warm-up).

A second table fixes the per-device batch and varies the device count
(sub-meshes of 2, 4 and 8 devices): all-gather memory grows with it, the
ring's should not. The results file::

  python experiments/bench_ring_memory.py --record

One configuration::

  python experiments/bench_ring_memory.py --batches 65536 --dims 128
"""

from __future__ import annotations

import datetime
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if __package__ in (None, ""):  # run as a file: python experiments/X.py
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
_REPO = pathlib.Path(__file__).resolve().parents[1]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import circle_jax.losses as cj  # noqa: E402
from experiments import timing  # noqa: E402

_GIB = 2**30
COLLECTIVES = ("all_gather", "ring")
BATCHES = (8192, 32768, 131072, 524288, 1048576)
DIMS = (128, 512)


def _program(loss, collective, block_size, devices):
  """The jitted per-device forward+backward over ``devices``."""
  fn = getattr(cj, f"{loss}_loss")

  def local(x, labels):
    return jax.value_and_grad(lambda x: fn(
        x, labels, axis_name="d", block_size=block_size,
        collective=collective))(x)

  mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P("d")),
                               out_specs=(P(), P("d"))))


def measure(loss, batch, dim, collective, block_size, devices=8,
            run=False, repeats=3) -> dict:
  """Compiles one case (and runs it when ``run``); returns its figures."""
  shapes = (jax.ShapeDtypeStruct((batch, dim), jnp.float32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))
  f = _program(loss, collective, block_size, devices)
  compiled = f.lower(*shapes).compile()
  mem = timing.compiled_memory(compiled)
  out = dict(loss=loss, batch=batch, dim=dim, collective=collective,
             block_size=block_size, devices=devices, peak=mem["peak"],
             temp=mem["temp"], run_s=None)
  if run:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, dim)), jnp.float32)
    labels = jnp.asarray(rng.permutation(np.arange(batch) // 4), jnp.int32)
    out["run_s"] = timing.median_s(lambda: compiled(x, labels), 1, repeats)
  return out


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
                        "/results/ring_memory_cpu.md)")
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
    r = measure(args.loss, batch, dim, collective, block,
                run=batch <= args.run_max, repeats=args.repeats)
    print("[ring]", r, flush=True)
    rows.append(r)
  scaling = []
  for devices in (2, 4, 8):
    for collective in COLLECTIVES:
      r = measure(args.loss, args.local_batch * devices, DIMS[0], collective,
                  args.block_size, devices=devices)
      print("[ring]", r, flush=True)
      scaling.append(r)
  cmd = "python experiments/bench_ring_memory.py" + (
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
  out = args.out or (_REPO / "experiments" / "results" / "ring_memory_cpu.md")
  timing.write_table("\n".join(lines) + "\n", out if args.record else None)


if __name__ == "__main__":
  main()
