"""The results table of the loss comparisons, written and read back.

One row per loss, one column per metric; a cell is ``mean ± std`` over seeds
(the sample standard deviation, ddof=1), scaled for display (percent by
default), with the best displayed mean of each column in bold::

  | loss | runs | P@1 | R@1 | MAP@R | NMI | train s |
  | --- | ---: | ---: | ---: | ---: | ---: | ---: |
  | `circle` | 3 | **61.2 ± 0.4** | ... | 41 ± 2 |

:func:`table_markdown` and :func:`format_stat` write it;
:func:`read_table_markdown` and :func:`parse_stat` are their inverses to the
shown digits. ``experiments/compare.py`` writes the tables under
``experiments/results/``; ``experiments/check_readme.py`` and the tests read
them.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from typing import Dict, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Stat:
  """Mean and sample standard deviation (ddof=1; None for n=1) of n values."""

  mean: float
  std: Optional[float]
  n: int


def aggregate(values: Sequence[float]) -> Optional[Stat]:
  """:class:`Stat` of ``values`` (None when there are none)."""
  values = [float(v) for v in values]
  if not values:
    return None
  std = statistics.stdev(values) if len(values) > 1 else None
  return Stat(statistics.fmean(values), std, len(values))


def format_stat(stat: Optional[Stat], scale: float = 100.0,
                digits: int = 1) -> str:
  """``"61.2 ± 0.4"`` (mean ± std, x ``scale``); one seed: ``"61.2"``.

  ``"–"`` when there is no value.
  """
  if stat is None:
    return "–"
  text = f"{stat.mean * scale:.{digits}f}"
  if stat.std is not None:
    text += f" ± {stat.std * scale:.{digits}f}"
  return text


_STAT_TEXT = re.compile(r"^(-?\d+(?:\.\d*)?)(?: ± (\d+(?:\.\d*)?))?$")


def parse_stat(text: str, scale: float = 100.0, n: int = 0
               ) -> Optional[Stat]:
  """The inverse of :func:`format_stat`, to the shown digits.

  ``"**61.2 ± 0.4**"`` -> ``Stat(0.612, 0.004, n)`` (bold markers of the best
  mean are ignored); ``"61.2"`` -> std None; ``"–"`` -> None.

  Raises:
    ValueError: ``text`` is none of these forms.
  """
  text = text.strip().strip("*")
  if text == "–":
    return None
  m = _STAT_TEXT.match(text)
  if not m:
    raise ValueError(f"'{text}' is not 'mean ± std', 'mean' or '–'")
  std = None if m.group(2) is None else float(m.group(2)) / scale
  return Stat(float(m.group(1)) / scale, std, n)


def read_table_markdown(markdown: str, scale: float = 100.0
                        ) -> Dict[str, Dict[str, Optional[Stat]]]:
  """``{loss: {column title: Stat}}`` of a :func:`table_markdown` table.

  ``markdown`` may be a whole results file: the table is found by its
  ``| loss | runs |`` header. ``Stat.n`` is the row's complete runs; the
  ``train s`` column is left out.

  Raises:
    ValueError: no such table, or a cell that :func:`parse_stat` rejects.
  """
  lines = markdown.splitlines()
  start = next((i for i, l in enumerate(lines)
                if l.startswith("| loss | runs |")), None)
  if start is None:
    raise ValueError("no '| loss | runs | ...' results table")
  cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
  titles = cells(lines[start])
  out = {}
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      break
    row = dict(zip(titles, cells(line)))
    n = int(row["runs"].split("/")[0])
    out[row["loss"].strip("`")] = {
        t: parse_stat(c, scale, n) for t, c in row.items()
        if t not in ("loss", "runs", "train s")}
  return out


def table_markdown(summary: Dict[str, Dict[str, Optional[Stat]]],
                   columns: Sequence[Tuple[str, str]],
                   runs_per_loss: Dict[str, Tuple[int, int]],
                   scale: float = 100.0, digits: int = 1) -> str:
  """The results table: one row per loss, the best mean per column in bold.

  Args:
    summary: ``{loss: {metric key: Stat or None}}``, rows in table order
      (``"train_seconds"`` gives the ``train s`` column).
    columns: ``(metric key, title)`` pairs.
    runs_per_loss: ``{loss: (complete runs, requested runs)}``.
    scale: display factor of the metric values (100: percent).
    digits: decimals shown; "best" compares the displayed means, so ties
      are all bold.

  Returns:
    The Markdown table (no trailing newline).
  """
  best = {}
  for key, _ in columns:
    shown = [round(row[key].mean * scale, digits) for row in summary.values()
             if row.get(key) is not None]
    best[key] = max(shown) if shown else None
  head = ["loss", "runs"] + [t for _, t in columns] + ["train s"]
  lines = ["| " + " | ".join(head) + " |",
           "| --- | ---: |" + " ---: |" * (len(columns) + 1)]
  for loss, row in summary.items():
    done, wanted = runs_per_loss[loss]
    cells = [f"`{loss}`", str(done) if done == wanted else f"{done}/{wanted}"]
    for key, _ in columns:
      text = format_stat(row.get(key), scale, digits)
      stat = row.get(key)
      if stat is not None and round(stat.mean * scale, digits) == best[key]:
        text = f"**{text}**"
      cells.append(text)
    cells.append(format_stat(row.get("train_seconds"), 1.0, 0))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
