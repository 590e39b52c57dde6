"""The README's and the docs' generated tables equal the registry's, and the
documents cite sources as a bibliography would (the table generator itself:
tests/test_docs_tables.py)."""

import pathlib
import re

import pytest

from circle_jax import docs_tables

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", docs_tables.documents(REPO),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_generated_tables_are_up_to_date(path):
  text = path.read_text(encoding="utf-8")
  assert docs_tables.regenerate(text) == text, (
      f"{path.relative_to(REPO)}: a generated table differs from the loss "
      f"registry; run `{docs_tables.COMMAND}` and commit the result.")


@pytest.mark.parametrize("path, spec", [
    ("README.md", "readme-losses"),
    ("docs/losses.md", "losses"),
    ("docs/losses_circle_ms.md", "calls circle_loss "),
    ("docs/losses_rll_proxy.md", "calls ranked_list_loss "),
])
def test_the_loss_tables_are_generated(path, spec):
  text = (REPO / path).read_text(encoding="utf-8")
  assert f"<!-- generated: {docs_tables.COMMAND} {spec}" in text


# Sources are named as a bibliography would (authors, title, venue, year),
# never by the tracker issue or the task that introduced them.
_NOT_SOURCES = re.compile(
    r"issue #\d+|\(#\d+\)|seed 0\d\d|seed paper|seed's", re.I)


def _prose_files():
  yield REPO / "README.md"
  yield from sorted((REPO / "docs").glob("*.md"))
  yield from sorted((REPO / "experiments" / "results").rglob("*.md"))


@pytest.mark.parametrize("path", list(_prose_files()),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_issue_numbers_or_seed_wording_as_sources(path):
  lines = path.read_text(encoding="utf-8").splitlines()
  bad = [f"{path.relative_to(REPO)}:{i}: {line.strip()}"
         for i, line in enumerate(lines, 1) if _NOT_SOURCES.search(line)]
  assert not bad, "\n".join(bad)


def test_readme_reproduction_figures_are_in_the_tables_they_link():
  """Every decimal figure in a README result cell that links a results table
  appears in that table, so the README cannot drift from the results."""
  rows = [line for line in (REPO / "README.md").read_text().splitlines()
          if line.startswith("| ") and "[table](experiments/results/" in line]
  assert len(rows) >= 3
  for row in rows:
    cell = row.split(" | ")[1]
    table = re.search(r"\[table\]\((experiments/results/[\w.]+\.md)\)", cell)
    assert table, row
    text = (REPO / table.group(1)).read_text()
    for figure in re.findall(r"\d+\.\d+", cell.split("([table]")[0]):
      assert figure in text, (figure, table.group(1))
