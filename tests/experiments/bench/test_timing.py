"""Specification of experiments/bench/timing.py (what benchmarks share)."""

import time

import jax.numpy as jnp
import pytest

from experiments.bench import timing


def test_call_times_counts_warmup_and_timed_calls():
  calls = []
  times = timing.call_times(lambda: calls.append(1) or jnp.ones(3), 2, 4)
  assert len(calls) == 6 and len(times) == 4
  assert all(t >= 0 for t in times)


def test_call_times_stops_at_a_call_over_budget():
  slow = lambda: (time.sleep(0.02), ())[1]
  # A slow warm-up call is the only time; a slow timed call is the last one.
  assert len(timing.call_times(slow, 1, 5, budget_s=0.01)) == 1
  calls = []
  def slow_timed():
    calls.append(1)
    if len(calls) > 1:
      time.sleep(0.02)
    return ()
  times = timing.call_times(slow_timed, 1, 5, budget_s=0.01)
  assert len(times) == 1 and times[0] >= 0.02


def test_compiled_memory_counts_arguments_outputs_and_temporaries():
  import jax  # pylint: disable=g-import-not-at-top
  x = jnp.ones((256, 256), jnp.float32)
  compiled = jax.jit(lambda a: (a @ a).sum()).lower(x).compile()
  mem = timing.compiled_memory(compiled)
  if mem is None:
    return  # the backend gives no analysis
  assert mem["peak"] >= 256 * 256 * 4 + 4  # the argument and the output
  assert 0 <= mem["temp"] <= mem["peak"]


def test_parser_has_the_common_flags(tmp_path):
  p = timing.parser("Title line.\n\nMore.", repeats=7, out="results file",
                    compilation_cache=True)
  assert p.description == "Title line."
  args = p.parse_args(["--output", str(tmp_path / "a.md")])
  assert args.repeats == 7 and args.out == str(tmp_path / "a.md")
  assert not args.no_hugepages and args.compilation_cache is None
  args = p.parse_args(["--out", "b.md", "--repeats", "2", "--no-hugepages",
                       "--compilation-cache", "/c"])
  assert (args.out, args.repeats, args.no_hugepages,
          args.compilation_cache) == ("b.md", 2, True, "/c")
  bare = timing.parser("T.", hugepages=False)
  assert not hasattr(bare.parse_args([]), "repeats")
  with pytest.raises(SystemExit):
    bare.parse_args(["--no-hugepages"])


def test_write_table_prints_and_writes(tmp_path, capsys):
  out = tmp_path / "sub" / "t.md"
  timing.write_table("| a |\n", out)
  assert out.read_text() == "| a |\n"
  assert "| a |" in capsys.readouterr().out
  timing.write_table("x\n", "")  # no file: printed only
  assert capsys.readouterr().out == "x\n\n"


def test_machine_line_is_the_hosts_description(monkeypatch):
  from circle_jax import hostenv  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(hostenv, "describe", lambda: "2 CPUs (nproc), X")
  assert timing.machine_line() == "Machine: 2 CPUs (nproc), X."


def test_command_line_is_the_module_form_with_the_arguments(monkeypatch):
  assert timing.command_line("experiments.bench.losses",
                             ["--losses", "circle", "--out", "a b.md"]) == (
                                 "python -m experiments.bench.losses "
                                 "--losses circle --out 'a b.md'")
  # Without argv: the process' own arguments, not its script path.
  monkeypatch.setattr("sys.argv", ["/abs/experiments/bench/x.py", "--n", "2"])
  assert timing.command_line("experiments.bench.x") == (
      "python -m experiments.bench.x --n 2")


def test_child_command_reruns_the_module_from_the_repository_root():
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  cmd = timing.child_command("experiments.bench.matmul", "--help")
  assert cmd == [sys.executable, "-m", "experiments.bench.matmul", "--help"]
  assert (timing.REPO / "experiments" / "bench" / "matmul.py").exists()
  proc = subprocess.run(cmd, cwd=timing.REPO, capture_output=True,
                        text=True, timeout=300, check=False)
  assert proc.returncode == 0 and "usage" in proc.stdout, proc.stderr
