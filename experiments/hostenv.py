"""Host settings for the CPU benchmarks: transparent huge pages for malloc.

XLA:CPU allocates the temporaries of a compiled program (for a pair loss at
B=4096, several 64 MiB ``[B, B]`` buffers) with ``malloc`` on every call.
glibc serves such sizes with fresh ``mmap``s, so every call pays one page
fault per 4 KiB page on first touch: about 20 ms per 64 MiB buffer on the
2-core benchmark machine, a large share of a loss's elementwise cost. With
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc >= 2.35) malloc asks for
transparent huge pages (``madvise``), which cuts the faults about 16x. The
benchmarks re-execute themselves with it (disable with ``--no-hugepages`` or
``CIRCLE_JAX_NO_HUGEPAGES=1``); training jobs can set it the same way::

  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python -m experiments.main ...

Measured (``python experiments/bench_losses.py --losses circle --batch-sizes
4096 --dtypes float32``): see docs/performance.md.
"""

from __future__ import annotations

import os
import platform
import sys

_TUNABLE = "glibc.malloc.hugetlb=1"


def _glibc_supports_hugetlb() -> bool:
  name, version = platform.libc_ver()
  if name != "glibc" or not version:
    return False
  major, minor = (int(v) for v in version.split(".")[:2])
  return (major, minor) >= (2, 35)


def hugepage_malloc_active() -> bool:
  """Whether this process runs with glibc's huge-page malloc tunable."""
  return _TUNABLE in os.environ.get("GLIBC_TUNABLES", "")


def describe() -> str:
  """One line for a results file: the malloc setting of this run."""
  if hugepage_malloc_active():
    return f"malloc: GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']} (transparent huge pages)"
  return "malloc: default (4 KiB pages)"


def reexec_with_hugepage_malloc(disabled: bool = False) -> None:
  """Re-executes this process with the huge-page malloc tunable set.

  Does nothing when it is already set, when ``disabled`` or
  ``CIRCLE_JAX_NO_HUGEPAGES=1``, or when the C library is not glibc >= 2.35.
  Call it first thing in a script's ``__main__`` block (a tunable is read at
  process start, so it cannot be switched on in a running process).
  """
  if (disabled or hugepage_malloc_active()
      or os.environ.get("CIRCLE_JAX_NO_HUGEPAGES") == "1"
      or not sys.platform.startswith("linux") or not _glibc_supports_hugetlb()):
    return
  env = dict(os.environ)
  env["GLIBC_TUNABLES"] = ":".join(
      t for t in (env.get("GLIBC_TUNABLES", ""), _TUNABLE) if t)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, env)
