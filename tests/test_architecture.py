"""docs/architecture.md names every module of the package, and every
``circle_jax`` name in backticks in the docs and the README exists."""

import pathlib
import re

import pytest

from circle_jax import pml_names

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "circle_jax"
ARCHITECTURE = REPO / "docs" / "architecture.md"
DOCUMENTS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]

# Inline code spans and fenced blocks, and in them a dotted name or a path of
# the package (not part of a longer name or path: `experiments/circle_jax.x`).
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
DOTTED = re.compile(r"(?<![\w./])circle_jax(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w./])circle_jax/[\w/.]*")


def modules():
  """Every module of the package, as a path from the repository root."""
  return sorted(str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py"))


def rooms(text: str):
  """The module paths that the first column of the rooms table names.

  A cell names paths from the repository root (``circle_jax/train/step.py``)
  and, after one, paths relative to its folder (``checkpoint.py``,
  ``builders/base.py``); a package is named by its ``__init__.py``.
  """
  section = text.split("## The rooms", 1)[1].split("\n## ", 1)[0]
  named = []
  for line in section.splitlines():
    if not line.startswith("| `"):
      continue
    folder = None
    for token in re.findall(r"`([^`]+)`", line.split(" | ", 1)[0]):
      if token.startswith("circle_jax/") or folder is None:
        folder = str(pathlib.PurePosixPath(token).parent)
        named.append(token)
      else:
        named.append(f"{folder}/{token}")
  return named


def code_names(pattern):
  """``(document, name)`` for every match of ``pattern`` in a code span."""
  out = []
  for doc in DOCUMENTS:
    for span in CODE.finditer(doc.read_text(encoding="utf-8")):
      out += [(str(doc.relative_to(REPO)), n.rstrip("."))
              for n in pattern.findall(span.group())]
  return sorted(set(out))


def test_the_rooms_table_names_every_module():
  named = rooms(ARCHITECTURE.read_text(encoding="utf-8"))
  missing = [m for m in modules() if m not in named]
  assert not missing, (
      "docs/architecture.md's rooms table does not name these modules (add "
      "each to the row of its room): " + ", ".join(missing))


def test_the_rooms_table_names_no_module_that_is_gone():
  gone = [m for m in rooms(ARCHITECTURE.read_text(encoding="utf-8"))
          if "<" not in m and not (REPO / m).exists()]
  assert not gone, f"docs/architecture.md names missing files: {gone}"


def test_the_rules_read_a_table_as_documented():
  text = ("## The rooms\n\n| room | owns |\n| --- | --- |\n"
          "| `circle_jax/train/a.py`, `b.py`, `x/__init__.py` | `c.py` |\n"
          "| `circle_jax/ops.py` | |\n\n## Next\n| `circle_jax/d.py` | |\n")
  assert rooms(text) == ["circle_jax/train/a.py", "circle_jax/train/b.py",
                         "circle_jax/train/x/__init__.py", "circle_jax/ops.py"]
  assert "circle_jax/losses/__init__.py" in modules()
  assert len(code_names(DOTTED)) > 20  # the docs do name the package's code


@pytest.mark.parametrize("doc, name", code_names(DOTTED))
def test_a_dotted_name_in_the_docs_resolves(doc, name):
  try:
    pml_names.resolve(name)
  except (ImportError, AttributeError) as e:
    pytest.fail(f"{doc}: `{name}` does not resolve ({e}); rename or remove "
                "it.")


@pytest.mark.parametrize("doc, path", code_names(PATH))
def test_a_package_path_in_the_docs_exists(doc, path):
  assert (REPO / path).exists(), f"{doc}: `{path}` does not exist."


def test_a_stale_name_is_caught():
  with pytest.raises(AttributeError):
    pml_names.resolve("circle_jax.ops.two_set_logsumexp")
  with pytest.raises(AttributeError):
    pml_names.resolve("circle_jax.losses.no_such_module.f")
  assert pml_names.resolve("circle_jax.ops.two_set_exp").__name__ == (
      "two_set_exp")
