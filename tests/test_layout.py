"""tests/ mirrors circle_jax/: every module ``circle_jax/a/b.py`` has its test
file ``tests/a/test_b.py``, save the exceptions listed, each with its reason,
in the section "Modules without a mirrored test file" of docs/architecture.md.
"""

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SECTION = "## Modules without a mirrored test file"


def mirrored_test(module: str) -> str:
  """``circle_jax/a/b.py`` -> ``tests/a/test_b.py`` (paths from the root)."""
  path = pathlib.PurePosixPath(module)
  assert path.parts[0] == "circle_jax" and path.suffix == ".py", module
  return str(pathlib.PurePosixPath("tests", *path.parts[1:-1],
                                   "test_" + path.name))


def modules(root: pathlib.Path = REPO):
  """Every module of the package but ``__init__.py``, sorted."""
  return sorted(str(p.relative_to(root).as_posix())
                for p in (root / "circle_jax").rglob("*.py")
                if p.name != "__init__.py")


def listed_exceptions(text: str):
  """The ``- `circle_jax/....py`: reason`` items of the section, in order."""
  _, found, rest = text.partition("\n" + SECTION + "\n")
  assert found, f"docs/architecture.md has no section {SECTION!r}"
  body = re.split(r"\n## ", rest, maxsplit=1)[0]
  items = re.findall(r"^- `(circle_jax/[^`]+\.py)`(.*)$", body, re.M)
  for module, reason in items:
    assert reason.strip(" :"), f"{module} is listed without a reason"
  return [module for module, _ in items]


def test_mirrored_test_paths_by_hand():
  assert mirrored_test("circle_jax/ops.py") == "tests/test_ops.py"
  assert mirrored_test("circle_jax/train/run.py") == "tests/train/test_run.py"
  assert mirrored_test("circle_jax/losses/engine/ring.py") == (
      "tests/losses/engine/test_ring.py")
  assert "circle_jax/train/run.py" in modules()
  assert not any(m.endswith("__init__.py") for m in modules())


def test_listed_exceptions_parse_and_need_a_reason():
  text = (f"# A\n\n{SECTION}\n\nWhy.\n\n- `circle_jax/x.py`: only a "
          "`__main__`\n- `circle_jax/a/y.py` (a type alias)\n\n## Next\n\n"
          "- `circle_jax/z.py`: another section\n")
  assert listed_exceptions(text) == ["circle_jax/x.py", "circle_jax/a/y.py"]
  with pytest.raises(AssertionError, match="circle_jax/x.py is listed "
                     "without a reason"):
    listed_exceptions(f"\n{SECTION}\n\n- `circle_jax/x.py`\n")


def test_every_module_has_its_test_file_or_is_a_listed_exception():
  missing = [m for m in modules() if not (REPO / mirrored_test(m)).is_file()]
  listed = listed_exceptions(
      (REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
  assert len(listed) == len(set(listed)), "a module is listed twice"
  untested = [f"{m} (write {mirrored_test(m)})" for m in missing
              if m not in listed]
  stale = [m for m in listed if m not in missing]
  assert not untested and not stale, (
      "tests/ must mirror circle_jax/. Modules without their test file: "
      f"{untested or 'none'}; listed in docs/architecture.md ({SECTION!r}) "
      f"but no longer exceptions (remove them): {stale or 'none'}.")
