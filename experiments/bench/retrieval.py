"""Benchmark: exact retrieval metrics, circle_jax vs faiss-cpu exact search.

Recall@K, R-Precision and MAP@R on random unit vectors of the sizes of the
SOP test split (60,502 x 512, self-retrieval, Ks 1/10/100/1000) and In-Shop
(14,218 queries x 12,612 gallery, Ks 1/10/20/30/40), with class sizes like
those datasets'. Each measurement runs in a fresh subprocess so that its peak
resident memory (``ru_maxrss``) is its own; data generation is not timed.

* ``circle_jax``: :func:`circle_jax.evaluation.retrieval_metrics`, one call,
  compilation included (it is part of what a user waits for), then
  ``--repeats`` identical calls in the same process (what each later
  evaluation of a training run costs); the table gives their median.
* ``faiss exact``: ``faiss.IndexFlatIP`` (brute-force inner product on the
  normalised vectors) searched for the ``k = max(max(Ks), max R)`` (+1 in
  self-retrieval, to drop the query itself) neighbours every metric needs,
  then the same metrics from the neighbour lists in numpy. Queries are
  searched in blocks of 8,192 to bound the result-array memory.

faiss-cpu is optional (``pip install faiss-cpu==1.15.1``, the ``[bench]``
extra); without it only circle_jax is measured, and the table says so.

Like the other CPU benchmarks, the script re-executes itself with glibc's
huge-page malloc (``circle_jax/hostenv.py``; ``--no-hugepages`` keeps the
default). Both methods run under the same setting, which the table records.

Usage:
  python -m experiments.bench.retrieval                      # both datasets
  python -m experiments.bench.retrieval --datasets inshop --scale 0.25
  python -m experiments.bench.retrieval --out experiments/results/bench/retrieval_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import time

import numpy as np

from experiments.bench import timing

# name: (queries, gallery or None for self-retrieval, classes, ks)
DATASETS = {
    "sop": (60502, None, 11316, (1, 10, 100, 1000)),
    "inshop": (14218, 12612, 3985, (1, 10, 20, 30, 40)),
}
_FAISS_QUERY_BLOCK = 8192


def _sizes(rng, total, classes, low, high):
  """Random class sizes in [low, high] summing to ``total``."""
  sizes = rng.integers(low, high + 1, classes)
  while sizes.sum() != total:
    diff = total - sizes.sum()
    room = sizes < high if diff > 0 else sizes > low
    idx = rng.choice(np.flatnonzero(room), min(abs(diff), room.sum()),
                     replace=False)
    sizes[idx] += 1 if diff > 0 else -1
  return sizes


def make_data(name, dim, scale, seed=0):
  """Random unit vectors and labels with the dataset's class structure."""
  num_q, num_g, classes, ks = DATASETS[name]
  num_q, classes = int(num_q * scale), max(2, int(classes * scale))
  rng = np.random.default_rng(seed)

  def unit(n):
    x = rng.standard_normal((n, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)

  if num_g is None:  # SOP: 2..12 images per class (mean 5.3)
    labels = np.repeat(np.arange(classes), _sizes(rng, num_q, classes, 2, 12))
    return unit(num_q), rng.permutation(labels), None, None, ks
  num_g = int(num_g * scale)  # In-Shop: 1..8 queries and gallery per class
  q_lab = np.repeat(np.arange(classes), _sizes(rng, num_q, classes, 1, 8))
  g_lab = np.repeat(np.arange(classes), _sizes(rng, num_g, classes, 1, 8))
  return (unit(num_q), rng.permutation(q_lab), unit(num_g),
          rng.permutation(g_lab), ks)


def _metrics_from_neighbours(nbr, q_lab, g_lab, r, ks, exclude_self):
  """Recall@K, P@1, R-Precision, MAP@R from ``[Q, k]`` neighbour indices."""
  if exclude_self:  # drop the query itself, keep k columns
    own = nbr == np.arange(nbr.shape[0])[:, None]
    keep = ~own
    keep[own.sum(1) == 0, -1] = False  # self not retrieved: drop the last
    nbr = nbr[keep].reshape(nbr.shape[0], -1)
  rel = g_lab[nbr] == q_lab[:, None]
  valid = r > 0
  rel, rv = rel[valid].astype(np.float64), r[valid].astype(np.float64)
  pos = np.arange(1, rel.shape[1] + 1)[None, :]
  rel_r = rel * (pos <= rv[:, None])
  out = {f"recall@{k}": float(np.mean(rel[:, :k].any(1))) for k in ks}
  out["precision@1"] = float(np.mean(rel[:, 0]))
  out["r_precision"] = float(np.mean(rel_r.sum(1) / rv))
  out["map@r"] = float(np.mean((rel_r * np.cumsum(rel_r, 1) / pos).sum(1)
                               / rv))
  return out


def _run_faiss(q, q_lab, g, g_lab, ks):
  import faiss  # pylint: disable=g-import-not-at-top
  self_mode = g is None
  if self_mode:
    g, g_lab = q, q_lab
  counts = np.bincount(g_lab, minlength=max(q_lab.max(), g_lab.max()) + 1)
  r = counts[q_lab] - (1 if self_mode else 0)
  k = max(max(ks), int(r.max())) + (1 if self_mode else 0)
  index = faiss.IndexFlatIP(g.shape[1])
  index.add(g)
  nbrs = []
  for lo in range(0, q.shape[0], _FAISS_QUERY_BLOCK):
    _, idx = index.search(q[lo:lo + _FAISS_QUERY_BLOCK], k)
    nbrs.append(idx.astype(np.int32))
  nbr = np.concatenate(nbrs)
  out = _metrics_from_neighbours(nbr, q_lab, g_lab, r, ks, self_mode)
  out["faiss_threads"] = faiss.omp_get_max_threads()
  out["k_searched"] = k
  return out


def _matmul_floor(q, g, chunk_size, repeats):
  """Median seconds of the bare similarity matmuls in the library's layout.

  The queries in chunks of ``chunk_size`` rows, the gallery in the tiles
  ``retrieval_metrics`` uses, one chained ``[chunk, D] x [D, T]`` float32
  matmul per tile and a row maximum to consume each: the work no exact
  method can skip, as XLA:CPU does it, without any selection or counting.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from circle_jax.evaluation import tiled_ranking  # pylint: disable=g-import-not-at-top
  g = g if g is not None else q
  tile = tiled_ranking._tile_rows(g.shape[0])  # pylint: disable=protected-access
  num_tiles = -(-g.shape[0] // tile)
  tiles = np.zeros((num_tiles * tile, g.shape[1]), np.float32)
  tiles[:g.shape[0]] = g
  tiles = jnp.asarray(tiles.reshape(num_tiles, tile, -1))
  c = min(chunk_size, q.shape[0])
  chunks = [jnp.asarray(np.resize(q[lo:lo + c], (c, q.shape[1])))
            for lo in range(0, q.shape[0], c)]

  @jax.jit
  def step(qc, tiles):
    out, g_t = 0.0, tiles[0]
    for t in range(num_tiles):
      s = jnp.matmul(qc, g_t.T, precision=jax.lax.Precision.HIGHEST)
      out = out + jnp.max(s, axis=1)
      if t + 1 < num_tiles:  # ordered like the library's tile matmuls
        g_t = tiled_ranking._after(tiles[t + 1], s)  # pylint: disable=protected-access
    return out

  jax.block_until_ready(step(chunks[0], tiles))  # compiles
  times = timing.call_times(lambda: [step(x, tiles) for x in chunks], 0,
                            max(1, repeats))
  return float(np.median(times))


def _run_ours(q, q_lab, g, g_lab, ks, chunk_size):
  from circle_jax.evaluation import retrieval_metrics  # pylint: disable=g-import-not-at-top
  return retrieval_metrics(q, q_lab, g, g_lab, ks=ks, chunk_size=chunk_size)


def child(args):
  """One measurement in this (fresh) process; prints a JSON line."""
  if args.method == "ours":
    import jax  # pylint: disable=g-import-not-at-top
    timing.use_compilation_cache(args.compilation_cache)
    jax.devices()  # backend start-up is not part of the measurement
  q, q_lab, g, g_lab, ks = make_data(args.child, args.dim, args.scale)
  rss_data = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  if args.method == "ours":
    run = lambda: _run_ours(q, q_lab, g, g_lab, ks, args.chunk_size)
  else:
    run = lambda: _run_faiss(q, q_lab, g, g_lab, ks)
  t0, c0 = time.perf_counter(), time.process_time()
  res = run()
  wall, cpu = time.perf_counter() - t0, time.process_time() - c0
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  # Later identical calls in the same process: what every later evaluation
  # of a training run costs (circle_jax: already compiled).
  later = []
  for _ in range(args.repeats):
    t1 = time.perf_counter()
    run()
    later.append(time.perf_counter() - t1)
  floor = (_matmul_floor(q, g, args.chunk_size, args.repeats)
           if args.method == "ours" else None)
  print(json.dumps({"matmul_floor_s": floor, "wall_s": wall, "cpu_s": cpu, "peak_rss_mib": peak / 1024,
                    "peak_over_data_mib": (peak - rss_data) / 1024,
                    "later_wall_s": later, "metrics": res}))


def _spawn(name, method, args):
  cmd = timing.child_command(
      "experiments.bench.retrieval", "--child", name,
      "--method", method, "--dim", str(args.dim), "--scale",
      str(args.scale), "--chunk-size", str(args.chunk_size),
      "--repeats", str(args.repeats))
  if args.compilation_cache:
    cmd += ["--compilation-cache", args.compilation_cache]
  load = os.getloadavg()[0]
  out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                       cwd=timing.REPO)
  if out.returncode != 0:
    raise RuntimeError(f"{method} on {name} failed:\n{out.stderr[-3000:]}")
  res = json.loads(out.stdout.strip().splitlines()[-1])
  res["load_before"] = load
  return res


def main():
  p = timing.parser(__doc__, repeats=3, out="write the table here too",
                   compilation_cache=True)
  p.add_argument("--datasets", default="sop,inshop")
  p.add_argument("--dim", type=int, default=512)
  p.add_argument("--scale", type=float, default=1.0,
                 help="fraction of the real sizes (quick runs)")
  p.add_argument("--chunk-size", type=int, default=1024)
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  p.add_argument("--method", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    child(args)
    return

  try:
    import faiss  # pylint: disable=g-import-not-at-top
    have_faiss = f"faiss-cpu {faiss.__version__}"
  except ImportError:
    have_faiss = None
    print("faiss-cpu is not installed: measuring circle_jax only "
          "(pip install faiss-cpu==1.15.1 for the comparison).")

  rows = []
  for name in args.datasets.split(","):
    methods = ["ours", "faiss"] if have_faiss else ["ours"]
    results = {}
    for method in methods:
      print(f"{name}: {method} ...", flush=True)
      results[method] = _spawn(name, method, args)
      print(json.dumps(results[method]), flush=True)
    if have_faiss:  # same metrics from both (random data: no exact ties)
      a, b = results["ours"]["metrics"], results["faiss"]["metrics"]
      diff = max(abs(a[key] - b[key]) for key in b if key in a)
      results["faiss"]["max_metric_diff"] = diff
    rows.append((name, results))

  lines = [
      "# Exact retrieval metrics: circle_jax vs faiss-cpu exact search (CPU)",
      "",
      f"Command: `python -m experiments.bench.retrieval "
      f"--datasets {args.datasets} --dim {args.dim} --scale {args.scale} "
      f"--chunk-size {args.chunk_size} --repeats {args.repeats}"
      + (f" --compilation-cache {args.compilation_cache}"
         if args.compilation_cache else "") + "`",
      "",
      timing.machine_line(),
      "",
      f"{have_faiss or 'faiss-cpu not installed'}. "
      "Random unit vectors, dim "
      f"{args.dim}; each cell is one run in a fresh process; wall time "
      "includes everything after data generation (circle_jax: compilation "
      "too; faiss: index build, search and the metrics in numpy); `later "
      "calls` is the median (min-max) of the same call repeated in the same "
      "process (peak RSS is measured before them). `load` is "
      "the 1-minute load average before the run (the machine is shared).",
      "",
      "| data | method | wall s | CPU s | later calls wall s | peak RSS MiB "
      "| peak over data MiB | load | recall@1 | map@r | notes |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for name, results in rows:
    nq, ng, _, _ = DATASETS[name]
    shape = (f"{int(nq * args.scale)} self" if ng is None else
             f"{int(nq * args.scale)} x {int(ng * args.scale)}")
    for method, r in results.items():
      m = r["metrics"]
      if method == "ours":
        note = ("circle_jax retrieval_metrics; its bare tile matmuls alone: "
                f"{r['matmul_floor_s']:.2f} s")
      else:
        note = (f"IndexFlatIP, k={m['k_searched']}, "
                f"{m['faiss_threads']} threads; max |metric diff| vs "
                f"circle_jax {r['max_metric_diff']:.1e}")
      later = np.asarray(r["later_wall_s"])
      later = (f"{np.median(later):.2f} ({later.min():.2f}-{later.max():.2f})"
               if later.size else "-")
      lines.append(
          f"| {name} ({shape}) | {method} | {r['wall_s']:.2f} | "
          f"{r['cpu_s']:.1f} | {later} | "
          f"{r['peak_rss_mib']:.0f} | "
          f"{r['peak_over_data_mib']:.0f} | {r['load_before']:.1f} | "
          f"{m['recall@1']:.4f} | {m['map@r']:.4f} | {note} |")
  if not have_faiss:
    lines.append("")
    lines.append("faiss-cpu was not installed: no comparison.")
  timing.write_table("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
  timing.run(main)
