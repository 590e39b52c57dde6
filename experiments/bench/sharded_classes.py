r"""Per-device memory of a train step with a million-class matrix, sharded.

On 8 simulated CPU devices (``--xla_force_host_platform_device_count=8``,
set here before JAX is imported), one train step of ArcFace with a
``[C, D]`` class matrix: a small backbone (one dense layer from 64 input
features to the ``D``-dimensional embedding), Adam on the backbone and the
class matrix, the global batch split over the devices. Three placements:

* ``replicated``: the class matrix and its Adam moments on every device, each
  device's logits against all ``C`` classes (``axis_name`` only);
* ``sharded``: each device holds ``ceil(C / 8)`` rows and their moments,
  gathers the batch and runs PartialFC's model-parallel softmax
  (``shard_classes=True``);
* ``sharded_r0.1``: the same with PartialFC's negative-class sampling at
  ``sample_rate=0.1``.

The per-device peak is XLA's memory analysis of the compiled SPMD program
(one device's program): arguments + outputs + temporaries - aliased bytes
(the state is donated), ``experiments.bench.timing.compiled_memory``. Everything
is only compiled, never run, so ``C = 10^6`` replicated (24 GiB of class
rows and moments over the 8 devices) costs nothing. The largest ``C`` that
fits is solved from the two measured sizes (the peak is affine in ``C``).
The results file::

  python -m experiments.bench.sharded_classes --record
"""

from __future__ import annotations

import argparse
import datetime
import pathlib

from experiments.bench import simulated_devices  # noqa: F401  (before jax)

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import circle_jax.losses as cj
from experiments.bench import timing

_REPO = pathlib.Path(__file__).resolve().parents[2]

_GIB = 2**30
_IN = 64  # the backbone's input features
MODES = ("replicated", "sharded", "sharded_r0.1")


def _program(mode, mesh, num_classes):
  """The jitted step ``(params, opt_state, x, labels, key) -> same``."""
  opt = optax.adam(1e-3)
  sharded = mode != "replicated"
  rate = 0.1 if mode == "sharded_r0.1" else 1.0

  def loss(params, x, labels, key):
    z = x @ params["backbone"]
    return cj.arcface_loss(
        z, labels, params["classes"], axis_name="d", shard_classes=sharded,
        num_classes=num_classes if sharded else None, sample_rate=rate,
        key=key)

  def local(params, opt_state, x, labels, key):
    # Replicated leaves: shard_map's transpose already sums their gradients
    # over the devices; sharded rows: each device's own.
    value, grads = jax.value_and_grad(loss)(params, x, labels, key)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  rows = P("d") if sharded else P()
  pspec = {"backbone": P(), "classes": rows}
  ospec = (optax.ScaleByAdamState(count=P(), mu=pspec, nu=pspec),
           optax.EmptyState())
  step = jax.shard_map(local, mesh=mesh,
                       in_specs=(pspec, ospec, P("d"), P("d"), P()),
                       out_specs=(pspec, ospec, P()))
  return jax.jit(step, donate_argnums=(0, 1)), pspec, ospec


def _shapes(mode, mesh, num_classes, dim, batch, pspec, ospec):
  n = mesh.devices.size
  rows = num_classes if mode == "replicated" else -(-num_classes // n) * n

  def struct(shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype,
                                sharding=NamedSharding(mesh, spec))

  params = {"backbone": struct((_IN, dim), pspec["backbone"]),
            "classes": struct((rows, dim), pspec["classes"])}
  adam = optax.ScaleByAdamState(
      count=struct((), P(), jnp.int32), mu=params, nu=params)
  del ospec
  return (params, (adam, optax.EmptyState()),
          struct((batch, _IN), P("d")), struct((batch,), P("d"), jnp.int32),
          struct((2,), P(), jnp.uint32))


def measure(mode, num_classes, dim, batch, devices=8) -> dict:
  """Compiles one step; returns its per-device figures (bytes)."""
  mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
  step, pspec, ospec = _program(mode, mesh, num_classes)
  shapes = _shapes(mode, mesh, num_classes, dim, batch, pspec, ospec)
  mem = timing.compiled_memory(step.lower(*shapes).compile())
  return dict(mode=mode, classes=num_classes, dim=dim, batch=batch,
              peak=mem["peak"], temp=mem["temp"])


def largest_fitting(rows, budget):
  """The largest ``C`` whose peak (affine in ``C`` between the two measured
  sizes) is at most ``budget`` bytes."""
  (c0, p0), (c1, p1) = rows
  slope = (p1 - p0) / (c1 - c0)
  return int((budget - (p0 - slope * c0)) // slope)


def table(classes, dim, batch, budget_gib) -> str:
  lines = [
      "| C | placement | per-device peak (GiB) | temporaries (GiB) | "
      "peak / replicated |",
      "| --- | --- | --- | --- | --- |"]
  peaks = {}
  for c in classes:
    for mode in MODES:
      r = measure(mode, c, dim, batch)
      peaks[(mode, c)] = r["peak"]
      ratio = r["peak"] / peaks[("replicated", c)]
      lines.append(f"| {c:,} | {mode} | {r['peak'] / _GIB:.3f} | "
                   f"{r['temp'] / _GIB:.3f} | {ratio:.3f} |")
      print(lines[-1], flush=True)
  budget = budget_gib * _GIB
  lines += ["", f"Largest C that fits {budget_gib} GiB (affine fit between "
            f"C = {classes[0]:,} and {classes[-1]:,}):", "",
            "| placement | per device <= budget | all 8 devices together "
            "<= budget (this machine) |", "| --- | --- | --- |"]
  for mode in MODES:
    pts = [(c, peaks[(mode, c)]) for c in (classes[0], classes[-1])]
    lines.append(f"| {mode} | {largest_fitting(pts, budget):,} | "
                 f"{largest_fitting(pts, budget / 8):,} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--classes", default="100000,1000000")
  ap.add_argument("--dim", type=int, default=512)
  ap.add_argument("--batch", type=int, default=512,
                  help="global batch (64 per device)")
  ap.add_argument("--budget-gib", type=float, default=24.0)
  ap.add_argument("--record", action="store_true",
                  help="write experiments/results/bench/sharded_classes_cpu.md")
  args = ap.parse_args(argv)
  classes = [int(c) for c in args.classes.split(",")]
  body = table(classes, args.dim, args.batch, args.budget_gib)
  if args.record:
    out = _REPO / "experiments/results/bench" / "sharded_classes_cpu.md"
    out.write_text(
        "# Per-device memory of one train step, class matrix replicated vs "
        "sharded (8 simulated CPU devices)\n\n"
        f"Recorded {datetime.date.today().isoformat()} with jax "
        f"{jax.__version__}, compile only (XLA memory analysis):\n\n"
        "    python -m experiments.bench.sharded_classes --record\n\n"
        f"ArcFace, D = {args.dim}, global batch {args.batch}, Adam on a "
        "one-layer backbone and the class matrix. The issue's target at C = "
        "10^6 is a sharded peak of at most 1/6 of the replicated one (last "
        "column). The sharded temporaries are mostly the `[B, C / 8]` "
        "logit blocks of the gathered batch (and their gradients), which "
        "PartialFC's sampling shrinks. Step times are not given: this "
        "machine's 2 shared cores cannot run the replicated C = 10^6 step "
        "(8 x 13 GiB).\n\n" + body)
    print(f"wrote {out}")
  else:
    print(body)


if __name__ == "__main__":
  main()
