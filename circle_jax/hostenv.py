"""The machine a measurement ran on, described once for every results file.

Timings and some float32 results depend on the host: the CPU model (XLA:CPU
blocks its matmuls for the CPU, so another model rounds differently), the
CPUs this process may use, the load of a shared machine, GPUs, the JAX
version and backend, and the ``malloc`` setting below. :func:`machine_info`
gathers these as a dict (for JSON files) and :func:`describe` as the one
line that the benchmark and experiment scripts write into their results.

Transparent huge pages for malloc. XLA:CPU allocates the temporaries of a
compiled program (for a pair loss at B=4096, several 64 MiB ``[B, B]``
buffers) with ``malloc`` on every call. glibc serves such sizes with fresh
``mmap``s, so every call pays one page fault per 4 KiB page on first touch:
about 20 ms per 64 MiB buffer on the 2-core benchmark machine, a large share
of a loss's elementwise cost. With ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
(glibc >= 2.35) malloc asks for transparent huge pages (``madvise``), which
cuts the faults about 16x. The benchmarks re-execute themselves with it
(:func:`reexec_with_hugepage_malloc`; disable with ``--no-hugepages`` or
``CIRCLE_JAX_NO_HUGEPAGES=1``), and so does the training job
``python -m experiments.main`` (HIER on the omniglot recipe: 2.43-2.53 ->
3.33-3.46 steps/s on a 2-core AMD EPYC, the same losses).

Measured (``python -m experiments.bench.losses --losses circle --batch-sizes
4096 --dtypes float32``): see docs/performance.md.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from typing import Any, Dict, Optional

_TUNABLE = "glibc.malloc.hugetlb=1"


# ----------------------------------------------------------------------------
# The machine.
# ----------------------------------------------------------------------------


def cpu_model() -> str:
  """The CPU model name (Linux ``/proc/cpuinfo``), else the platform's."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.lower().startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def num_cpus() -> int:
  """What ``nproc`` prints: the CPUs this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def accelerators() -> str:
  """NVIDIA GPUs by name (``nvidia-smi``), or "" (without starting JAX)."""
  if not shutil.which("nvidia-smi"):
    return ""
  try:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return ""
  return ", ".join(line.strip() for line in out.splitlines() if line.strip())


def load_average() -> float:
  """The 1-minute load average (0.0 where the system has none)."""
  try:
    return os.getloadavg()[0]
  except OSError:
    return 0.0


def machine_info() -> Dict[str, Any]:
  """``{'nproc', 'cpu', 'accelerators'}`` of this host (JSON-serialisable)."""
  return {"nproc": num_cpus(), "cpu": cpu_model(),
          "accelerators": accelerators()}


def cpu_text(info: Dict[str, Any]) -> str:
  """``"2 CPUs (nproc), AMD EPYC 7B13"`` from :func:`machine_info`'s dict."""
  return f"{info['nproc']} CPUs (nproc), {info['cpu']}"


def describe(*, with_jax: bool = True) -> str:
  """The one-line description of this host for a results file.

  ``"2 CPUs (nproc), AMD EPYC 7B13; GPUs: ...; jax 0.10.2, cpu (cpu);
  1-min load average 1.3; malloc: default (4 KiB pages)"``: CPUs and model,
  the GPUs ``nvidia-smi`` lists (if any), the JAX version and first device
  (with ``with_jax``, which imports JAX), the current load and the malloc
  setting.
  """
  info = machine_info()
  parts = [cpu_text(info)]
  if info["accelerators"]:
    parts.append(f"GPUs: {info['accelerators']}")
  if with_jax:
    import jax  # pylint: disable=g-import-not-at-top
    dev = jax.devices()[0]
    parts.append(f"jax {jax.__version__}, {dev.device_kind} "
                 f"({jax.default_backend()})")
  parts.append(f"1-min load average {load_average():.1f}")
  parts.append(malloc_setting())
  return "; ".join(parts)


# ----------------------------------------------------------------------------
# Huge-page malloc.
# ----------------------------------------------------------------------------


def hugepage_malloc_supported() -> bool:
  """Whether the C library has the huge-page malloc tunable (glibc >=
  2.35 on Linux)."""
  if not sys.platform.startswith("linux"):
    return False
  name, version = platform.libc_ver()
  if name != "glibc" or not version:
    return False
  major, minor = (int(v) for v in version.split(".")[:2])
  return (major, minor) >= (2, 35)


def hugepage_malloc_active() -> bool:
  """Whether this process runs with glibc's huge-page malloc tunable."""
  return _TUNABLE in os.environ.get("GLIBC_TUNABLES", "")


def malloc_setting() -> str:
  """The malloc setting of this process, as a results file states it."""
  if hugepage_malloc_active():
    return (f"malloc: GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']} "
            "(transparent huge pages)")
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
      or not hugepage_malloc_supported()):
    return
  env = dict(os.environ)
  env["GLIBC_TUNABLES"] = ":".join(
      t for t in (env.get("GLIBC_TUNABLES", ""), _TUNABLE) if t)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, env)


# ----------------------------------------------------------------------------
# JAX's persistent compilation cache.
# ----------------------------------------------------------------------------

# Where the command-line jobs keep compiled programs unless told otherwise:
# a path, or "off" ("" too); tests set it to "off" (tests/conftest.py).
CACHE_ENV = "CIRCLE_JAX_COMPILATION_CACHE"
CACHE_OFF = ("", "off")
# Every program is kept, however fast it compiles: the digits job compiles
# 88 programs, 77 of them in under 0.2 s each but 6 s together on the 2-core
# machine, and all of them fit in under 1 MB (docs/performance.md).
CACHE_MIN_COMPILE_SECONDS = 0.0
# The least recently used programs are deleted beyond this size.
CACHE_MAX_BYTES = 4 << 30


def default_compilation_cache_dir() -> str:
  """``$CIRCLE_JAX_COMPILATION_CACHE``, else the user's cache folder.

  ``$XDG_CACHE_HOME/circle_jax/compilation`` (``~/.cache/circle_jax/
  compilation`` when ``XDG_CACHE_HOME`` is unset); "off" when the variable
  says so.
  """
  if CACHE_ENV in os.environ:
    return os.environ[CACHE_ENV]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return os.path.join(base, "circle_jax", "compilation")


def enable_compilation_cache(directory: Optional[str] = None
                             ) -> Optional[str]:
  """Turns on JAX's persistent compilation cache for this process.

  A second run of the same job then loads its compiled train and evaluation
  steps from disk instead of compiling them again (see docs/performance.md).
  Call it before the first compilation (first thing in a tool's main).

  Args:
    directory: the cache folder; None: :func:`default_compilation_cache_dir`;
      "" or "off": leave the cache off.

  Returns:
    The folder used, or None when the cache stays off.
  """
  if directory is None:
    directory = default_compilation_cache_dir()
  if directory.strip().lower() in CACHE_OFF:
    return None
  directory = os.path.abspath(os.path.expanduser(directory))
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    CACHE_MIN_COMPILE_SECONDS)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
  return directory
