"""Specification of circle_jax/hostenv.py: the machine and malloc setting."""

import os
import subprocess
import sys

import pytest

from circle_jax import hostenv


def test_describe_names_cpus_model_jax_load_and_malloc(monkeypatch):
  monkeypatch.setattr(hostenv, "cpu_model", lambda: "Test CPU 9000")
  monkeypatch.setattr(hostenv, "num_cpus", lambda: 3)
  monkeypatch.setattr(hostenv, "accelerators", lambda: "")
  monkeypatch.setattr(hostenv, "load_average", lambda: 1.25)
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  import jax  # pylint: disable=g-import-not-at-top
  assert hostenv.describe() == (
      f"3 CPUs (nproc), Test CPU 9000; jax {jax.__version__}, "
      f"{jax.devices()[0].device_kind} ({jax.default_backend()}); "
      "1-min load average 1.2; malloc: default (4 KiB pages)")
  monkeypatch.setattr(hostenv, "accelerators", lambda: "NVIDIA H100")
  assert hostenv.describe(with_jax=False) == (
      "3 CPUs (nproc), Test CPU 9000; GPUs: NVIDIA H100; 1-min load average "
      "1.2; malloc: default (4 KiB pages)")


def test_machine_info_is_what_nproc_and_cpuinfo_say():
  info = hostenv.machine_info()
  assert set(info) == {"nproc", "cpu", "accelerators"}
  assert info["nproc"] == len(os.sched_getaffinity(0))
  assert info["cpu"] and isinstance(info["cpu"], str)
  assert hostenv.cpu_text(info) == f"{info['nproc']} CPUs (nproc), {info['cpu']}"


def test_reexec_is_a_no_op_when_disabled_or_already_set(monkeypatch):
  calls = []
  monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
  hostenv.reexec_with_hugepage_malloc()
  assert hostenv.hugepage_malloc_active()
  assert "huge pages" in hostenv.malloc_setting()
  monkeypatch.delenv("GLIBC_TUNABLES")
  hostenv.reexec_with_hugepage_malloc(disabled=True)
  monkeypatch.setenv("CIRCLE_JAX_NO_HUGEPAGES", "1")
  hostenv.reexec_with_hugepage_malloc()
  assert calls == []
  assert hostenv.malloc_setting() == "malloc: default (4 KiB pages)"


@pytest.mark.skipif(not hostenv.hugepage_malloc_supported(),
                    reason="needs glibc >= 2.35")
def test_reexec_appends_the_tunable_and_keeps_the_command(monkeypatch):
  calls = []
  monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
  monkeypatch.delenv("CIRCLE_JAX_NO_HUGEPAGES", raising=False)
  monkeypatch.setattr(hostenv, "hugepage_malloc_active", lambda: False)
  hostenv.reexec_with_hugepage_malloc()
  (exe, argv, env), = calls
  assert exe == sys.executable and argv == sys.orig_argv
  assert env["GLIBC_TUNABLES"] == (
      "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1")


# ----------------------------------------------------------------------------
# The persistent compilation cache.
# ----------------------------------------------------------------------------


def test_the_cache_folder_is_the_users_unless_told(monkeypatch, tmp_path):
  monkeypatch.delenv(hostenv.CACHE_ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert hostenv.default_compilation_cache_dir() == str(
      tmp_path / "xdg" / "circle_jax" / "compilation")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert hostenv.default_compilation_cache_dir() == str(
      tmp_path / "home" / ".cache" / "circle_jax" / "compilation")
  monkeypatch.setenv(hostenv.CACHE_ENV, "off")
  assert hostenv.default_compilation_cache_dir() == "off"


def test_off_leaves_jax_alone(monkeypatch):
  # None reads the variable (the tests' jobs otherwise share a cache folder,
  # tests/conftest.py).
  monkeypatch.setenv(hostenv.CACHE_ENV, "off")
  import jax  # pylint: disable=g-import-not-at-top
  before = jax.config.jax_compilation_cache_dir
  for off in (None, "", "off", "OFF"):
    assert hostenv.enable_compilation_cache(off) is None
  assert jax.config.jax_compilation_cache_dir == before


_COMPILE_TWICE = """
import sys
from jax import monitoring
hits = []
monitoring.register_event_listener(
    lambda e, **kw: hits.append(e) if e.endswith("/cache_hits") else None)
from circle_jax import hostenv
used = hostenv.enable_compilation_cache(sys.argv[1])
import jax, jax.numpy as jnp
@jax.jit
def f(x):
  for i in range(30):
    x = jnp.tanh(x @ x.T + i)
  return x
f(jnp.ones((8, 8))).block_until_ready()
print(used, len(hits))
"""


@pytest.mark.slow  # two processes compile
def test_a_second_process_loads_its_programs_from_the_cache(tmp_path):
  cache = tmp_path / "cache"
  env = dict(os.environ, JAX_PLATFORMS="cpu")

  def run():
    proc = subprocess.run([sys.executable, "-c", _COMPILE_TWICE, str(cache)],
                          capture_output=True, text=True, env=env,
                          timeout=300, cwd=os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    used, hits = proc.stdout.split()
    assert used == str(cache)
    return int(hits)

  assert run() == 0
  assert len(os.listdir(cache)) >= 1     # the compiled program, on disk
  assert run() >= 1                      # served from it


@pytest.mark.slow
def test_a_fresh_install_runs_the_digits_job_without_warnings(tmp_path):
  """The digits job, twice on one compilation cache (the second run reads
  its entries): stderr holds progress lines and no warning. Without the
  ``filelock`` package, JAX warned on every read: 'Error reading persistent
  compilation cache entry ... Please install the filelock package to set
  jax_compilation_cache_max_size' (requirements.txt now pins it)."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
             TFDS_DATA_DIR=str(tmp_path / "tfds"))
  for run in ("first", "second"):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.main",
         "--config=experiments/configs/digits.py",
         f"--workdir={tmp_path / run}", "--config.num_train_steps=2",
         "--config.eval_at_init=false", "--config.eval_clustering=false",
         f"--config.compilation_cache_dir={tmp_path / 'cache'}"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    noisy = [line for line in proc.stderr.splitlines()
             if "warn" in line.lower() or "error" in line.lower()]
    assert not noisy, (run, noisy)
  assert os.listdir(tmp_path / "cache")  # the second run read these


def test_filelock_is_a_pinned_runtime_requirement():
  """JAX's persistent compilation cache needs it (its size limit), and the
  datasets' preparation lock uses it; torch brought it into the test
  install only, which hid its absence from requirements.txt."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(repo, "requirements.txt")) as f:
    pins = [line.split("#")[0].strip() for line in f]
  import filelock  # pylint: disable=g-import-not-at-top
  assert f"filelock=={filelock.__version__}" in pins
