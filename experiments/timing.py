"""Wall-clock timing of compiled calls, shared by the benchmark scripts."""

from __future__ import annotations

import time
from typing import Callable, List


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
