"""The README's and the docs' generated tables equal the registry's, and the
documents cite sources as a bibliography would."""

import pathlib
import re

import pytest

from circle_jax import docs_tables
from circle_jax import losses

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


def test_readme_table_has_every_loss_with_its_defaults():
  rows = docs_tables.readme_loss_table().splitlines()[2:]
  assert [r.split("|")[1].strip() for r in rows] == [
      f"`{name}`" for name in losses.LOSSES]
  (circle,) = [r for r in rows if r.startswith("| `circle` |")]
  assert "| `margin=0.4`, `gamma=80.0` |" in circle
  (rpal,) = [r for r in rows if r.startswith("| `ranked_proxy_anchor` |")]
  assert '`distance="euclidean"`' in rpal and "| `proxies` |" in rpal


def test_call_table_reads_signatures_and_registry_names():
  assert docs_tables.call_table(
      ["proxy_anchor_loss", "unified_loss_class_level", "pair_weights"]) == (
          "| call (defaults) | registry name |\n"
          "| --- | --- |\n"
          "| `proxy_anchor_loss(embeddings, labels, proxies, *, margin=0.1, "
          "alpha=32.0, axis_name=None, shard_classes=False, "
          "num_classes=None)` | `proxy_anchor` |\n"
          "| `unified_loss_class_level(embeddings, labels, class_weights, *, "
          "gamma=64.0, margin=0.35)` | - |\n"
          "| `pair_weights(loss_fn, similarity, labels, **hyper)` | - |\n")
  with pytest.raises(ValueError, match="no function 'circle'"):
    docs_tables.call_table(["circle"])


def test_a_stale_table_is_rewritten_and_reported(tmp_path):
  marker = f"<!-- generated: {docs_tables.COMMAND} readme-losses -->\n"
  fresh = ("# Title\n\n" + marker + docs_tables.readme_loss_table()
           + docs_tables.END + "\n\nAfter.\n")
  assert docs_tables.regenerate(fresh) == fresh
  stale = fresh.replace("`margin=0.4`, `gamma=80.0`",
                        "`margin=0.25`, `gamma=80.0`", 1)
  assert stale != fresh and docs_tables.regenerate(stale) == fresh
  # An empty block is filled in; text around the markers is kept.
  empty = "# Title\n\n" + marker + docs_tables.END + "\n\nAfter.\n"
  assert docs_tables.regenerate(empty) == fresh

  (tmp_path / "docs").mkdir()
  (tmp_path / "README.md").write_text(stale)
  (tmp_path / "docs" / "x.md").write_text(fresh)
  assert docs_tables.main(["--root", str(tmp_path), "--check"]) == 1
  assert (tmp_path / "README.md").read_text() == stale   # --check writes nothing
  assert docs_tables.main(["--root", str(tmp_path)]) == 0
  assert (tmp_path / "README.md").read_text() == fresh
  assert docs_tables.main(["--root", str(tmp_path), "--check"]) == 0


@pytest.mark.parametrize("text, match", [
    (f"<!-- generated: {docs_tables.COMMAND} losses -->\n| a |\n",
     "has no <!-- end generated -->"),
    (f"<!-- generated: {docs_tables.COMMAND} tables -->\n"
     f"{docs_tables.END}", "Unknown generated table 'tables'"),
    (f"<!-- generated: {docs_tables.COMMAND} calls -->\n"
     f"{docs_tables.END}", "Unknown generated table 'calls'"),
    (f"<!-- generated: {docs_tables.COMMAND} losses -->\n"
     f"<!-- generated: {docs_tables.COMMAND} datasets -->\n"
     f"{docs_tables.END}", "Nested generated table"),
])
def test_malformed_markers_are_errors(text, match):
  with pytest.raises(ValueError, match=match):
    docs_tables.regenerate(text)


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
