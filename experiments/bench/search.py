"""Benchmark: gallery search, circle_jax exact vs faiss (Flat, HNSW).

A gallery of unit vectors around random class centres (default 1,000,000 x
128), queries drawn alike (default 10,000), top-10, all on the CPU with the same threads:

* ``circle_jax exact``: :class:`circle_jax.search.Searcher` (the retrieval
  evaluation's device program), timed after one warm-up search of the same
  shapes (compilation reported apart);
* ``faiss IndexFlatIP``: exact, the reference for speed and neighbours;
* ``faiss HNSW``: ``IndexHNSWFlat`` (M links), built once, searched with
  rising ``efSearch`` until recall@10 against exact search reaches the
  target (0.95): its queries per second and build time;
* the index file (:meth:`GalleryIndex.save`): size on disk, save and load
  time.

Usage (writes the Markdown results file; every figure with this command):
  python -m experiments.bench.search --out experiments/results/bench/search_cpu.md
  python -m experiments.bench.search --gallery 100000 --queries 1000   # small
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time

import numpy as np

from circle_jax import search
from circle_jax.search import backends


def _unit(x):
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def _clustered(rng, centres, n, noise):
  """``n`` unit vectors around random ``centres`` (like the embeddings of
  a trained model: classes, not uniform noise, on which no approximate
  search can do well)."""
  pick = rng.integers(0, centres.shape[0], n)
  x = centres[pick] + noise * rng.standard_normal(
      (n, centres.shape[1]), dtype=np.float32)
  return _unit(x).astype(np.float32)


def _timed(fn, what=None):
  t = time.perf_counter()
  out = fn()
  t = time.perf_counter() - t
  if what:  # progress in the log, in case the run is stopped
    print(f"[bench] {what}: {t:.2f} s", file=sys.stderr, flush=True)
  return out, t


def run(args) -> str:
  import faiss  # the [faiss] extra
  rng = np.random.default_rng(args.seed)
  if args.clusters:
    centres = _unit(rng.standard_normal((args.clusters, args.dim),
                                        dtype=np.float32))
    g = _clustered(rng, centres, args.gallery, args.noise)
    q = _clustered(rng, centres, args.queries, args.noise)
  else:  # uniformly random directions
    g = _unit(rng.standard_normal((args.gallery, args.dim), dtype=np.float32))
    q = _unit(rng.standard_normal((args.queries, args.dim), dtype=np.float32))
  threads = faiss.omp_get_max_threads()
  index = search.GalleryIndex.from_arrays(g)
  lines = []

  searcher, t_shard = _timed(lambda: search.Searcher(index, "exact"),
                             "exact: gallery on the devices")
  _, t_first = _timed(lambda: searcher.search(q[:args.chunk], args.k),
                      "exact: first search (compilation included)")
  exact, t_exact = _timed(lambda: searcher.search(q, args.k), "exact")

  if args.no_flat:
    flat_idx, t_flat = exact.positions, float("nan")
  else:
    flat = backends.build_faiss(index.embeddings, "faiss-flat")
    (_, flat_idx), t_flat = _timed(lambda: flat.search(q, args.k),
                                   "faiss Flat")
    flat = None  # frees its copy of the gallery
  agree = float(np.mean(flat_idx == exact.positions))

  # HNSW on the whole gallery, or on its first --hnsw_gallery items (then
  # its recall is against exact search over those items).
  n_hnsw = min(args.hnsw_gallery or args.gallery, args.gallery)
  if n_hnsw < args.gallery and not args.no_hnsw:
    sub = search.GalleryIndex.from_arrays(g[:n_hnsw])
    truth = search.Searcher(sub, "exact").search(q, args.k).positions
    hnsw_data = sub.embeddings
  else:
    truth, hnsw_data = exact.positions, index.embeddings

  opts = backends.FaissOptions(hnsw_m=args.hnsw_m,
                               ef_construction=args.ef_construction)
  hnsw_rows, t_hnsw_build = [], float("nan")
  if args.no_hnsw:
    args.ef_search = []
  else:
    hnsw, t_hnsw_build = _timed(
        lambda: backends.build_faiss(hnsw_data, "faiss-hnsw", opts),
        "faiss HNSW build")
  for ef in args.ef_search:
    hnsw.hnsw.efSearch = ef
    (_, idx), t = _timed(lambda: hnsw.search(q, args.k),
                         f"faiss HNSW efSearch {ef}")
    rec = backends.recall_at_k(idx, truth)
    hnsw_rows.append((ef, rec, args.queries / t))
    if rec >= args.target_recall:
      break

  with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
    path = os.path.join(tmp, "index.npz")
    _, t_save = _timed(lambda: index.save(path), "index save")
    size = os.path.getsize(path)
    _, t_load = _timed(lambda: search.load(path), "index load")

  cmd = "python -m experiments.bench.search " + shlex.join(args.argv)
  load = os.getloadavg()
  lines += [
      "# Gallery search on the CPU: circle_jax exact vs faiss",
      "",
      f"Gallery {args.gallery:,} x {args.dim} unit vectors "
      + (f"around {args.clusters:,} random centres (Gaussian noise "
         f"{args.noise} per coordinate before normalising), "
         if args.clusters else "in uniformly random directions, ") +
      f"{args.queries:,} queries, top-{args.k}; {threads} CPU threads for "
      f"both (faiss.omp_get_max_threads; XLA uses the same cores). "
      f"Load average before/after the run: {args.load_before} / "
      f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (a shared 2-core "
      "machine: other sessions ran beside it).",
      "",
      f"Every figure below: `{cmd}`",
      "",
      "| search | time (s) | queries/s | vs faiss Flat |",
      "| --- | --- | --- | --- |",
      ("| faiss IndexFlatIP (exact) | not run (--no_flat) | | |"
       if args.no_flat else
       f"| faiss IndexFlatIP (exact) | {t_flat:.2f} | "
       f"{args.queries / t_flat:,.0f} | 1.00x |"),
      f"| circle_jax exact (`Searcher(index, 'exact')`) | {t_exact:.2f} | "
      f"{args.queries / t_exact:,.0f} | "
      + ("" if args.no_flat else f"{t_exact / t_flat:.2f}x") + " |",
      "",
      f"circle_jax exact: laying the gallery out on the devices "
      f"{t_shard:.2f} s, first search of {min(args.chunk, args.queries):,} "
      f"queries (compilation included) {t_first:.2f} s."
      + ("" if args.no_flat else
         f" Its neighbours equal faiss Flat's in {agree:.4%} of the "
         f"{args.queries * args.k:,} slots (the rest are float32 rounding "
         "ties)."),
      "",
      ("faiss HNSW: not run (--no_hnsw)." if args.no_hnsw else
       f"faiss HNSW (`IndexHNSWFlat`, M={args.hnsw_m}, efConstruction="
       f"{args.ef_construction}) "
       + (f"on the first {n_hnsw:,} gallery items only (`--hnsw_gallery`; "
          "its recall is against exact search over those items, with the "
          "same queries)" if n_hnsw < args.gallery else
          "on the whole gallery") +
       f": build {t_hnsw_build:.1f} s."),
  ] + ([
      "",
      "| efSearch | recall@10 vs exact | queries/s |",
      "| --- | --- | --- |",
  ] if hnsw_rows else []) + [
      f"| {ef} | {rec:.4f} | {qps:,.0f} |" for ef, rec, qps in hnsw_rows] + [
      "",
      f"Index file (`GalleryIndex.save`, .npz, {args.gallery:,} items with "
      f"ids): {size / 2**20:,.1f} MiB on disk; save {t_save:.2f} s, load "
      f"{t_load:.2f} s.",
      "",
  ]
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--gallery", type=int, default=1_000_000)
  p.add_argument("--queries", type=int, default=10_000)
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--k", type=int, default=10)
  p.add_argument("--chunk", type=int, default=1024)
  p.add_argument("--hnsw_m", type=int, default=32)
  p.add_argument("--ef_construction", type=int, default=80)
  p.add_argument("--ef_search", type=int, nargs="+",
                 default=[16, 32, 64, 128, 256, 512])
  p.add_argument("--target_recall", type=float, default=0.95)
  p.add_argument("--hnsw_gallery", type=int, default=0,
                 help="Build HNSW on the first N gallery items only (0: "
                 "all), where its build would not finish in time.")
  p.add_argument("--no_flat", action="store_true",
                 help="Skip faiss IndexFlatIP (for an HNSW-only run).")
  p.add_argument("--no_hnsw", action="store_true",
                 help="Skip faiss HNSW (its build is the longest part).")
  p.add_argument("--clusters", type=int, default=10_000,
                 help="Class centres of the data (0: uniformly random).")
  p.add_argument("--noise", type=float, default=0.1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--tmp", default=None, help="Folder of the index file.")
  p.add_argument("--out", default=None, help="Markdown results file.")
  args = p.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  load = os.getloadavg()
  args.load_before = f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
  text = run(args)
  print(text)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
