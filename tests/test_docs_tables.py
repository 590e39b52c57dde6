"""Tests of circle_jax/docs_tables.py: the generated tables of the docs.

That the committed tables are current is checked in tests/test_docs.py.
"""

import re

import pytest

from circle_jax import data
from circle_jax import docs_tables
from circle_jax import losses
from circle_jax import pml_names


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


def test_dataset_table_rows_by_hand():
  lines = docs_tables.dataset_table().splitlines()
  assert lines[0] == ("| name | classes (train / test) | images | Recall@K "
                      "| channels |")
  assert [r.split("|")[1].strip() for r in lines[2:]] == [
      f"`{name}`" for name in data.DATASETS]
  assert "| `cub200` | 100 / 100 | train 5,864, test 5,924 | 1, 2, 4, 8 | 3 |" \
      in lines
  (sop,) = [r for r in lines if r.startswith("| `sop` |")]
  assert "| 11,318 / 11,316 |" in sop and "| 1, 10, 100, 1000 |" in sop


@pytest.mark.parametrize("spec", ["losses", "readme-losses", "datasets",
                                  "calls circle_loss"])
def test_render_names_each_table(spec):
  want = {"losses": losses.loss_table_markdown,
          "readme-losses": docs_tables.readme_loss_table,
          "datasets": docs_tables.dataset_table,
          "calls circle_loss": lambda: docs_tables.call_table(
              ["circle_loss"])}[spec]()
  assert docs_tables.render(spec) == want and want.endswith("|\n")


def test_documents_are_the_readme_then_the_docs_sorted(tmp_path):
  (tmp_path / "docs").mkdir()
  for name in ("b.md", "a.md", "notes.txt"):
    (tmp_path / "docs" / name).write_text("x")
  assert docs_tables.documents(tmp_path) == [
      tmp_path / "README.md", tmp_path / "docs" / "a.md",
      tmp_path / "docs" / "b.md"]


def test_pml_table_rows_status_from_the_code():
  lines = docs_tables.pml_table().splitlines()
  counts = dict((k, int(n)) for n, k in re.findall(
      r"(\d+) (present|not yet|left out)", lines[0]))
  rows = [r.split(" | ") for r in lines[4:]]
  assert lines[2] == ("| PML 2.9 | ours | command line | status | "
                      "difference |")
  assert len(rows) == len(pml_names.COMPONENTS) == sum(counts.values())
  for status, n in counts.items():
    assert sum(r[3] == status for r in rows) == n
  by_pml = {r[0].strip("| `"): r for r in rows}
  # A loss's call is read from its registry entry.
  assert by_pml["losses.CircleLoss"][1:4] == [
      "`losses.circle_loss(embeddings, labels, margin=.., gamma=..)`",
      "`--config.loss.name=circle`", "present"]
  assert by_pml["trainers.CascadedEmbeddings"][3] == "left out"
  assert "PML 3" in by_pml["trainers.CascadedEmbeddings"][4]
