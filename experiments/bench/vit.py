r"""ViT-S/16 train step: circle_jax (XLA:CPU) against timm (PyTorch), and remat memory.

1. Time: one training step (forward, Circle loss, backward, AdamW update) of
   ViT-S/16 at 224 x 224 px with a 128-d embedding head, batch ``--batch``
   (32), float32: the trainer's own step (``circle_jax.train.step``, model
   ``vit_s16``) against timm's ``vit_small_patch16_224`` + ``Linear(384,
   128)`` + L2 normalisation + the same Circle loss (a direct PyTorch
   transcription, gamma 80, m 0.25 as the config's) + ``torch.optim.AdamW``.
   The two alternate, ``--rounds`` rounds of ``--repeats`` steps each, in one
   process, with the same number of threads (``--threads``, default: all
   cores), so a load change on a shared machine hits both; the table gives
   each round's medians and the ratio of the medians over all rounds.
2. Memory: XLA's memory analysis of the compiled step (compile only, nothing
   runs) with and without ``remat`` (``model.kwargs.remat``), batches
   ``--memory-batches`` (32 ... 256).

::

  python -m experiments.bench.vit --out experiments/results/bench/vit_cpu.md

Needs torch and timm (requirements-test.txt) for part 1; ``--skip-torch``
runs part 2 only.
"""

from __future__ import annotations

import os
import statistics
import sys
import time


from experiments.bench import timing

_MIB = 2**20


def jax_step(batch: int, image_size: int = 224, *, remat: bool = False,
             concrete: bool = True):
  """``(jitted step, state, data)`` of the trainer's one-device step."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from circle_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from circle_jax import losses as losses_lib  # pylint: disable=import-outside-toplevel
  from circle_jax import config_facts  # pylint: disable=import-outside-toplevel
  from circle_jax.train import run as run_lib  # pylint: disable=import-outside-toplevel
  from circle_jax.train import step as step_lib  # pylint: disable=import-outside-toplevel

  c = config_lib.base_config()
  c.model.name = "vit_s16"
  c.model.embedding_dim = 128
  c.model.kwargs.image_size = image_size
  c.model.kwargs.remat = remat
  c.loss = config_lib.loss_config("circle", gamma=80.0, margin=0.25)
  c.optim.name = "adamw"
  c.optim.learning_rate = 1e-4
  c.optim.weight_decay = 0.05
  c.parallelism = "none"
  model = run_lib.build_model(c)
  init = lambda: run_lib.init_state(  # noqa: E731
      c, model, None, (image_size, image_size, 3))[0]
  state = init() if concrete else jax.eval_shape(init)
  loss_fn = step_lib.make_loss_fn(losses_lib.get_loss("circle"),
                                  config_facts.loss_hyper(c))
  step = step_lib.make_train_step(loss_fn, base_key=jax.random.PRNGKey(0),
                                  placement="none", donate=concrete)
  rng = np.random.default_rng(0)
  data = {"image": rng.normal(size=(batch, image_size, image_size, 3)
                              ).astype(np.float32),
          "label": (np.arange(batch) % (batch // 4)).astype(np.int32)}
  return step, state, data


def torch_step(batch: int, image_size: int = 224):
  """A closure running one timm ViT-S/16 step with the same loss/optimiser."""
  from tests.models.timm_reference import import_timm  # pylint: disable=import-outside-toplevel
  timm, torch = import_timm()
  body = timm.create_model("vit_small_patch16_224", pretrained=False,
                           num_classes=0)
  model = torch.nn.Sequential(body, torch.nn.Linear(384, 128))
  opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
  g = torch.Generator().manual_seed(0)
  x = torch.randn(batch, 3, image_size, image_size, generator=g)
  y = torch.arange(batch) % (batch // 4)
  gamma, m = 80.0, 0.25

  def circle(e, labels):
    s = e @ e.T
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool)
    pos, neg = same & ~eye, ~same
    ap = torch.clamp_min(1 + m - s.detach(), 0)
    an = torch.clamp_min(s.detach() + m, 0)
    lp = torch.where(pos, -gamma * ap * (s - (1 - m)), -torch.inf)
    ln = torch.where(neg, gamma * an * (s - m), -torch.inf)
    return torch.nn.functional.softplus(
        torch.logsumexp(lp, 1) + torch.logsumexp(ln, 1)).mean()

  def step():
    opt.zero_grad(set_to_none=True)
    e = torch.nn.functional.normalize(model(x), dim=1)
    loss = circle(e, y)
    loss.backward()
    opt.step()
    return loss.item()
  return step, torch


def time_rounds(batch, rounds, repeats):
  """Alternating rounds: (jax medians, torch medians), seconds."""
  step, state, data = jax_step(batch)
  holder = {"state": state}

  def run_jax():
    holder["state"], metrics = step(holder["state"], data)
    return metrics["loss"]

  t0 = time.perf_counter()
  run_jax()
  compile_s = time.perf_counter() - t0
  run_torch, _ = torch_step(batch)
  run_torch()
  jt, tt = [], []
  for r in range(rounds):
    jt.append(timing.median_s(run_jax, 0, repeats))
    tt.append(timing.median_s(lambda: (run_torch(), ())[1], 0, repeats))
    print(f"round {r}: jax {jt[-1]:.2f} s, torch {tt[-1]:.2f} s", flush=True)
  return jt, tt, compile_s


def memory_rows(batches):
  rows = []
  for batch in batches:
    row = {"batch": batch}
    for remat in (False, True):
      step, state, data = jax_step(batch, remat=remat, concrete=False)
      import jax  # pylint: disable=import-outside-toplevel
      spec = jax.tree_util.tree_map(
          lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), data)
      t0 = time.perf_counter()
      mem = timing.compiled_memory(step.lower(state, spec).compile())
      row[remat] = (mem, time.perf_counter() - t0)
      print(batch, remat, mem, flush=True)
    rows.append(row)
  return rows


def main():
  p = timing.parser(__doc__, repeats=3, out="results file (markdown)")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--threads", type=int, default=os.cpu_count())
  p.add_argument("--memory-batches", default="32,64,128,256")
  p.add_argument("--skip-torch", action="store_true")
  a = p.parse_args()
  lines = ["# ViT-S/16 train step: circle_jax vs timm, and remat memory", "",
           "Command: `python -m experiments.bench.vit "
           + " ".join(sys.argv[1:]) + "`", "", timing.machine_line(), ""]
  if not a.skip_torch:
    import torch  # pylint: disable=import-outside-toplevel
    torch.set_num_threads(a.threads)
    jt, tt, compile_s = time_rounds(a.batch, a.rounds, a.repeats)
    lines += [
        f"## Step time, batch {a.batch}, 224 px, float32 "
        f"(median of {a.repeats} steps per round; rounds alternate)", "",
        "| round | circle_jax (s) | timm + PyTorch (s) | ratio |",
        "| --- | --- | --- | --- |"]
    for r, (j, t) in enumerate(zip(jt, tt)):
      lines.append(f"| {r} | {j:.2f} | {t:.2f} | {j / t:.2f} |")
    jm, tm = statistics.median(jt), statistics.median(tt)
    lines += [f"| median | {jm:.2f} | {tm:.2f} | **{jm / tm:.2f}** |", "",
              f"circle_jax compile + first step: {compile_s:.0f} s. "
              f"torch threads: {a.threads}.", ""]
  batches = [int(b) for b in a.memory_batches.split(",")]
  rows = memory_rows(batches)
  lines += ["## Compiled memory of the step (XLA memory analysis, MiB)", "",
            "| batch | peak | temporaries | peak, remat | temporaries, remat "
            "| remat / no remat (peak) |", "| --- | --- | --- | --- | --- | --- |"]
  for row in rows:
    (m0, _), (m1, _) = row[False], row[True]
    lines.append(
        f"| {row['batch']} | {m0['peak'] / _MIB:.0f} | {m0['temp'] / _MIB:.0f}"
        f" | {m1['peak'] / _MIB:.0f} | {m1['temp'] / _MIB:.0f} | "
        f"{m1['peak'] / m0['peak']:.2f} |")
  timing.write_table("\n".join(lines) + "\n", a.out)


if __name__ == "__main__":
  timing.run(main)
