"""The README's and the docs' generated tables equal the registry's, and the
documents cite sources as a bibliography would (the table generator itself:
tests/test_docs_tables.py)."""

import pathlib
import re

import pytest

from circle_jax import docs_tables
from circle_jax import losses
from circle_jax import pml_names

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
    ("docs/migration_from_pml.md", "pml"),
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
    table = re.search(r"\[table\]\((experiments/results/[\w./]+\.md)\)", cell)
    assert table, row
    text = (REPO / table.group(1)).read_text()
    for figure in re.findall(r"\d+\.\d+", cell.split("([table]")[0]):
      assert figure in text, (figure, table.group(1))


_NO_PML = re.compile(r"no PML (loss|implementation)|PML has no", re.I)


def _pml_claims_that_are_wrong(lines, pml_classes):
  """The lines that say a registered loss has no pytorch-metric-learning
  counterpart while ``pml_classes`` (PML's ``losses`` class names) holds
  one. A loss and a class match when their names agree without case,
  underscores and the ``Loss`` suffix (``ranked_list`` ~ ``RankedListLoss``,
  ``nt_xent`` ~ ``NTXentLoss``)."""
  norm = lambda n: re.sub(r"loss$", "", n.lower().replace("_", ""))
  have = {norm(c) for c in pml_classes}
  bad = []
  for where, line in lines:
    if not _NO_PML.search(line):
      continue
    if line.startswith("|"):  # a table row: its first cell is the loss
      names = [line.strip("|").split("|")[0].strip().strip("`")]
    else:
      names = [n for n in losses.LOSSES
               if re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", line)]
    bad += [f"{where}: {n} ({line.strip()})" for n in names
            if norm(n) in have]
  return bad


def test_no_pml_loss_statements_hold_for_pml_as_installed():
  """"no PML loss" is checked against pytorch-metric-learning's
  ``losses`` module (until a migration table names the counterparts)."""
  pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
  classes = [n for n in dir(pml_losses) if n.endswith("Loss")]
  assert "RankedListLoss" in classes and "NTXentLoss" in classes
  lines = [(f"{path.relative_to(REPO)}:{i}", line)
           for path in [REPO / "README.md",
                        *sorted((REPO / "docs").glob("*.md"))]
           for i, line in enumerate(path.read_text().splitlines(), 1)]
  assert any(_NO_PML.search(line) for _, line in lines)  # the check bites
  assert _pml_claims_that_are_wrong(lines, classes) == []
  # What it catches: the claim the docs made about Ranked List.
  assert _pml_claims_that_are_wrong(
      [("x", "| ranked_list | 326 ms | no PML loss | - |"),
       ("y", "| ranked_proxy_anchor | 77 ms | no PML loss | - |"),
       ("z", "nt_xent and ranked_proxy_anchor have no PML implementation.")],
      classes) == [
          "x: ranked_list (| ranked_list | 326 ms | no PML loss | - |)",
          "z: nt_xent (nt_xent and ranked_proxy_anchor have no PML "
          "implementation.)"]


def _migration_rows():
  text = (REPO / "docs/migration_from_pml.md").read_text(encoding="utf-8")
  rows = [line.split(" | ") for line in text.splitlines()
          if line.startswith("| `")]
  return {r[0].strip("| `"): r[3] for r in rows}


def test_migration_rows_marked_present_resolve():
  """A PML component the committed migration table calls present has
  every name its row needs in the package (a registry entry, a function,
  an option), and every component has a row."""
  rows = _migration_rows()
  assert sorted(rows) == sorted(c.pml for c in pml_names.COMPONENTS)
  present = [pml for pml, status in rows.items() if status == "present"]
  assert "losses.CircleLoss" in present
  broken = [f"{pml}: {need}" for pml in present
            for need in pml_names.find(pml).needs
            if not pml_names.resolves(need)]
  assert broken == [], (
      f"docs/migration_from_pml.md says present: {broken}; run "
      f"`{docs_tables.COMMAND}` and commit the result.")
  readme = (REPO / "README.md").read_text(encoding="utf-8")
  assert ("coming from pytorch-metric-learning](docs/migration_from_pml.md)"
          in readme.lower())
