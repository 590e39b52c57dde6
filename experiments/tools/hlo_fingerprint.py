"""Fingerprints of the compiled loss programs of one or more checkouts.

Usage::

  python -m experiments.tools.hlo_fingerprint \\
      --checkouts OLD_CHECKOUT . \\
      --out experiments/results/tools/hlo_fingerprint_cpu.md

For each checkout (a folder holding a ``circle_jax`` package) it compiles
``jax.jit(jax.value_and_grad(loss))`` of each named loss at ``B x D``
(float32 embeddings, int32 labels) with that checkout's ``circle_jax``, takes
XLA's optimized HLO text, drops what names source code (the file, function
and stack-frame tables and the instructions' ``metadata``), and hashes the
rest. Equal fingerprints mean XLA runs the same program, instruction for
instruction: a refactor that keeps them has not changed the loss's speed on
that backend, which a timing under load cannot show as sharply.

Each checkout runs in a child process of this file with ``PYTHONPATH`` set to
it, so an old checkout without this script can be compared too; the child
imports only ``circle_jax.losses``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import platform
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

DEFAULT_LOSSES = ("circle_loss", "multi_similarity_loss", "ranked_list_loss",
                  "contrastive_loss", "triplet_margin_loss")

# Lines of the optimized HLO text that name source code, not computation.
_SOURCE_TABLES = re.compile(
    r"^(FileNames|FunctionNames|FileLocations|StackFrames)\b|^\d+ [{\"]")
_SOURCE_ATTRS = re.compile(r", (metadata=\{[^}]*\}|stack_frame_id=\d+)")


def normalized_hlo(text: str) -> str:
  """The optimized HLO ``text`` without its source-code references."""
  lines = [_SOURCE_ATTRS.sub("", line) for line in text.splitlines()
           if not _SOURCE_TABLES.match(line)]
  return re.sub(r"^HloModule \S+", "HloModule m", "\n".join(lines), flags=re.M)


def fingerprints(losses, batch: int, dim: int) -> dict:
  """``{loss: [sha256 prefix, instruction count]}`` with this process's
  ``circle_jax``."""
  # Imported here: the child's circle_jax is the checkout's (PYTHONPATH).
  from circle_jax import losses as losses_lib
  embeddings = jax.ShapeDtypeStruct((batch, dim), jnp.float32)
  labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
  result = {}
  for name in losses:
    fn = getattr(losses_lib, name)
    program = jax.jit(jax.value_and_grad(lambda x, y, fn=fn: fn(x, y)))
    text = normalized_hlo(program.lower(embeddings, labels).compile().as_text())
    count = sum(" = " in line for line in text.splitlines())
    result[name] = [hashlib.sha256(text.encode()).hexdigest()[:16], count]
  return result


def _of_checkout(checkout: pathlib.Path, args) -> dict:
  env = dict(os.environ, PYTHONPATH=str(checkout), JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, __file__, "--emit_json", "--batch", str(args.batch),
       "--dim", str(args.dim), "--losses", *args.losses],
      cwd=checkout, env=env, capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    raise SystemExit(f"{checkout}: the child failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _commit(checkout: pathlib.Path) -> str:
  proc = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short",
                         "HEAD"], capture_output=True, text=True, check=False)
  return proc.stdout.strip() or "?"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkouts", nargs="+", default=["."],
                      help="Folders holding a circle_jax package.")
  parser.add_argument("--losses", nargs="+", default=list(DEFAULT_LOSSES))
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--dim", type=int, default=512)
  parser.add_argument("--out", help="Markdown results file.")
  parser.add_argument("--emit_json", action="store_true",
                      help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.emit_json:
    print(json.dumps(fingerprints(args.losses, args.batch, args.dim)))
    return
  checkouts = [pathlib.Path(c).resolve() for c in args.checkouts]
  found = {c: _of_checkout(c, args) for c in checkouts}
  heads = [f"{c.name} ({_commit(c)})" for c in checkouts]
  lines = [
      "# Optimized HLO fingerprints of value_and_grad(loss)",
      "",
      f"B = {args.batch}, D = {args.dim}, float32, XLA CPU "
      f"({platform.machine()}). Command:",
      "",
      "    python -m experiments.tools.hlo_fingerprint --checkouts "
      + " ".join(args.checkouts) + (f" --out {args.out}" if args.out else ""),
      "",
      "| loss | " + " | ".join(heads) + " | same program |",
      "| --- | " + " | ".join("---" for _ in heads) + " | --- |"]
  for name in args.losses:
    cells = [found[c][name] for c in checkouts]
    same = all(cell == cells[0] for cell in cells)
    lines.append(f"| `{name}` | " + " | ".join(
        f"`{sha}` ({n} instructions)" for sha, n in cells)
                 + f" | {'yes' if same else 'NO'} |")
  lines += ["", "Equal fingerprints: XLA compiled the same program, instruction "
            "for instruction (source locations aside), so the loss runs at the "
            "same speed on this backend whatever the machine's load; a timing "
            "can only approach that within its noise."]
  text = "\n".join(lines) + "\n"
  print(text)
  if args.out:
    pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
  main()
