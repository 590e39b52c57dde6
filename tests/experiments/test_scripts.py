"""experiments/ as a reader meets it: scripts sorted by purpose, each run as
``python -m experiments.<folder>.<name>``, shared code in modules that are
not scripts, results named after the script that writes them.

A script is a module with a ``__main__`` block; ``experiments/main.py`` (the
main job) and ``experiments/sweep.py`` (the one launcher called sweep) sit at
the top, the others in a folder named for their purpose. ``main.py`` has its
own tests (``test_main.py``).
"""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "experiments"
FOLDERS = ("bench", "compare", "figures", "tools")
TOP_SCRIPTS = ("main", "sweep")


def _modules():
  """``{dotted name: path}`` of every module of experiments/ but configs."""
  return {".".join(p.relative_to(REPO).with_suffix("").parts): p
          for p in sorted(EXPERIMENTS.rglob("*.py"))
          if p.name != "__init__.py" and "configs" not in p.parts}


def _is_script(path) -> bool:
  return 'if __name__ == "__main__":' in path.read_text()


SCRIPTS = sorted(m for m, p in _modules().items() if _is_script(p))


def test_scripts_are_sorted_into_folders_by_purpose():
  assert {"experiments.bench.losses", "experiments.compare.losses",
          "experiments.figures.circle_loss",
          "experiments.tools.check_readme", "experiments.sweep",
          "experiments.main"} <= set(SCRIPTS)
  for name in SCRIPTS:
    parts = name.split(".")[1:]
    assert (parts[0] in FOLDERS and len(parts) == 2) or (
        parts[0] in TOP_SCRIPTS and len(parts) == 1), name
  # Within a folder a script is not named after it again (bench/losses.py,
  # not bench/bench_losses.py).
  assert not [n for n in SCRIPTS if n.split(".")[-1].startswith(
      tuple(f"{f}_" for f in FOLDERS))]
  for folder in FOLDERS:
    assert (EXPERIMENTS / folder / "__init__.py").exists(), folder


def test_no_path_bootstrap_and_no_late_imports():
  bad = [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
         for p in sorted(EXPERIMENTS.rglob("*.py"))
         for i, line in enumerate(p.read_text().splitlines(), 1)
         if "sys.path" in line or "noqa: E402" in line
         or "__package__" in line]
  assert not bad, "\n".join(bad)
  pyproject = (REPO / "pyproject.toml").read_text()
  assert '"experiments/' not in pyproject.split("per-file-ignores")[-1]


def _imported_experiments_modules(path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module == "experiments" or node.module.startswith(
            "experiments.")):
      for alias in node.names:
        yield f"{node.module}.{alias.name}"
        yield node.module
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("experiments."):
          yield alias.name


def test_scripts_import_no_other_script():
  """Code two scripts share lives in a module that is not a script."""
  modules = _modules()
  bad = []
  for name, path in modules.items():
    for imported in set(_imported_experiments_modules(path)):
      if imported in modules and imported != name and _is_script(
          modules[imported]):
        bad.append(f"{name} imports the script {imported}")
  assert not bad, "\n".join(bad)


def test_the_package_never_imports_experiments():
  bad = [str(p.relative_to(REPO)) for p in (REPO / "circle_jax").rglob("*.py")
         if re.search(r"^\s*(from|import) experiments\b", p.read_text(),
                      re.M)]
  assert not bad


def test_results_are_named_after_the_script_that_writes_them():
  """``results/<folder>/<script>_*`` for a script of ``experiments/<folder>/``
  (``results/<script>_*`` for the top-level ones)."""
  results = EXPERIMENTS / "results"
  bad = []
  for entry in sorted(results.iterdir()):
    if entry.is_dir() and entry.name in FOLDERS:
      scripts = [n.split(".")[-1] for n in SCRIPTS
                 if n.startswith(f"experiments.{entry.name}.")]
      names = [p.name for p in entry.iterdir()]
    else:
      scripts, names = list(TOP_SCRIPTS), [entry.name]
    for name in names:
      if not any(re.match(rf"{s}(_|\.|$)", name) for s in scripts):
        bad.append(f"{entry.relative_to(results)}: {name}")
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("script", [s for s in SCRIPTS
                                    if s != "experiments.main"])
def test_script_starts_with_help(script):
  proc = subprocess.run([sys.executable, "-m", script, "--help"], cwd=REPO,
                        capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "usage" in proc.stdout.lower(), proc.stdout[-3000:]
