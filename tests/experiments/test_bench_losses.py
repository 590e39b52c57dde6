"""Smoke test of the loss benchmark script and its host settings."""

import os
import sys

import pytest

from experiments import bench_losses
from experiments import hostenv


def test_bench_losses_writes_a_table_with_the_floor_ratio(tmp_path):
  out = tmp_path / "bench.md"
  bench_losses.main([
      "--losses", "circle,proxy_anchor", "--batch-sizes", "16",
      "--dtypes", "float32", "--no-torch", "--warmup", "1", "--repeats", "1",
      "--out", str(out)])
  text = out.read_text()
  assert "malloc:" in text
  rows = [l for l in text.splitlines() if l.startswith("| circle |")
          or l.startswith("| proxy_anchor |")]
  assert len(rows) == 2
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[4]) > 0  # fwd+bwd ms
    assert float(cells[9]) > 0  # ratio to the floor


def test_reexec_is_a_no_op_when_disabled_or_already_set(monkeypatch):
  calls = []
  monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
  monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
  hostenv.reexec_with_hugepage_malloc()
  assert hostenv.hugepage_malloc_active()
  assert "huge pages" in hostenv.describe()
  monkeypatch.delenv("GLIBC_TUNABLES")
  hostenv.reexec_with_hugepage_malloc(disabled=True)
  monkeypatch.setenv("CIRCLE_JAX_NO_HUGEPAGES", "1")
  hostenv.reexec_with_hugepage_malloc()
  assert calls == []
  assert hostenv.describe() == "malloc: default (4 KiB pages)"


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or not hostenv._glibc_supports_hugetlb(),
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
