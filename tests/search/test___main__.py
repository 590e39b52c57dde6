"""``python -m circle_jax.search`` (circle_jax/search/__main__.py): the entry
point runs the CLI and hands its exit status to the shell. The commands
themselves are specified end to end in test_cli.py."""

import subprocess
import sys


def _module(*args):
  return subprocess.run([sys.executable, "-m", "circle_jax.search", *args],
                        capture_output=True, text=True, timeout=120)


def test_help_lists_the_commands_and_exits_0():
  proc = _module("--help")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("usage: python -m circle_jax.search")
  for command in ("build", "add", "remove", "query", "calibrate", "match",
                  "info"):
    assert command in proc.stdout


def test_exit_status_of_the_cli_reaches_the_shell(tmp_path):
  assert _module().returncode == 2          # no command: a usage error
  missing = tmp_path / "none.index"
  proc = _module("info", "--index", str(missing))
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      f"error: {missing}: no such index file; build one with "
      "`python -m circle_jax.search build`."]
