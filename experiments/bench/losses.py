r"""Loss benchmark: forward+backward time, compile time and peak memory.

For every registered loss (``circle_jax.losses.LOSSES``), every batch size and
dtype, this script measures

* the forward+backward time of ``jit(value_and_grad(loss))`` (gradients with
  respect to the embeddings and the loss's parameters, if any): the median of
  ``--repeats`` timed calls after ``--warmup`` calls, each ended with
  ``block_until_ready``;
* the compile time (``lower(...).compile()``, wall clock);
* the peak device memory of the compiled program from XLA's memory analysis
  (arguments + outputs + temporaries - aliased bytes);
* the "matmul floor" for the same inputs: forward and backward of the bare
  similarity matmul ``S = X Y^T`` (3 matmuls: ``S``, ``dX = dS Y``,
  ``dY = dS^T X``, with ``dS = S`` so nothing can be simplified away), in
  float32 like the losses' compute, and each loss's ratio to it. Pair losses
  are compared with the ``[B, B]`` floor, proxy and classifier losses with
  their ``[B, C]`` floor;
* when ``torch`` and ``pytorch-metric-learning`` are installed (the ``[bench]``
  extra), the same loss in that library on the same inputs with the same
  number of threads, and the speed-up. They are imported lazily; without them
  the column says "n/a".

Optionally (``--blockwise 1024``) the blockwise Circle / MS / RLL rows are
added (their ``block_size=`` form, :mod:`circle_jax.losses.engine`).

On Linux with glibc >= 2.35 the script re-executes itself with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (``--no-hugepages`` to keep the
default malloc; see ``circle_jax/hostenv.py``).

Results are printed and written to
``experiments/results/bench/losses_<platform>.md`` (``cpu``, ``gpu``, ``tpu``),
with the device, the thread count, the host load and the exact command.

Examples::

  # the recorded CPU run (see experiments/results/bench/losses_cpu.md)
  python -m experiments.bench.losses --batch-sizes 256,1024,4096,16384 \
      --blockwise 512 --max-memory-gb 16

  # a quick subset
  python -m experiments.bench.losses --losses circle,multi_similarity \
      --batch-sizes 256 --dtypes float32 --repeats 3 --out /tmp/bench.md

A loss/size whose compiled program would need more than ``--max-memory-gb`` is
reported as skipped (compile only, never run); the peer library is run only
up to ``--torch-max-batch``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pathlib
import time
from typing import Dict, List, Optional

import numpy as np

import jax
import jax.numpy as jnp

from circle_jax import hostenv
from circle_jax import losses as cj_losses
from experiments.bench import floor
from experiments.bench import peers
from experiments.bench import timing

_REPO = pathlib.Path(__file__).resolve().parents[2]

# A single call slower than this ends a measurement early (one call timed).
_SLOW_CALL_S = 20.0
# The peer library's implementations that allocate O(B^3) memory (OOM on the
# 23 GB machine above these batch sizes).
# NTXentLoss builds a float [positive pairs, negative pairs] matrix: B^3
# (68 GB at B = 4,096 with two views).
# PNPLoss builds [B, B, B] float tensors (275 GB at B = 4,096).
_PEER_MAX_BATCH = {"lifted_structure": 256, "triplet": 1024, "nt_xent": 512,
                   "pnp": 256}
TARGETED = ("circle", "multi_similarity", "ranked_list", "proxy_anchor",
            "ranked_proxy_anchor")
_MIB = 2**20


@dataclasses.dataclass
class Measured:
  seconds: Optional[float] = None
  compile_s: Optional[float] = None
  peak_bytes: Optional[int] = None
  note: str = ""
  cost: Optional[dict] = None  # XLA cost analysis: flops, transcendentals, bytes


def _cost(compiled) -> Optional[dict]:
  try:
    c = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  c = c[0] if isinstance(c, (list, tuple)) else c
  if not c:
    return None
  return {k: float(c.get(k, 0.0)) for k in
          ("flops", "transcendentals", "bytes accessed")}


def _measure_jax(fn, args, warmup, repeats, max_bytes) -> Measured:
  """Compiles ``fn`` (already jitted), checks its memory, times it."""
  t0 = time.perf_counter()
  try:
    compiled = fn.lower(*args).compile()
  except Exception as e:  # pylint: disable=broad-except
    return Measured(note=f"compile error: {type(e).__name__}: {e}"[:120])
  compile_s = time.perf_counter() - t0
  peak = (timing.compiled_memory(compiled) or {}).get("peak")
  cost = _cost(compiled)
  if peak is not None and peak > max_bytes:
    return Measured(compile_s=compile_s, peak_bytes=peak, cost=cost,
                    note=f"skipped: needs {peak / 2**30:.1f} GiB")
  try:
    seconds = timing.median_s(lambda: compiled(*args), warmup, repeats,
                           budget_s=_SLOW_CALL_S)
  except Exception as e:  # pylint: disable=broad-except
    return Measured(compile_s=compile_s, peak_bytes=peak, cost=cost,
                    note=f"run error: {type(e).__name__}"[:120])
  return Measured(seconds, compile_s, peak, cost=cost)


def _measure_torch(mods, name, hyper, x_np, labels_np, num_classes, dtype,
                   warmup, repeats) -> Measured:
  torch = mods[0]
  made = peers.pml_loss(mods, name, hyper, num_classes, x_np.shape[1])
  if made is None:
    return Measured(note="no peer")
  loss_fn, miner = made
  tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  x = torch.tensor(x_np, dtype=torch.float32).to(tdtype).requires_grad_(True)
  labels = torch.tensor(labels_np, dtype=torch.int64)
  params = list(loss_fn.parameters())

  def step():
    x.grad = None
    for p in params:
      p.grad = None
    loss = peers.pml_forward(name, loss_fn, miner, x, labels)
    loss.backward()
    return loss

  try:
    seconds = timing.median_s(lambda: (step(), ())[1], warmup, repeats,
                           budget_s=_SLOW_CALL_S)
  except Exception as e:  # pylint: disable=broad-except
    # The first words say why (e.g. an allocation the host cannot make).
    return Measured(note=f"peer error: {type(e).__name__}: {e}"[:100])
  return Measured(seconds)


# ----------------------------------------------------------------------------
# The sweep.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
  loss: str
  kind: str
  dtype: str
  batch: int
  jax: Measured
  floor_s: Optional[float]
  floor_name: str
  peer: Measured
  floor_cost: Optional[dict] = None
  dim: int = 0

  def ratio(self):
    if self.jax.seconds is None or not self.floor_s:
      return None
    return self.jax.seconds / self.floor_s

  def speedup(self):
    if self.jax.seconds is None or self.peer.seconds is None:
      return None
    return self.peer.seconds / self.jax.seconds


def _fmt(v, spec, empty="-"):
  return empty if v is None else format(v, spec)


def _loss_fns(names, block_size):
  """(name, kind, fn(x, labels, params), param_init or None, hyper) tuples."""
  out = []
  for name in names:
    entry = cj_losses.LOSSES[name]
    def fn(x, labels, params, entry=entry):
      key = jax.random.PRNGKey(0) if entry.needs_key else None
      return entry.apply(x, labels, params, key=key)
    out.append((name, entry.kind, fn, entry, dict(entry.defaults)))
  if block_size:
    for name in ("circle", "multi_similarity", "ranked_list"):
      f = cj_losses.LOSSES[name].fn
      if name in names:
        def fn(x, labels, params, f=f):
          del params
          return f(x, labels, block_size=block_size)
        out.append((f"{name} (blockwise {block_size})", "pair", fn, None,
                    dict(cj_losses.LOSSES[name].defaults)))
  return out


def run(args) -> List[Row]:
  if args.losses == "all":
    names = list(cj_losses.LOSSES)
  elif args.losses in cj_losses.registry.KINDS:  # every loss of a kind
    names = [n for n, e in cj_losses.LOSSES.items() if e.kind == args.losses]
  else:
    names = [n.strip() for n in args.losses.split(",") if n.strip()]
  unknown = [n for n in names if n not in cj_losses.LOSSES]
  if unknown:
    raise SystemExit(f"unknown losses {unknown}; known: {sorted(cj_losses.LOSSES)}")
  batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  dtypes = [d.strip() for d in args.dtypes.split(",")]
  big_names = (names if args.big_losses == "all" else
               [n for n in args.big_losses.split(",") if n])
  torch_mods, torch_msg = (None, "disabled (--no-torch)")
  if not args.no_torch:
    torch_mods, torch_msg = peers.load_torch()
    if torch_mods is not None:
      torch_mods[0].set_num_threads(args.threads)
  if torch_mods is None:
    print(f"[bench] peer library: {torch_msg}", flush=True)
  max_bytes = int(args.max_memory_gb * 2**30)
  rows: List[Row] = []
  fns = _loss_fns(names, args.blockwise)
  for batch in batch_sizes:
    num_classes = args.num_classes or max(batch // args.per_class, 2)
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(batch, args.dim)).astype(np.float32)
    labels_np = rng.permutation(np.arange(batch) // args.per_class % num_classes)
    labels = jnp.asarray(labels_np, jnp.int32)
    repeats = args.repeats if batch <= args.big_batch else args.big_repeats
    warmup = args.warmup if batch <= args.big_batch else 1
    for dtype in dtypes:
      x = jnp.asarray(x_np).astype(dtype)
      proxies = jnp.asarray(rng.normal(size=(num_classes, args.dim)),
                            jnp.float32)
      floors: Dict[str, Measured] = {
          "BxB": _measure_jax(floor.FLOOR, (x, x), warmup, repeats, max_bytes),
          "BxC": _measure_jax(floor.FLOOR, (x, proxies), warmup, repeats,
                              max_bytes),
      }
      f = floors["BxB"]
      print(f"[bench] B={batch} {dtype} floor BxB {_fmt(f.seconds, '.4f')} s "
            f"({_tflops(6 * batch * batch * args.dim, f.seconds)} TFLOP/s)",
            flush=True)
      for name, kind, fn, entry, hyper in fns:
        base = name.split(" ")[0]
        if batch > args.big_batch and base not in big_names:
          continue
        params = None
        if entry is not None and entry.param_name is not None:
          params = entry.init_params(jax.random.PRNGKey(1), num_classes,
                                     args.dim)
        argnums = (0,) if params is None else (0, 2)
        jfn = jax.jit(jax.value_and_grad(fn, argnums=argnums))
        measured = _measure_jax(jfn, (x, labels, params), warmup, repeats,
                                max_bytes)
        floor_name = "BxB" if kind == "pair" else "BxC"
        if args.floor_every_loss:  # next to the loss, under the same load
          floors[floor_name] = _measure_jax(
              floor.FLOOR, (x, x if kind == "pair" else proxies), warmup,
              repeats, max_bytes)
        peer = Measured(note=torch_msg if torch_mods is None else "")
        peer_max = min(args.torch_max_batch,
                       _PEER_MAX_BATCH.get(name, args.torch_max_batch))
        if (torch_mods is not None and " " not in name
            and batch <= peer_max):
          peer = _measure_torch(torch_mods, name, hyper, x_np, labels_np,
                                num_classes, dtype, warmup, repeats)
        elif torch_mods is not None and " " not in name:
          peer = Measured(note=f"peer not run (B > {peer_max})")
        row = Row(name, kind, dtype, batch, measured,
                  floors[floor_name].seconds, floor_name, peer,
                  floors[floor_name].cost, args.dim)
        rows.append(row)
        print(_row_line(row), flush=True)
  return rows


def _tflops(flops, seconds):
  if not seconds:
    return "-"
  return f"{flops / seconds / 1e12:.3f}"


HEADER = ("| loss | kind | dtype | B | fwd+bwd ms | compile s | peak MiB | "
          "floor | floor ms | ratio | PML ms | speed-up vs PML | "
          "XLA flops / floor | exp+log+sqrt per B*N | bytes / floor | note |")


def _row_line(r: Row) -> str:
  note = "; ".join(n for n in (r.jax.note, r.peer.note) if n)
  return (f"| {r.loss} | {r.kind} | {r.dtype} | {r.batch} | "
          f"{_fmt(None if r.jax.seconds is None else r.jax.seconds * 1e3, '.1f')} | "
          f"{_fmt(r.jax.compile_s, '.2f')} | "
          f"{_fmt(None if r.jax.peak_bytes is None else r.jax.peak_bytes / _MIB, '.0f')} | "
          f"{r.floor_name} | "
          f"{_fmt(None if r.floor_s is None else r.floor_s * 1e3, '.1f')} | "
          f"{_fmt(r.ratio(), '.2f')} | "
          f"{_fmt(None if r.peer.seconds is None else r.peer.seconds * 1e3, '.1f')} | "
          f"{_fmt(r.speedup(), '.1f')} | {_cost_cols(r)} | {note} |")


def _cost_cols(r: Row) -> str:
  """Load-independent columns from XLA's cost analysis (vs the floor's)."""
  c, f = r.jax.cost, r.floor_cost
  if "blockwise" in r.loss:  # XLA's cost analysis counts a loop body once
    return "- | - | -"
  if not c or not f or not f.get("flops") or not f.get("bytes accessed"):
    return "- | - | -"
  # The floor's flops are 6 B N D: recover B*N (pairs) from them.
  pairs = f["flops"] / 6.0 / r.dim if r.dim else None
  trans = c["transcendentals"] / pairs if pairs else None
  return (f"{c['flops'] / f['flops']:.2f} | {_fmt(trans, '.1f')} | "
          f"{c['bytes accessed'] / f['bytes accessed']:.1f}")


def _platform_name():
  return jax.devices()[0].platform


def _load(avg):
  return ", ".join(f"{v:.2f}" for v in avg)


def write_markdown(rows: List[Row], args, path: pathlib.Path, started: float):
  dev = jax.devices()[0]
  lines = [
      f"# Loss benchmark on {dev.platform} ({dev.device_kind})",
      "",
      f"- command: `{timing.command_line('experiments.bench.losses')}`",
      f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}, "
      f"total wall time {time.time() - started:.0f} s",
      f"- host (at the end): {hostenv.describe(with_jax=False)}",
      f"- jax {jax.__version__}, D={args.dim}, labels: {args.per_class} "
      f"samples per class, C = {'B/%d' % args.per_class if not args.num_classes else args.num_classes} "
      f"classes/proxies; median of {args.repeats} timed calls after "
      f"{args.warmup} warm-up calls (B > {args.big_batch}: "
      f"{args.big_repeats} after 1)",
      f"- peer: pytorch-metric-learning with torch.set_num_threads("
      f"{args.threads}) on the same inputs; XLA uses all visible cores",
      "- floor: forward+backward of the bare similarity matmul (`S = X Y^T`, "
      "`dX = dS Y`, `dY = dS^T X`) in float32; BxB for pair losses, BxC "
      "(samples x proxies/classes) for proxy and classifier losses; ratio = "
      "loss time / floor time"
      + ("; the floor is timed again right before each loss (same load)"
         if args.floor_every_loss else ""),
      f"- load average (1, 5, 15 min, as `uptime` reports it): "
      f"{_load(args.load_at_start)} at the start, {_load(os.getloadavg())} "
      f"at the end, on {os.cpu_count()} CPUs",
      "- peak MiB: XLA memory analysis of the compiled forward+backward "
      "(arguments + outputs + temporaries)",
      "- load-independent columns from XLA's cost analysis of the compiled "
      "forward+backward: flops and bytes accessed relative to the floor's, and "
      "transcendental ops (exp, log, sqrt, ...) per pair (B*B, or B*C for "
      "proxy/classifier losses)",
      "",
      HEADER,
      "|" + "---|" * (HEADER.count("|") - 1),
  ]
  lines += [_row_line(r) for r in rows]
  floors = {}
  for r in rows:
    if r.floor_name == "BxB" and r.floor_s:
      floors[(r.dtype, r.batch)] = r.floor_s
  if floors:
    lines += ["", "Matmul floor rate (BxB, forward + backward = 6 B^2 D flops):", ""]
    for (dtype, batch), s in sorted(floors.items(), key=lambda kv: kv[0][1]):
      lines.append(f"- B={batch} {dtype}: {s * 1e3:.1f} ms, "
                   f"{_tflops(6 * batch * batch * args.dim, s)} TFLOP/s")
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("\n".join(lines) + "\n")


def main(argv=None):
  p = timing.parser(__doc__, repeats=5,
                   out="output file (default experiments/results/bench/"
                       "losses_<platform>.md)")
  p.add_argument("--losses", default="all",
                 help="comma-separated registry names, 'all', or a kind "
                      "('pair', 'proxy', 'classifier': every registered "
                      "loss of that kind)")
  p.add_argument("--batch-sizes", default="256,1024,4096,16384")
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--dim", type=int, default=512)
  p.add_argument("--per-class", type=int, default=4,
                 help="samples per class in the batch")
  p.add_argument("--num-classes", type=int, default=0,
                 help="classes/proxies (default: B / per-class)")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--big-batch", type=int, default=4096,
                 help="above this batch size use --big-repeats and only "
                      "--big-losses")
  p.add_argument("--big-repeats", type=int, default=3)
  p.add_argument("--big-losses", default=",".join(TARGETED),
                 help="losses run above --big-batch ('all' for every loss)")
  p.add_argument("--blockwise", type=int, default=0,
                 help="also time the blockwise losses with this block size")
  p.add_argument("--threads", type=int,
                 default=len(os.sched_getaffinity(0)),
                 help="torch threads for the peer library")
  p.add_argument("--floor-every-loss", action="store_true",
                 help="time the matmul floor again before each loss (on a "
                      "loaded host the ratio then compares times taken "
                      "under the same load)")
  p.add_argument("--no-torch", action="store_true")
  p.add_argument("--torch-max-batch", type=int, default=4096)
  p.add_argument("--max-memory-gb", type=float, default=6.0,
                 help="skip (compile only) programs needing more memory")
  args = p.parse_args(argv)
  started = time.time()
  args.load_at_start = os.getloadavg()
  print("[bench] " + HEADER, flush=True)
  rows = run(args)
  out = pathlib.Path(args.out) if args.out else (
      _REPO / "experiments/results/bench" / f"losses_{_platform_name()}.md")
  write_markdown(rows, args, out, started)
  print(out.read_text())
  print(f"[bench] wrote {out}")


if __name__ == "__main__":
  timing.run(main)
