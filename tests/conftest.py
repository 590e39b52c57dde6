"""Test setup: 8 simulated CPU devices, set before JAX is imported."""

import os
import pathlib
import shutil
import tempfile

import pytest

# The tests compile many hundreds of small programs and run each a few times:
# most of their time is XLA compiling, and most of that is the CPU backend's
# LLVM optimisation, which buys nothing at these sizes. With it off the tests
# take about a third less CPU (tests/losses/test_pinned.py and
# tests/losses/engine/test_sides.py: 130 -> 89 s of CPU). The fused loops
# are then emitted by XLA's elemental IR emitter instead of its newer MLIR
# fusion emitters, whose compile costs more CPU than the small programs
# run: the whole suite took 44 min of CPU (24 min wall) with them and 30 min
# (16.6 min wall) without, on this project's 2-core Xeon (jax 0.10.2). The
# programs and their semantics are XLA's same HLO, optimised the same way
# above the code generator. The jobs the tests start with their own
# XLA_FLAGS (bitwise-pinned metrics) compile as users' do.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0"
    " --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
# The jobs the tests start (python -m experiments.main ...) share one JAX
# persistent compilation cache, new for each test session (a fresh folder
# under the system's temporary directory, made by the first pytest process
# and inherited by its xdist workers): the fault tests start the same job
# dozens of times, and every start after the first loads its programs
# instead of compiling them. It never touches the user's cache folder;
# tests/test_hostenv.py sets its own.
_MADE_CACHE = not os.environ.get("CIRCLE_JAX_TEST_CACHE")
if _MADE_CACHE:
  os.environ["CIRCLE_JAX_TEST_CACHE"] = tempfile.mkdtemp(
      prefix="circle_jax_test_cache_")
os.environ["CIRCLE_JAX_COMPILATION_CACHE"] = os.environ["CIRCLE_JAX_TEST_CACHE"]

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
OMNIGLOT_DIR = REPO_ROOT / "circle_jax" / "data" / "archives" / "omniglot_small"


def pytest_sessionfinish(session, exitstatus):
  """The process that made the session's compilation cache removes it."""
  del session, exitstatus
  if _MADE_CACHE and "PYTEST_XDIST_WORKER" not in os.environ:
    shutil.rmtree(os.environ["CIRCLE_JAX_TEST_CACHE"], ignore_errors=True)


@pytest.fixture(scope="session")
def omniglot_dir():
  """The official Omniglot 'background small' archives shipped in the repo."""
  assert (OMNIGLOT_DIR / "images_background_small1.zip").exists(), OMNIGLOT_DIR
  return OMNIGLOT_DIR


@pytest.fixture(scope="module")
def module_compilation_cache(tmp_path_factory):
  """A JAX persistent compilation cache shared by one test module's runs.

  In-process jobs of a module build fresh jitted functions for every run, so
  only this cache lets a run reuse the programs an earlier one compiled (the
  evaluation's embedding, a loss's step under another workdir). Use it with
  ``pytestmark = pytest.mark.usefixtures("module_compilation_cache")``.
  """
  import jax  # after the XLA flags above
  from jax.experimental.compilation_cache import compilation_cache
  names = ("jax_compilation_cache_dir",
           "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  saved = [getattr(jax.config, name) for name in names]
  for name, value in zip(names, (str(tmp_path_factory.mktemp("jax_cache")),
                                 0.0, 0)):
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  yield
  for name, value in zip(names, saved):
    jax.config.update(name, value)
  compilation_cache.reset_cache()
