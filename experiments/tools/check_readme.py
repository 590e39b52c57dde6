"""Checks the README's digits figures against a run's ``metrics.json``.

  python -m experiments.tools.check_readme --metrics /tmp/digits_run/metrics.json

The README's table between the ``<!-- digits-figures ... -->`` marker and the
next blank line has one row per metric (R@1, MAP@R, NMI) and the columns
``init``, ``final`` and ``3 seeds`` (mean ± std of the Circle row of
``experiments/results/compare/losses_digits.md``, the comparison table).

- ``init`` must equal the run's value to two decimals (``--tolerance``, default
  0.01): a forward pass of the initial model rounds alike on every CPU.
- ``final`` must equal one of the final columns (one per CPU generation,
  named with its instruction-set level) within ``--tolerance`` *or* within
  two standard deviations over seeds, whichever is wider. The job is
  bitwise deterministic on a given CPU, but float32 matmuls round
  differently on another generation, and 150 steps of training amplify that
  into a difference like a different seed's (the README's table).
- ``3 seeds`` must match ``digits.md`` (so the tolerance is the measured one).

Exit status 1 lists every mismatch.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from typing import Dict, List, Optional, Tuple


from circle_jax import results

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SEEDS_TABLE = ROOT / "experiments/results/compare/losses_digits.md"
MARKER = "<!-- digits-figures"
METRICS = {"R@1": "recall@1", "MAP@R": "map@r", "NMI": "nmi"}
COLUMNS = ("init", "final")
SEEDS_COLUMN = "seeds"
SPREAD_FACTOR = 2.0


def _readme_rows(text: str) -> Tuple[List[str], List[List[str]]]:
  if MARKER not in text:
    raise ValueError(f"README has no {MARKER} table.")
  block = text.split(MARKER, 1)[1].split("\n\n", 1)[0]
  rows = [l for l in block.splitlines()[1:] if l.startswith("|")]
  split = lambda row: [c.strip() for c in row.strip("|").split("|")]
  return split(rows[0]), [split(r) for r in rows[2:]]


def _column(header: List[str], name: str) -> int:
  for i, cell in enumerate(header):
    if i and name in cell.split():
      return i
  raise ValueError(f"README digits table has no '{name}' column: {header}")


def readme_figures(text: str) -> Dict[Tuple[str, str], float]:
  """``{(column, metric key): value}`` of the README's init/final columns."""
  header, rows = _readme_rows(text)
  out = {}
  for col in COLUMNS:
    i = _column(header, col)
    for cells in rows:
      out[(col, METRICS[cells[0]])] = float(cells[i])
  return out


def readme_other_finals(text: str) -> Dict[str, List[float]]:
  """``{metric key: [value, ...]}`` of the final columns after the first
  (other CPUs' figures: a run may match any final column)."""
  header, rows = _readme_rows(text)
  first = _column(header, "final")
  cols = [i for i, cell in enumerate(header)
          if i > first and cell.split(",")[0].split()[:1] == ["final"]]
  return {METRICS[cells[0]]: [float(cells[i]) for i in cols] for cells in rows}


def readme_seeds(text: str) -> Dict[str, Tuple[float, float]]:
  """``{metric key: (mean, std)}`` of the README's seeds column."""
  header, rows = _readme_rows(text)
  i = _column(header, SEEDS_COLUMN)
  out = {}
  for cells in rows:
    stat = results.parse_stat(cells[i], scale=1.0)
    if stat is None or stat.std is None:
      raise ValueError(f"README digits table: '{cells[i]}' is not 'mean ± std'")
    out[METRICS[cells[0]]] = (stat.mean, stat.std)
  return out


def readme_final_step(text: str) -> int:
  return int(re.search(r"final \(step (\d+)\)", text).group(1))


def seed_stats(table: str, loss: str = "circle"
               ) -> Dict[str, Tuple[float, float]]:
  """``{metric key: (mean, std)}`` as fractions, from a comparison table.

  ``table`` is a results file of ``experiments.compare.losses`` (values in %,
  ``mean ± std``); the row of ``loss`` is read.
  """
  rows = results.read_table_markdown(table)
  if loss not in rows:
    raise ValueError(f"the comparison table has no row for `{loss}`")
  out = {}
  for name, key in METRICS.items():
    stat = rows[loss].get(name)
    if stat is None or stat.std is None:
      raise ValueError(f"`{loss}` {name} is not 'mean ± std' over several "
                       "seeds")
    out[key] = (stat.mean, stat.std)
  return out


def compare(text: str, metrics: dict, tolerance: float = 0.01,
            seeds: Optional[Dict[str, Tuple[float, float]]] = None
            ) -> List[str]:
  """The mismatches between the README and ``metrics.json`` (empty: equal).

  ``seeds``: the comparison table's ``{key: (mean, std)}``; when given, the
  README's seeds column must match it, and a final figure may differ from the
  run by up to ``SPREAD_FACTOR`` standard deviations.
  """
  bad = []
  if metrics.get("step") != readme_final_step(text):
    bad.append(f"final step: README {readme_final_step(text)}, run "
               f"{metrics.get('step')}")
  if seeds is not None:
    for key, (mean, std) in sorted(readme_seeds(text).items()):
      want_mean, want_std = seeds[key]
      if (abs(round(want_mean, 2) - mean) > 1e-9
          or abs(round(want_std, 2) - std) > 1e-9):
        bad.append(f"seeds {key}: README {mean:.2f} ± {std:.2f}, comparison "
                   f"table {want_mean:.3f} ± {want_std:.3f}")
  others = readme_other_finals(text)
  for (col, key), want in sorted(readme_figures(text).items()):
    got = round(float(metrics[col][key]), 2)
    allowed = tolerance
    if col == "final" and seeds is not None:
      allowed = max(tolerance, SPREAD_FACTOR * seeds[key][1])
    wants = [want] + (others.get(key, []) if col == "final" else [])
    if min(abs(got - w) for w in wants) > allowed + 1e-9:
      bad.append(f"{col} {key}: README {want:.2f}, run {got:.2f} "
                 f"({metrics[col][key]:.4f}), allowed ± {allowed:.2f}")
  return bad


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--metrics", required=True, help="a run's metrics.json")
  ap.add_argument("--readme", default=str(README))
  ap.add_argument("--seeds-table", default=str(SEEDS_TABLE),
                  help="the digits comparison table (seed spread of Circle)")
  ap.add_argument("--tolerance", type=float, default=0.01)
  args = ap.parse_args(argv)
  text = pathlib.Path(args.readme).read_text()
  seeds = seed_stats(pathlib.Path(args.seeds_table).read_text())
  with open(args.metrics) as f:
    metrics = json.load(f)
  bad = compare(text, metrics, args.tolerance, seeds)
  for line in bad:
    print(line, file=sys.stderr)
  if not bad:
    print(f"README digits figures match {args.metrics}.")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
