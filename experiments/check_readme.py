"""Checks the README's digits figures against a run's ``metrics.json``.

  python -m experiments.check_readme --metrics /tmp/digits_run/metrics.json

The README's table between the ``<!-- digits-figures ... -->`` marker and the
next blank line has one row per metric (R@1, MAP@R, NMI) and the columns
``init`` and ``final``; each figure must equal the run's value rounded to two
decimals, within ``--tolerance`` (default 0.01: other CPUs can round the
float32 training differently). Exit status 1 lists every mismatch.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from typing import Dict, List, Tuple

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
MARKER = "<!-- digits-figures"
METRICS = {"R@1": "recall@1", "MAP@R": "map@r", "NMI": "nmi"}
COLUMNS = ("init", "final")


def readme_figures(text: str) -> Dict[Tuple[str, str], float]:
  """``{(column, metric key): value}`` of the README's digits table."""
  if MARKER not in text:
    raise ValueError(f"README has no {MARKER} table.")
  block = text.split(MARKER, 1)[1].split("\n\n", 1)[0]
  rows = [l for l in block.splitlines()[1:] if l.startswith("|")]
  header = [c.strip() for c in rows[0].strip("|").split("|")]
  cols = {i: c.split()[0] for i, c in enumerate(header) if i}
  out = {}
  for row in rows[2:]:
    cells = [c.strip() for c in row.strip("|").split("|")]
    key = METRICS[cells[0]]
    for i, col in cols.items():
      out[(col, key)] = float(cells[i])
  return out


def readme_final_step(text: str) -> int:
  return int(re.search(r"final \(step (\d+)\)", text).group(1))


def compare(text: str, metrics: dict, tolerance: float = 0.01) -> List[str]:
  """The mismatches between the README and ``metrics.json`` (empty: equal)."""
  bad = []
  if metrics.get("step") != readme_final_step(text):
    bad.append(f"final step: README {readme_final_step(text)}, run "
               f"{metrics.get('step')}")
  for (col, key), want in sorted(readme_figures(text).items()):
    got = round(float(metrics[col][key]), 2)
    if abs(got - want) > tolerance + 1e-9:
      bad.append(f"{col} {key}: README {want:.2f}, run {got:.2f} "
                 f"({metrics[col][key]:.4f})")
  return bad


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--metrics", required=True, help="a run's metrics.json")
  ap.add_argument("--readme", default=str(README))
  ap.add_argument("--tolerance", type=float, default=0.01)
  args = ap.parse_args(argv)
  text = pathlib.Path(args.readme).read_text()
  with open(args.metrics) as f:
    metrics = json.load(f)
  bad = compare(text, metrics, args.tolerance)
  for line in bad:
    print(line, file=sys.stderr)
  if not bad:
    print(f"README digits figures match {args.metrics}.")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
