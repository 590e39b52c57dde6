r"""Peak memory of the train step vs global batch, with and without GradCache.

The trainer's step (``circle_jax.train.step.make_train_step``, one device) for
ResNet-50 at 224 x 224 px with a 128-d embedding, the Circle loss (dense) and
Adam, compiled (never run) for each global batch and
``config.batch.embed_chunk_size`` (0: off; GradCache otherwise, see
``circle_jax/train/gradcache.py``). BatchNorm is frozen in every row (the
chunked step requires it to be exact; the unchunked step is compiled the same
way so the rows differ only in the chunking). The figure is XLA's memory
analysis of the compiled executable: arguments + outputs + temporaries -
aliased (the donated state), ``experiments.bench.timing.compiled_memory``; the
temporaries are reported separately. A chunk size that does not divide the
batch, or is not smaller than it, is skipped::

  python -m experiments.bench.gradcache_memory \
      --out experiments/results/bench/gradcache_memory_cpu.md

Each compilation runs in the same process; ``--max-compile-s`` stops a chunk
size's column after a compilation slower than that (the rest of that column
is reported as skipped).
"""

from __future__ import annotations

import sys
import time


from experiments.bench import steps
from experiments.bench import timing

_GIB = 2**30


def main():
  p = timing.parser(__doc__, out="results file (markdown)")
  p.add_argument("--batches", default="64,128,256,512,1024,2048,4096")
  p.add_argument("--chunks", default="0,32,128")
  p.add_argument("--model", default="resnet50")
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--max-compile-s", type=float, default=300.0)
  args = p.parse_args()
  rows = measure([int(b) for b in args.batches.split(",")],
                 [int(c) for c in args.chunks.split(",")], args.model,
                 args.image_size, args.max_compile_s)
  command = timing.command_line("experiments.bench.gradcache_memory")
  timing.write_table(report(rows, command, args), args.out)


def batch_spec(batch: int, image_size: int):
  """Abstract ``{'image', 'label'}`` of a global batch."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return {"image": jax.ShapeDtypeStruct((batch, image_size, image_size, 3),
                                        jnp.float32),
          "label": jax.ShapeDtypeStruct((batch,), jnp.int32)}


def measure(batches, chunks, model_name, image_size, max_compile_s):
  """One row per (batch, chunk): peak and temporary bytes, compile seconds."""
  make_step, state = steps.resnet_step(model_name, image_size=image_size)
  rows, stopped = [], set()
  for batch in batches:
    for chunk in chunks:
      row = dict(batch=batch, chunk=chunk)
      if chunk and (batch % chunk or chunk >= batch):
        row["skip"] = f"{chunk} is not a proper divisor of {batch}"
      elif chunk in stopped:
        row["skip"] = f"a smaller batch compiled in over {max_compile_s:.0f} s"
      if "skip" in row:
        rows.append(row)
        continue
      t0 = time.perf_counter()
      compiled = make_step(chunk).lower(
          state, batch_spec(batch, image_size)).compile()
      row["compile_s"] = time.perf_counter() - t0
      row.update(timing.compiled_memory(compiled) or {})
      if row["compile_s"] > max_compile_s:
        stopped.add(chunk)
      print(row, file=sys.stderr, flush=True)
      rows.append(row)
  return rows


def report(rows, command, args) -> str:
  chunks = sorted({r["chunk"] for r in rows})
  head = " | ".join(f"K={c} peak GiB (temp)" if c else "off peak GiB (temp)"
                    for c in chunks)
  lines = [
      "# GradCache: train-step peak memory vs global batch (cpu)",
      "",
      f"- command: `{command}`",
      f"- {timing.machine_line()}",
      f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S')}",
      f"- model: {args.model}, {args.image_size} px, 128-d embedding, frozen "
      "BatchNorm, Circle loss (dense), Adam; one device; compiled, not run",
      "- peak = XLA memory analysis of the compiled step: arguments + outputs "
      "+ temporaries - aliased (donated state); temp = temporaries alone",
      "- K = `config.batch.embed_chunk_size` (images embedded at a time); "
      "off = 0, the whole batch at once",
      "",
      f"| global batch | {head} | compile s |",
      "|---|" + "---|" * len(chunks) + "---|",
  ]
  for batch in sorted({r["batch"] for r in rows}):
    cells, comp = [], []
    for c in chunks:
      r = next(r for r in rows if r["batch"] == batch and r["chunk"] == c)
      if "skip" in r:
        cells.append(f"skipped ({r['skip']})")
      else:
        cells.append(f"{r['peak'] / _GIB:.2f} ({r['temp'] / _GIB:.2f})")
        comp.append(f"{r['compile_s']:.0f}")
    lines.append(f"| {batch} | " + " | ".join(cells) + f" | {'/'.join(comp)} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  timing.run(main)
