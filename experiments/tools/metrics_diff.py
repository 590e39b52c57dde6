"""Compares the metrics of two runs' ``metrics.json``, metric by metric.

Usage::

  python -m experiments.tools.metrics_diff RUN_A/metrics.json RUN_B/metrics.json
  python -m experiments.tools.metrics_diff --checkpoints RUN_A RUN_B

Prints a markdown table of every metric of the parts ``init``, ``final``,
``best.test`` and ``result.test`` (value in A, value in B, B - A), then the
largest absolute difference and the parts that differ in their step or
selection. With ``--checkpoints`` it compares the two workdirs' latest
checkpoints instead: the largest absolute difference of each parameter group
(the model's, the loss's), the BatchNorm statistics and the optimiser state.
Used for experiments/results/main_sharded_classes_omniglot_small.md
(one device against the class matrix sharded over 8 devices).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
from typing import Dict, Iterator, Tuple

import jax
import numpy as np

from circle_jax.train import checkpoint as ckpt_lib

_REPO = pathlib.Path(__file__).resolve().parents[2]

PARTS = ("init", "final", "best.test", "result.test")


def _part(metrics: dict, path: str):
  node = metrics
  for key in path.split("."):
    node = node.get(key) if isinstance(node, dict) else None
  return node


def rows(a: dict, b: dict) -> Iterator[Tuple[str, str, float, float]]:
  """``(part, metric, value in a, value in b)`` of every numeric metric
  both runs have."""
  for part in PARTS:
    x, y = _part(a, part) or {}, _part(b, part) or {}
    for name in sorted(set(x) & set(y)):
      if isinstance(x[name], (int, float)) and isinstance(y[name],
                                                          (int, float)):
        yield part, name, float(x[name]), float(y[name])


def report(a: dict, b: dict) -> str:
  lines = ["| part | metric | A | B | B - A |", "| --- | --- | ---: | ---: | ---: |"]
  largest: Dict[str, float] = {"diff": 0.0}
  for part, name, x, y in rows(a, b):
    lines.append(f"| {part} | {name} | {x!r} | {y!r} | {y - x:.3g} |")
    if abs(y - x) > largest["diff"]:
      largest = {"diff": abs(y - x), "where": f"{part} {name}"}
  lines.append("")
  lines.append(f"Largest absolute difference: {largest['diff']!r}"
               + (f" ({largest['where']})." if "where" in largest else "."))
  for key in ("step",):
    if a.get(key) != b.get(key):
      lines.append(f"{key}: A {a.get(key)} != B {b.get(key)}")
  sa, sb = _part(a, "result.step"), _part(b, "result.step")
  lines.append(f"Reported (result) step: A {sa}, B {sb}.")
  return "\n".join(lines)


def _latest(workdir: str):
  ckpts = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"))
  tree, step = ckpts.restore()[0], ckpts.latest_step()
  ckpts.close()
  return tree, step


def checkpoint_report(a_dir: str, b_dir: str) -> str:
  """The largest absolute difference of each part of the latest states."""
  (a, sa), (b, sb) = _latest(a_dir), _latest(b_dir)
  lines = [f"Latest checkpoints: A step {sa}, B step {sb}.", "",
           "| part | largest abs difference | largest abs value in A |",
           "| --- | ---: | ---: |"]
  parts = {"params.model": a["params"]["model"], "params.loss":
           a["params"]["loss"], "batch_stats": a["batch_stats"],
           "opt_state": a["opt_state"]}
  other = {"params.model": b["params"]["model"], "params.loss":
           b["params"]["loss"], "batch_stats": b["batch_stats"],
           "opt_state": b["opt_state"]}
  for name, x in parts.items():
    xs, ys = jax.tree.leaves(x), jax.tree.leaves(other[name])
    diff = max((float(np.max(np.abs(np.asarray(u, np.float64)
                                     - np.asarray(v, np.float64))))
                for u, v in zip(xs, ys) if np.size(u)), default=0.0)
    top = max((float(np.max(np.abs(np.asarray(u, np.float64))))
               for u in xs if np.size(u)), default=0.0)
    lines.append(f"| {name} | {diff:.3g} | {top:.3g} |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("a", help="the first run's metrics.json (workdir "
                      "with --checkpoints)")
  parser.add_argument("b", help="the second run's")
  parser.add_argument("--checkpoints", action="store_true",
                      help="compare the workdirs' latest checkpoints")
  args = parser.parse_args(argv)
  if args.checkpoints:
    print(checkpoint_report(args.a, args.b))
    return
  with open(args.a) as f:
    a = json.load(f)
  with open(args.b) as f:
    b = json.load(f)
  print(report(a, b))


if __name__ == "__main__":
  main()
