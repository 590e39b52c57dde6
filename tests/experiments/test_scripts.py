"""Every experiment script runs as a file: ``python experiments/X.py --help``.

With ``PYTHONPATH`` cleaned of this repository and the working directory
outside it, ``experiments`` can only be imported through the script's own
path bootstrap (``if __package__ in (None, ""): sys.path.insert(...)``), so
a script without it fails here; and the bootstrap must come before the
first top-level import of this repository's packages (``circle_jax`` may
also be importable from an installed copy, which must not win). ``main.py`` has its own test
(``test_main.py``); modules without a ``__main__`` block are libraries.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p.name for p in (REPO / "experiments").glob("*.py")
    if p.name != "main.py" and 'if __name__ == "__main__":' in p.read_text())


def test_the_scripts_are_found():
  assert {"compare.py", "sweep.py", "circle_figures.py", "check_readme.py",
          "bench_losses.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_runs_as_a_file(script, tmp_path):
  text = (REPO / "experiments" / script).read_text()
  boot = text.find('if __package__ in (None, ""):')
  first = re.search(r"^(from|import) (experiments|circle_jax)\b", text, re.M)
  assert boot >= 0 and (first is None or boot < first.start()), script
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  path = os.environ.get("PYTHONPATH", "")
  kept = [p for p in path.split(os.pathsep)
          if p and pathlib.Path(p).resolve() != REPO]
  if kept:
    env["PYTHONPATH"] = os.pathsep.join(kept)
  proc = subprocess.run(
      [sys.executable, str(REPO / "experiments" / script), "--help"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
      check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "usage" in proc.stdout.lower(), proc.stdout[-3000:]
