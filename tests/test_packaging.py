"""The package installs from pyproject.toml, with or without setup.py's habits.

``pip install .``, ``pip install -e .`` and ``python setup.py --version``
all work; pyproject.toml is the one place of the metadata. The installs run
on a copy of the sources (a build writes into its source folder) with
``--no-deps --no-build-isolation``: nothing is downloaded.
"""

import os
import shutil
import subprocess
import sys
import tomllib

import pytest

# Slow (pip installs into fresh venvs): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE",
           "requirements.txt", "circle_jax")


def _version():
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]["version"]


@pytest.fixture
def source(tmp_path):
  """A copy of what a source distribution holds."""
  src = tmp_path / "src"
  src.mkdir()
  for name in SOURCES:
    path = os.path.join(REPO, name)
    if os.path.isdir(path):
      shutil.copytree(path, src / name,
                      ignore=shutil.ignore_patterns("__pycache__"))
    else:
      shutil.copy(path, src / name)
  return src


def _run(cmd, cwd, **env):
  proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, **env))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  return proc.stdout


def _where(python, tmp_path, **env):
  """Where ``python`` imports circle_jax from, run outside any checkout."""
  out = _run([python, "-c", "import circle_jax, os; "
              "print(os.path.dirname(circle_jax.__file__))"],
             cwd=tmp_path, **env)
  return out.strip().splitlines()[-1]


def test_setup_py_version_is_pyprojects(source):
  out = _run([sys.executable, "setup.py", "--version"], cwd=source)
  assert out.strip().splitlines()[-1] == _version()


def test_pip_install_dot_installs_the_package_and_its_data(source, tmp_path):
  target = tmp_path / "site"
  _run([sys.executable, "-m", "pip", "install", "--no-deps",
        "--no-build-isolation", "--no-input", "--target", str(target), "."],
       cwd=source)
  pkg = _where(sys.executable, tmp_path, PYTHONPATH=str(target))
  assert pkg == str(target / "circle_jax")
  assert os.path.exists(os.path.join(pkg, "py.typed"))
  assert os.path.exists(os.path.join(
      pkg, "data", "archives", "omniglot_small",
      "images_background_small1.zip"))
  dist = [d for d in os.listdir(target) if d.endswith(".dist-info")]
  assert dist == [f"circle_jax-{_version()}.dist-info"]


def test_pip_install_editable_imports_the_source_folder(source, tmp_path):
  venv = tmp_path / "venv"
  # Without its own pip and setuptools (ensurepip's are older than the
  # pinned ones): this interpreter's pip installs into it, and the build
  # uses the setuptools it sees through --system-site-packages.
  _run([sys.executable, "-m", "venv", "--system-site-packages",
        "--without-pip", str(venv)], cwd=tmp_path)
  python = str(venv / "bin" / "python")
  _run([sys.executable, "-m", "pip", "--python", python, "install",
        "--no-deps", "--no-build-isolation", "--no-input", "-e", "."],
       cwd=source)
  env = {"PYTHONPATH": ""}
  assert _where(python, tmp_path, **env) == str(source / "circle_jax")
