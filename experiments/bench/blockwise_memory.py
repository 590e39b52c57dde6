r"""Peak memory of the blockwise losses at batch sizes where dense cannot run.

One forward+backward (``jit(value_and_grad)``) of a blockwise loss at
``B = 65,536``, ``D = 128`` (defaults), reporting

* XLA's memory analysis of the compiled program (arguments + outputs +
  temporaries), and the same analysis for the dense loss (compiled only,
  never run: it would need tens of GB);
* the process' peak resident set size (``getrusage``; includes the Python
  interpreter, JAX and the XLA runtime, ~0.3-0.5 GB on its own);
* the wall time, the loss value and that the gradient is finite.

``--record`` runs every loss in a fresh subprocess under ``/usr/bin/time -v``
(the independent peak-RSS measurement; ``apt-get install -y time`` if
missing) and writes
``experiments/results/bench/blockwise_memory_<platform>.md``::

  python -m experiments.bench.blockwise_memory --record

A single measurement::

  /usr/bin/time -v python -m experiments.bench.blockwise_memory \
      --loss circle --batch 65536 --dim 128 --block-size 1024
"""

from __future__ import annotations

import datetime
import json
import pathlib
import re
import resource
import shlex
import subprocess
import sys
import time

from experiments.bench import timing

_REPO = pathlib.Path(__file__).resolve().parents[2]

LOSSES = ("circle", "multi_similarity", "ranked_list")
_GIB = 2**30


def measure(loss: str, batch: int, dim: int, block_size: int,
            dense_analysis: bool) -> dict:
  """Compiles and runs one blockwise forward+backward; returns the figures."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import circle_jax.losses as cj  # pylint: disable=import-outside-toplevel
  loss_fn = getattr(cj, f"{loss}_loss")
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(batch, dim)), jnp.float32)
  labels = jnp.asarray(rng.permutation(np.arange(batch) // 4), jnp.int32)

  f = jax.jit(jax.value_and_grad(
      lambda x, y: loss_fn(x, y, block_size=block_size)))
  t0 = time.perf_counter()
  compiled = f.lower(x, labels).compile()
  compile_s = time.perf_counter() - t0
  mem = timing.compiled_memory(compiled)
  peak, temp = mem["peak"], mem["temp"]
  out = dict(loss=loss, batch=batch, dim=dim, block_size=block_size,
             compile_s=compile_s, analysis_peak_bytes=peak,
             analysis_temp_bytes=temp)
  if dense_analysis:
    g = jax.jit(jax.value_and_grad(lambda x, y: loss_fn(x, y)))
    out["dense_analysis_peak_bytes"] = timing.compiled_memory(
        g.lower(x, labels).compile())["peak"]
  t0 = time.perf_counter()
  value, grad = compiled(x, labels)
  grad = grad.block_until_ready()
  out["run_s"] = time.perf_counter() - t0
  out["value"] = float(value)
  out["grad_finite"] = bool(jnp.all(jnp.isfinite(grad)))
  out["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return out


def _record(args):
  import jax  # pylint: disable=import-outside-toplevel
  platform = jax.devices()[0].platform
  rows = []
  for loss in args.losses.split(","):
    cmd = ["/usr/bin/time", "-v", *timing.child_command(
        "experiments.bench.blockwise_memory"),
           "--loss", loss, "--batch", str(args.batch), "--dim", str(args.dim),
           "--block-size", str(args.block_size), "--json"]
    if not args.no_dense_analysis:
      cmd.append("--dense-analysis")
    print("[mem] running:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          cwd=timing.REPO)
    if proc.returncode != 0:
      print(proc.stdout, proc.stderr, file=sys.stderr)
      raise SystemExit(f"{loss} failed")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    result["time_v_maxrss_bytes"] = int(rss.group(1)) * 1024 if rss else None
    shown = ["/usr/bin/time", "-v", "python", "-m",
             "experiments.bench.blockwise_memory"] + cmd[5:]
    result["command"] = " ".join(shlex.quote(c) for c in shown)
    print("[mem]", json.dumps(result), flush=True)
    rows.append(result)
  _write(rows, args, platform)


def _gib(v):
  return "-" if v is None else f"{v / _GIB:.2f}"


def _write(rows, args, platform):
  lines = [
      f"# Blockwise losses: peak memory of forward+backward ({platform})",
      "",
      f"- command: `python -m experiments.bench.blockwise_memory --record "
      f"--batch {args.batch} --dim {args.dim} --block-size {args.block_size}`"
      f" (each loss in a fresh process under `/usr/bin/time -v`)",
      f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; "
      f"{timing.machine_line()} (shared machine)",
      "- `/usr/bin/time` max RSS: whole process (Python + JAX runtime + "
      "inputs + program); XLA analysis: arguments + outputs + temporaries of "
      "the compiled program; dense: the same analysis of the dense loss "
      "(compiled, not run)",
      f"- a dense `[B, B]` float32 matrix alone is "
      f"{args.batch * args.batch * 4 / _GIB:.1f} GiB",
      "",
      "| loss | B | D | block | max RSS GiB (/usr/bin/time -v) | XLA peak GiB"
      " (blockwise) | XLA peak GiB (dense) | fwd+bwd s | compile s | loss | "
      "grad finite | command |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
        f"| {r['loss']} | {r['batch']} | {r['dim']} | {r['block_size']} | "
        f"{_gib(r['time_v_maxrss_bytes'])} | {_gib(r['analysis_peak_bytes'])} "
        f"| {_gib(r.get('dense_analysis_peak_bytes'))} | {r['run_s']:.1f} | "
        f"{r['compile_s']:.1f} | {r['value']:.5f} | {r['grad_finite']} | "
        f"`{r['command']}` |")
  out = pathlib.Path(args.out) if args.out else (
      _REPO / "experiments/results/bench" / f"blockwise_memory_{platform}.md")
  timing.write_table("\n".join(lines) + "\n", out)


def main(argv=None):
  p = timing.parser(__doc__, hugepages=False,
                   out="with --record: the results file (default experiments/"
                       "results/bench/blockwise_memory_<platform>.md)")
  p.add_argument("--loss", default="circle", choices=LOSSES)
  p.add_argument("--losses", default=",".join(LOSSES),
                 help="with --record: the losses to run")
  p.add_argument("--batch", type=int, default=65536)
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--block-size", type=int, default=1024)
  p.add_argument("--dense-analysis", action="store_true",
                 help="also compile (not run) the dense loss for its memory "
                      "analysis")
  p.add_argument("--no-dense-analysis", action="store_true",
                 help="with --record: skip the dense analysis")
  p.add_argument("--record", action="store_true",
                 help="run every loss under /usr/bin/time -v and write the "
                      "results file")
  p.add_argument("--json", action="store_true", help="print one JSON line")
  args = p.parse_args(argv)
  if args.record:
    _record(args)
    return
  result = measure(args.loss, args.batch, args.dim, args.block_size,
                   args.dense_analysis)
  if args.json:
    print(json.dumps(result))
  else:
    for k, v in result.items():
      print(f"{k}: {v}")


if __name__ == "__main__":
  main()
