"""What every benchmark script shares: the timing loop and the command line.

* :func:`call_times` / :func:`median_s` / :func:`interleaved_medians`:
  wall-clock timing of compiled calls;
  :func:`compiled_memory`: XLA's memory analysis of a compiled program;
* :func:`parser`: an ``argparse`` parser with the common flags (``--repeats``,
  ``--out``, ``--no-hugepages``, ``--compilation-cache``);
* :func:`run`: the ``__main__`` entry, which first re-executes the process
  with huge-page malloc (:mod:`circle_jax.hostenv`) unless ``--no-hugepages``;
* :func:`machine_line` and :func:`write_table`: the host line and the output
  of a results file; :func:`command_line`: the command that reruns a script,
  for that file; :func:`child_command`: a script run again in a child
  process (``cwd=REPO``).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

from circle_jax import hostenv

# The repository root: the working directory of a script's child processes.
REPO = pathlib.Path(__file__).resolve().parents[2]


def call_times(fn: Callable[[], object], warmup: int, repeats: int,
               budget_s: float = float("inf")) -> List[float]:
  """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones.

  Each call is waited for with ``jax.block_until_ready`` on what ``fn``
  returns (any pytree of arrays; an empty tuple for work that is already
  synchronous). A call slower than ``budget_s`` ends the measurement early,
  so a pathological case cannot stall a sweep: a slow warm-up call is
  returned as the only time, a slow timed call as the last one.
  """
  import jax  # pylint: disable=g-import-not-at-top  (not needed by faiss runs)
  for _ in range(warmup):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    if time.perf_counter() - t0 > budget_s:
      return [time.perf_counter() - t0]
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
    if times[-1] > budget_s:
      break
  return times


def median_s(fn: Callable[[], object], warmup: int, repeats: int,
             budget_s: float = float("inf")) -> float:
  """Median seconds of :func:`call_times` (same arguments)."""
  return statistics.median(call_times(fn, warmup, repeats, budget_s))


def interleaved_medians(fns: Dict[str, Callable[[], object]], warmup: int,
                        repeats: int) -> Dict[str, float]:
  """Median seconds of each of ``fns``, their calls interleaved.

  ``warmup`` untimed calls of each, then ``repeats`` rounds of one timed
  call of each in turn (as :func:`call_times`), so that a change of a shared
  host's load hits every function alike.
  """
  for fn in fns.values():
    call_times(fn, warmup, 0)
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      times[name] += call_times(fn, 0, 1)
  return {name: statistics.median(t) for name, t in times.items()}


def compiled_memory(compiled) -> Optional[Dict[str, int]]:
  """XLA's memory analysis of a compiled program, in bytes.

  ``{'peak': arguments + outputs + temporaries - aliased, 'temp':
  temporaries}``; None where the backend gives no analysis.
  """
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if m is None:
    return None
  return {"peak": int(m.argument_size_in_bytes + m.output_size_in_bytes
                      + m.temp_size_in_bytes - m.alias_size_in_bytes),
          "temp": int(m.temp_size_in_bytes)}


def parser(doc: str, *, repeats: Optional[int] = None,
           out: Optional[str] = None, hugepages: bool = True,
           compilation_cache: bool = False) -> argparse.ArgumentParser:
  """A benchmark's parser: its docstring's first line and the common flags.

  Args:
    doc: the script's ``__doc__`` (the first line is the description).
    repeats: the default of ``--repeats`` (timed calls); None: no flag.
    out: the help of ``--out`` (also ``--output``), the results file;
      None: no flag.
    hugepages: add ``--no-hugepages`` (keep the default malloc; see
      :func:`run`).
    compilation_cache: add ``--compilation-cache DIR`` (JAX's persistent
      compilation cache).
  """
  p = argparse.ArgumentParser(description=doc.strip().split("\n")[0])
  if repeats is not None:
    p.add_argument("--repeats", type=int, default=repeats,
                   help="timed calls per measurement")
  if out is not None:
    p.add_argument("--out", "--output", dest="out", default="", help=out)
  if hugepages:
    p.add_argument("--no-hugepages", action="store_true",
                   help="keep the default malloc (see circle_jax/hostenv.py)")
  if compilation_cache:
    p.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="use JAX's persistent compilation cache in DIR (run "
                        "twice: the first run fills it)")
  return p


def use_compilation_cache(directory: Optional[str]) -> None:
  """Turns on JAX's persistent compilation cache in ``directory`` (if any),
  for every compilation (no minimum compile time)."""
  if directory:
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def run(main: Callable[[], object]) -> None:
  """A benchmark's ``__main__``: huge-page malloc (unless ``--no-hugepages``
  or ``CIRCLE_JAX_NO_HUGEPAGES=1``), then ``main()``."""
  hostenv.reexec_with_hugepage_malloc(disabled="--no-hugepages" in sys.argv)
  main()


def machine_line() -> str:
  """``"Machine: ..."``: :func:`circle_jax.hostenv.describe` of this host."""
  return f"Machine: {hostenv.describe()}."


def write_table(text: str, out: str | os.PathLike | None) -> None:
  """Prints a results file's text and writes it to ``out`` (if given)."""
  print(text)
  if out:
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def command_line(module: str, argv: Optional[Sequence[str]] = None) -> str:
  """``python -m module ARGS``: the command that reruns a script, as a
  results file records it (``argv``: the arguments; default the process')."""
  args = sys.argv[1:] if argv is None else argv
  return shlex.join(["python", "-m", module, *args])


def child_command(module: str, *args: str) -> List[str]:
  """``[python, -m, module, *args]``: a script run again in a child process
  (a fresh process per measurement); run it with ``cwd=REPO``."""
  return [sys.executable, "-m", module, *args]
