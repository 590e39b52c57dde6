r"""Train-step time and compiled memory, bfloat16 vs float32 backbones.

The trainer's one-device step (``circle_jax.train.step``) for ResNet-50 and
BN-Inception at 224 x 224 px, 128-d embedding, Circle loss, Adam, BatchNorm in
training mode, with ``config.model.dtype`` float32 and bfloat16 (the
backbone's compute dtype; parameters, BatchNorm statistics, the head, the
embeddings and the loss stay float32). For each: XLA's memory analysis of the
compiled step (arguments + outputs + temporaries - aliased, and the
temporaries alone; ``experiments.bench.timing.compiled_memory``), the compile
time, and the median of ``--repeats`` timed steps after ``--warmup`` untimed
ones on random images::

  python -m experiments.bench.bf16 --out experiments/results/bench/bf16_cpu.md

(batch 8 by default: on the shared 2-core CPU of the recorded run one
float32 ResNet-50 step at batch 16 took about 100 s.)

CPU bfloat16 timings are not representative of GPUs or TPUs: most CPUs have
no bfloat16 arithmetic, so XLA:CPU converts to float32 and back around each
operation, while GPU tensor cores and TPU MXUs run bfloat16 natively at
several times the float32 rate. The memory figures are XLA:CPU's as well:
the recorded run shows almost no saving, consistent with XLA:CPU computing
(and keeping) most bfloat16 intermediates in float32; they do not say what
a GPU or TPU would use.
"""

from __future__ import annotations

import sys
import time


from experiments.bench import steps
from experiments.bench import timing

_GIB = 2**30


def measure(model_name: str, dtype: str, batch: int, image_size: int,
            warmup: int, repeats: int) -> dict:
  """Compiles and times the step of one model and dtype."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  make_step, state = steps.resnet_step(
      model_name, dtype=dtype, image_size=image_size, freeze_bn=False,
      concrete=True)
  rng = np.random.default_rng(0)
  data = {"image": rng.normal(size=(batch, image_size, image_size, 3)
                              ).astype(np.float32),
          "label": (np.arange(batch) % max(batch // 4, 1)).astype(np.int32)}
  step = make_step(0)
  t0 = time.perf_counter()
  compiled = step.lower(state, data).compile()
  row = dict(model=model_name, dtype=dtype, batch=batch,
             compile_s=time.perf_counter() - t0,
             **(timing.compiled_memory(compiled) or {}))
  holder = {"state": state}

  def one_step():
    holder["state"], holder["metrics"] = compiled(holder["state"], data)
    return holder["metrics"]

  times = timing.call_times(one_step, warmup, repeats)
  metrics = jax.device_get(holder["metrics"])
  row.update(step_s=float(np.median(times)), times=times,
             loss=float(metrics["loss"]), finite=bool(metrics["finite"]))
  print(row, file=sys.stderr, flush=True)
  return row


def report(rows, command, args) -> str:
  lines = [
      "# bfloat16 vs float32: train-step time and compiled memory (cpu)",
      "",
      f"- command: `{command}`",
      f"- {timing.machine_line()}",
      f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S')}",
      f"- batch {args.batch} at {args.image_size} px, 128-d embedding, Circle "
      "loss, Adam, BatchNorm in training mode, one device; step s = median of "
      f"{args.repeats} timed steps after {args.warmup} untimed",
      "- loss: Circle (gamma 256) after the warm-up and timed steps, all on "
      "the same random images (2 classes); it shows the steps are finite, "
      "not how bfloat16 trains (tests/train/test_bf16.py does that)",
      "- peak = XLA memory analysis of the compiled step: arguments + outputs "
      "+ temporaries - aliased (donated state); temp = temporaries alone",
      "- **CPU bfloat16 timings are not representative of GPU/TPU**: XLA:CPU "
      "has no native bfloat16 arithmetic on this CPU and converts around "
      "each operation; GPUs and TPUs run bfloat16 natively. The memory "
      "figures are XLA:CPU's too (it keeps most bfloat16 intermediates in "
      "float32), not a GPU/TPU's.",
      "",
      "| model | dtype | peak GiB | temp GiB | step s | compile s | loss "
      "(last timed step) | finite |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
        f"| {r['model']} | {r['dtype']} | {r['peak'] / _GIB:.2f} | "
        f"{r['temp'] / _GIB:.2f} | {r['step_s']:.2f} | {r['compile_s']:.0f} "
        f"| {r['loss']:.3g} | {r['finite']} |")
  return "\n".join(lines) + "\n"


def main():
  p = timing.parser(__doc__, repeats=2, out="results file (markdown)")
  p.add_argument("--models", default="resnet50,bn_inception")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--warmup", type=int, default=1)
  args = p.parse_args()
  rows = [measure(m, d, args.batch, args.image_size, args.warmup,
                  args.repeats)
          for m in args.models.split(",") for d in ("float32", "bfloat16")]
  command = timing.command_line("experiments.bench.bf16")
  timing.write_table(report(rows, command, args), args.out)


if __name__ == "__main__":
  timing.run(main)
