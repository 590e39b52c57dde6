r"""Peak memory of the train step vs global batch, with and without GradCache.

The trainer's step (``circle_jax.train.step.make_train_step``, one device) for
ResNet-50 at 224 x 224 px with a 128-d embedding, the Circle loss (dense) and
Adam, compiled (never run) for each global batch and
``config.batch.embed_chunk_size`` (0: off; GradCache otherwise, see
``circle_jax/train/gradcache.py``). BatchNorm is frozen in every row (the
chunked step requires it to be exact; the unchunked step is compiled the same
way so the rows differ only in the chunking). The figure is XLA's memory
analysis of the compiled executable: arguments + outputs + temporaries -
aliased (the donated state), ``experiments.timing.compiled_memory``; the
temporaries are reported separately. A chunk size that does not divide the
batch, or is not smaller than it, is skipped::

  python experiments/bench_gradcache_memory.py \
      --out experiments/results/gradcache_memory_cpu.md

Each compilation runs in the same process; ``--max-compile-s`` stops a chunk
size's column after a compilation slower than that (the rest of that column
is reported as skipped).
"""

from __future__ import annotations

import pathlib
import sys
import time

if __package__ in (None, ""):  # run as a file: python experiments/X.py
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from experiments import timing  # noqa: E402  pylint: disable=g-import-not-at-top

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
  command = " ".join(["python", "experiments/bench_gradcache_memory.py"]
                     + sys.argv[1:])
  timing.write_table(report(rows, command, args), args.out)


def resnet_step(model_name: str = "resnet50", *, dtype: str = "float32",
                image_size: int = 224, freeze_bn: bool = True,
                concrete: bool = False):
  """``(make_step(chunk) -> jitted step, state)``: the trainer's one-device
  step of ``model_name`` (128-d embedding, Circle loss, Adam). The state is
  abstract (shapes only) unless ``concrete``."""
  import jax  # pylint: disable=import-outside-toplevel

  from circle_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from circle_jax import losses as losses_lib  # pylint: disable=import-outside-toplevel
  from circle_jax import parallel  # pylint: disable=import-outside-toplevel
  from circle_jax import config_facts  # pylint: disable=import-outside-toplevel
  from circle_jax.train import run as run_lib  # pylint: disable=import-outside-toplevel
  from circle_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel

  config = config_lib.base_config()
  config.model.name = model_name
  config.model.embedding_dim = 128
  config.model.freeze_bn = freeze_bn
  config.model.dtype = dtype
  config.parallelism = "none"
  model = run_lib.build_model(config)
  init = lambda: run_lib.init_state(  # noqa: E731
      config, model, None, (image_size, image_size, 3))[0]
  state = init() if concrete else jax.eval_shape(init)
  loss_fn = step_lib.make_loss_fn(losses_lib.get_loss(config.loss.name),
                                  config_facts.loss_hyper(config))
  key = jax.random.PRNGKey(0)

  def make_step(chunk: int = 0):
    return step_lib.make_train_step(loss_fn, base_key=key,
                                    placement=parallel.from_config(config),
                                    embed_chunk_size=chunk)
  return make_step, state


def batch_spec(batch: int, image_size: int):
  """Abstract ``{'image', 'label'}`` of a global batch."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return {"image": jax.ShapeDtypeStruct((batch, image_size, image_size, 3),
                                        jnp.float32),
          "label": jax.ShapeDtypeStruct((batch,), jnp.int32)}


def measure(batches, chunks, model_name, image_size, max_compile_s):
  """One row per (batch, chunk): peak and temporary bytes, compile seconds."""
  make_step, state = resnet_step(model_name, image_size=image_size)
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
