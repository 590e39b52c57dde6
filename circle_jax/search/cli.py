"""``python -m circle_jax.search build|add|remove|query|calibrate|match|info``.

  build      embed an image folder with a run -> a new index file
  add        embed more images into an index; remove: drop items by id
  query      the top-k gallery items of query images or embeddings (a table
             query/rank/id/label/score; --grid FILE.png draws them)
  calibrate  thresholds from labelled queries, saved in the index
  match      the nearest label past a cut-point, else "unknown"
  info       what an index holds and which model made it

Like the training job: a progress bar on long work (on a terminal's
stderr), errors you can fix in one line (``--verbose``: library logs and
tracebacks). The index file is replaced atomically: an interrupted command
(Ctrl-C, SIGTERM, a crash) leaves the previous index as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import List, Optional, Sequence

import numpy as np

from circle_jax.errors import UserError
from circle_jax.search import backends
from circle_jax.search import calibrate as calib
from circle_jax.search import index as index_lib

PROG = "python -m circle_jax.search"


class Terminated(KeyboardInterrupt):
  """SIGTERM: stop like Ctrl-C (temporary files removed), status 143."""

  exit_status = 128 + signal.SIGTERM


def _on_sigterm(signum, frame):  # pylint: disable=unused-argument
  raise Terminated()


class Progress:
  """A tqdm bar on a terminal's stderr (nothing otherwise)."""

  def __init__(self, description: str):
    from circle_jax.train import console  # pylint: disable=g-import-not-at-top
    self.bar, self.description = None, description
    self.enabled = console.is_bar_terminal(sys.stderr)

  def __call__(self, done: int, total: int) -> None:
    if not self.enabled:
      return
    if self.bar is None:
      import tqdm  # pylint: disable=g-import-not-at-top
      self.bar = tqdm.tqdm(total=total, desc=self.description,
                           file=sys.stderr, leave=False)
    self.bar.update(done - self.bar.n)

  def close(self):
    if self.bar is not None:
      self.bar.close()


# --------------------------------------------------------------------------
# Queries: images (embedded with the index's run) or an embeddings file.
# --------------------------------------------------------------------------


def _read_embeddings(path: str):
  """``(names, embeddings, record or None)`` of a ``.npz`` written by
  ``python -m circle_jax.embed`` (or any with an ``embeddings`` array)."""
  try:
    with np.load(path, allow_pickle=False) as z:
      emb = np.asarray(z["embeddings"])
      names = ([str(p) for p in z["paths"]] if "paths" in z.files
               else [str(i) for i in range(len(emb))])
      record = (index_lib.ModelRecord.from_dict(json.loads(str(z["model"])))
                if "model" in z.files else None)
  except (OSError, ValueError, KeyError, EOFError) as e:
    raise UserError(f"--embeddings: {path} is not a readable .npz with an "
                    f"`embeddings` array ({e}).") from e
  return names, emb, record


def _queries(args, index: index_lib.GalleryIndex, labels_source=None):
  """``(names, embeddings, record, folder, labels or None)``."""
  if args.embeddings:
    names, emb, record = _read_embeddings(args.embeddings)
    return names, emb, record, None, None
  if not args.images:
    raise UserError("pass --images FOLDER_OR_FILE or --embeddings FILE.npz.")
  from circle_jax.search import build  # pylint: disable=g-import-not-at-top
  run, record = build.restore(index.model.run, index.model.checkpoint)
  index.check_model(record, record.embedding_dim,
                    f"the run at {index.model.run} now")
  progress = Progress("embedding queries")
  try:
    names, emb, _ = build.embed_images(run, args.images,
                                       batch_size=args.batch_size,
                                       on_batch=progress)
  finally:
    progress.close()
  folder = (os.path.dirname(args.images) if os.path.isfile(args.images)
            else args.images)
  labels = None
  if labels_source is not None:
    source = labels_source
    if source == build.FOLDERS and not any("/" in n for n in names):
      source = None
    labels = build.read_labels(folder, names, source)
  return names, emb, record, folder, labels


def _table(rows: List[Sequence], header: Sequence[str]) -> str:
  rows = [[str(c) for c in r] for r in rows]
  widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
            for i, h in enumerate(header)]
  fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
  return "\n".join([fmt(header)] + [fmt(r) for r in rows])


def _same_label(a, b) -> Optional[bool]:
  if a is None or b is None:
    return None
  return str(a) == str(b)


# --------------------------------------------------------------------------
# Sub-commands.
# --------------------------------------------------------------------------


def cmd_build(args) -> None:
  from circle_jax.search import build  # pylint: disable=g-import-not-at-top
  labels = None if args.labels == "none" else args.labels
  if args.embeddings:
    names, emb, record = _read_embeddings(args.embeddings)
    lab = (build.read_labels(os.path.dirname(args.embeddings), names, labels)
           if labels and labels != build.FOLDERS else None)
    index = index_lib.GalleryIndex.from_arrays(
        emb, ids=names, labels=lab,
        metadata=[{"path": n} for n in names], model=record)
  else:
    if not (args.workdir and args.images):
      raise UserError("build needs --workdir RUN and --images FOLDER (or "
                      "--embeddings FILE.npz).")
    progress = Progress("embedding gallery")
    try:
      index = build.build_from_folder(
          args.workdir, args.images, labels=labels, which=args.checkpoint,
          batch_size=args.batch_size, on_batch=progress)
    finally:
      progress.close()
    for p, r in getattr(index, "skipped", []):
      print(f"skipped {p}: {r}", file=sys.stderr)
  index.save(args.index)
  print(f"{len(index)} items of dimension {index.dim} "
        f"({'labelled' if index.labels is not None else 'no labels'}) from "
        f"{index.model.describe()} -> {args.index}")


def cmd_add(args) -> None:
  from circle_jax.search import build  # pylint: disable=g-import-not-at-top
  index = index_lib.load(args.index)
  progress = Progress("embedding")
  try:
    other = build.build_from_folder(
        index.model.run, args.images,
        labels=None if index.labels is None else (args.labels
                                                  or build.FOLDERS),
        which=index.model.checkpoint, batch_size=args.batch_size,
        on_batch=progress)
  finally:
    progress.close()
  index.check_model(other.model, other.dim, "the new images' embeddings")
  ids = [os.path.join(args.prefix, i) if args.prefix else i
         for i in other.ids]
  index.add(other.embeddings, ids=ids, labels=other.labels,
            metadata=other.metadata)
  index.save(args.index)
  print(f"added {len(other)} items; {len(index)} in {args.index}")


def cmd_remove(args) -> None:
  index = index_lib.load(args.index)
  n = index.remove(args.ids)
  index.save(args.index)
  print(f"removed {n} items; {len(index)} in {args.index}")


def _search(args, index, names, emb, record, k):
  searcher = backends.Searcher(index, args.backend)
  progress = Progress("searching")
  try:
    return searcher.search(emb, k, model=record,
                           on_chunk=lambda n: progress(n, len(names)))
  finally:
    progress.close()


def cmd_query(args) -> None:
  index = index_lib.load(args.index)
  names, emb, record, folder, qlab = _queries(
      args, index, labels_source=args.labels)
  nb = _search(args, index, names, emb, record, args.k)
  rows = []
  for qi, name in enumerate(names):
    for r in range(nb.positions.shape[1]):
      if nb.positions[qi, r] < 0:
        continue
      lab = nb.labels[qi][r] if nb.labels is not None else ""
      rows.append([name, r + 1, nb.ids[qi][r], lab,
                   f"{nb.scores[qi, r]:.4f}"])
  print(_table(rows, ["query", "rank", "id", "label", "score"]))
  if args.grid:
    _grid(args.grid, index, names, folder, nb, qlab)
    print(f"grid -> {args.grid}", file=sys.stderr)


def _grid(path, index, names, folder, nb, qlab) -> None:
  from circle_jax.evaluation import retrieval_figure as fig  # pylint: disable=g-import-not-at-top
  if folder is None:
    raise UserError("--grid draws images: pass the queries as --images.")

  def image(p):
    src = index.metadata[p].get("path") if p >= 0 else None
    if not src:
      return None
    with open(src, "rb") as f:
      return f.read()

  queries = []
  for n in names:
    with open(os.path.join(folder, n), "rb") as f:
      queries.append(f.read())
  neighbours = [[image(p) for p in row] for row in nb.positions]
  correct = None
  if qlab is not None and nb.labels is not None:
    correct = [[_same_label(q, g) for g in row]
               for q, row in zip(qlab, nb.labels)]
  fig.draw_retrievals(path, queries, neighbours, scores=nb.scores,
                      correct=correct,
                      titles=[os.path.basename(n)[:12] for n in names])


def cmd_calibrate(args) -> None:
  index = index_lib.load(args.index)
  if index.labels is None:
    raise UserError(f"{args.index} has no labels; calibration compares the "
                    "nearest item's label with the query's.")
  names, emb, record, _, qlab = _queries(args, index,
                                         labels_source=args.labels)
  if qlab is None:
    raise UserError("calibrate needs labelled queries: --images FOLDER with "
                    "one sub-folder per label, or --labels FILE.csv.")
  nb = _search(args, index, names, emb, record, 1)
  correct = np.asarray([_same_label(q, row[0]) for q, row in
                        zip(qlab, nb.labels)], bool)
  curve = calib.calibration_curve(nb.scores[:, 0], correct)
  cuts = calib.cutpoints(curve, target_precisions=args.target_precision,
                         target_recalls=args.target_recall or ())
  consistency = calib.opis(emb, qlab.astype(str), index.embeddings,
                           index.labels.astype(str))
  index.cutpoints = cuts
  index.calibration = {"num_queries": len(names),
                       "nearest_correct": int(correct.sum()),
                       "source": os.path.abspath(args.images or
                                                 args.embeddings),
                       **consistency}
  index.save(args.index)
  rows = [[n, f"{c['threshold']:.4f}", f"{c['precision']:.4f}",
           f"{c['recall']:.4f}", f"{c['f1']:.4f}", f"{c['accuracy']:.4f}"]
          for n, c in cuts.items()]
  print(_table(rows, ["cut-point", "threshold", "precision", "recall", "f1",
                      "accuracy"]))
  print(f"OPIS (per-class F1 consistency, lower is better): "
        f"{consistency['opis']:.5f} over {consistency['num_classes']} "
        f"classes; {len(names)} queries, nearest label right for "
        f"{int(correct.sum())}. Saved in {args.index}.")


def cmd_match(args) -> None:
  index = index_lib.load(args.index)
  if index.labels is None:
    raise UserError(f"{args.index} has no labels to match.")
  threshold = (args.threshold if args.threshold is not None else
               calib.cutpoint(index.cutpoints, args.cutpoint)["threshold"])
  names, emb, record, _, _ = _queries(args, index)
  nb = _search(args, index, names, emb, record, 1)
  answers = calib.match(nb.scores[:, 0], [row[0] for row in nb.labels],
                        threshold)
  rows = [[n, a, nb.ids[i][0], f"{nb.scores[i, 0]:.4f}"]
          for i, (n, a) in enumerate(zip(names, answers))]
  print(_table(rows, ["query", "match", "nearest", "score"]))
  print(f"threshold {threshold:.4f}", file=sys.stderr)


def cmd_info(args) -> None:
  index = index_lib.load(args.index)
  m = index.model
  lines = [f"{args.index}: {len(index)} items, {index.dim}-d, "
           f"{m.geometry} similarity of {m.normalization}-normalised "
           "embeddings",
           f"model: run {m.run}, {m.checkpoint or '?'} checkpoint, step "
           f"{m.step if m.step is not None else '?'}, trained on "
           f"{m.train_geometry or '?'} geometry, weights sha256 "
           f"{(m.fingerprint or '?')[:16]}"]
  if index.labels is not None:
    lines.append(f"labels: {len(np.unique(index.labels))} distinct")
  for name, c in index.cutpoints.items():
    lines.append(f"cut-point {name}: threshold {c['threshold']:.4f} "
                 f"(precision {c['precision']:.4f}, recall "
                 f"{c['recall']:.4f}, f1 {c['f1']:.4f})")
  if index.calibration:
    lines.append(f"OPIS {index.calibration.get('opis', float('nan')):.5f} "
                 f"from {index.calibration.get('num_queries')} queries")
  print("\n".join(lines))


# --------------------------------------------------------------------------
# The parser.
# --------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="command", required=True)

  def command(name, fn, help_):
    c = sub.add_parser(name, help=help_)
    c.set_defaults(fn=fn)
    c.add_argument("--index", required=True, help="The index file (.npz).")
    c.add_argument("--verbose", action="store_true",
                   help="Library logs and full tracebacks.")
    c.add_argument("--batch_size", "--batch-size", type=int, default=64,
                   dest="batch_size", help="Images per forward pass.")
    return c

  def queries(c, labels_default=None):
    c.add_argument("--images", help="Query image folder or file.")
    c.add_argument("--embeddings", help="Query embeddings (.npz of "
                   "`python -m circle_jax.embed`).")
    c.add_argument("--labels", default=labels_default,
                   help="Query labels: `folders` (sub-folder names) or a "
                   "CSV of path,label.")
    c.add_argument("--backend", default="exact", choices=backends.BACKENDS)

  c = command("build", cmd_build, "Index an image folder with a run.")
  c.add_argument("--workdir", help="The trained run.")
  c.add_argument("--images", help="The gallery's image folder.")
  c.add_argument("--embeddings", help="Or: a .npz of embeddings.")
  c.add_argument("--labels", default="folders", help="`folders` (default: "
                 "sub-folder names), a CSV of path,label, or `none`.")
  c.add_argument("--checkpoint", choices=("best", "latest"), default=None)
  c = command("add", cmd_add, "Embed more images into an index.")
  c.add_argument("--images", required=True)
  c.add_argument("--labels", default=None)
  c.add_argument("--prefix", default="", help="Prefix of the new ids.")
  c = command("remove", cmd_remove, "Remove items by id.")
  c.add_argument("--ids", nargs="+", required=True)
  c = command("query", cmd_query, "The top-k items of each query.")
  queries(c, labels_default="folders")
  c.add_argument("--k", type=int, default=5)
  c.add_argument("--grid", help="Draw the queries and their retrievals to "
                 "this PNG.")
  c = command("calibrate", cmd_calibrate,
              "Thresholds from labelled queries, saved in the index.")
  queries(c, labels_default="folders")
  c.add_argument("--target_precision", "--target-precision", type=float,
                 nargs="*", default=[0.99], dest="target_precision")
  c.add_argument("--target_recall", "--target-recall", type=float,
                 nargs="*", default=[], dest="target_recall")
  c = command("match", cmd_match, "Nearest label past a cut-point.")
  queries(c)
  c.add_argument("--cutpoint", default=None,
                 help=f"A saved cut-point (default {calib.BEST_F1}).")
  c.add_argument("--threshold", type=float, default=None,
                 help="A similarity threshold instead of a cut-point.")
  command("info", cmd_info, "What an index holds.")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parser().parse_args(argv)
  from circle_jax import hostenv  # pylint: disable=g-import-not-at-top
  from circle_jax.train import console  # pylint: disable=g-import-not-at-top
  console.configure_logging(args.verbose)
  hostenv.enable_compilation_cache()
  previous = signal.signal(signal.SIGTERM, _on_sigterm)
  try:
    return console.run_tool(
        lambda: args.fn(args), verbose=args.verbose,
        on_interrupt=lambda e: (
            f"{'Terminated' if isinstance(e, Terminated) else 'Interrupted'}"
            f": {args.index} was not changed."))
  finally:
    signal.signal(signal.SIGTERM, previous)
