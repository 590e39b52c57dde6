"""The package installs from pyproject.toml, with or without setup.py's habits.

``pip install .``, ``pip install -e .`` and ``python setup.py --version``
all work; pyproject.toml is the one place of the metadata. The installs run
on a copy of the sources (a build writes into its source folder) with
``--no-deps``, and build with the setuptools that pyproject.toml's
``build-system.requires`` asks for, installed from the package index into a
venv of their own: never the setuptools of the interpreter that runs the
tests, nor of the Python its venv was made from (a fresh Python 3.11 venv
holds setuptools 65, which rejects pyproject.toml's SPDX ``license``).
"""

import os
import shutil
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

# Slow (pip installs into fresh venvs): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE",
           "requirements.txt", "circle_jax")


def _pyproject():
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def _version():
  return _pyproject()["project"]["version"]


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


def _pip(python, *args, cwd):
  """This interpreter's pip, installing for ``python`` (pip's --python)."""
  return _run([sys.executable, "-m", "pip", "--python", python, "install",
               "--no-input", *args], cwd=cwd)


@pytest.fixture
def build_python(tmp_path):
  """A venv's python holding pyproject.toml's build requirements only.

  No --system-site-packages: the base interpreter's setuptools stays out.
  The builds below use it with --no-build-isolation, so the setuptools
  that builds is the one installed here.
  """
  venv = tmp_path / "build-venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
       cwd=tmp_path)
  python = str(venv / "bin" / "python")
  _pip(python, *_pyproject()["build-system"]["requires"], cwd=tmp_path)
  return python


def _where(python, tmp_path, **env):
  """Where ``python`` imports circle_jax from, run outside any checkout."""
  out = _run([python, "-c", "import circle_jax, os; "
              "print(os.path.dirname(circle_jax.__file__))"],
             cwd=tmp_path, **env)
  return out.strip().splitlines()[-1]


def test_the_build_venv_has_the_setuptools_pyproject_requires(build_python,
                                                              tmp_path):
  """Else the tests below would build with some other setuptools."""
  out = _run([build_python, "-c", "import setuptools; "
              "print(setuptools.__file__, setuptools.__version__)"],
             cwd=tmp_path)
  where, version = out.split()
  assert where.startswith(str(tmp_path / "build-venv"))
  (wanted,) = [r for r in map(Requirement,
                              _pyproject()["build-system"]["requires"])
               if r.name == "setuptools"]
  assert wanted.specifier.contains(version), (version, str(wanted))


def test_setup_py_version_is_pyprojects(source, build_python):
  out = _run([build_python, "setup.py", "--version"], cwd=source)
  assert out.strip().splitlines()[-1] == _version()


def test_pip_install_dot_installs_the_package_and_its_data(
    source, build_python, tmp_path):
  target = tmp_path / "site"
  _pip(build_python, "--no-deps", "--no-build-isolation", "--target",
       str(target), ".", cwd=source)
  pkg = _where(build_python, tmp_path, PYTHONPATH=str(target))
  assert pkg == str(target / "circle_jax")
  assert os.path.exists(os.path.join(pkg, "py.typed"))
  for folder, name in (("omniglot_small", "images_background_small1.zip"),
                       ("omniglot_oneshot", "all_runs.zip")):
    assert os.path.exists(os.path.join(pkg, "data", "archives", folder, name))
  dist = [d for d in os.listdir(target) if d.endswith(".dist-info")]
  assert dist == [f"circle_jax-{_version()}.dist-info"]


def test_pip_install_editable_imports_the_source_folder(
    source, build_python, tmp_path):
  _pip(build_python, "--no-deps", "--no-build-isolation", "-e", ".",
       cwd=source)
  assert _where(build_python, tmp_path, PYTHONPATH="") == str(
      source / "circle_jax")
