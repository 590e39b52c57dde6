"""The search benchmark runs at a tiny size and writes its results file."""

import pytest

from experiments.bench import search

pytest.importorskip("faiss", reason="faiss-cpu is not installed (the "
                    "[faiss] extra; requirements-test.txt installs it)")


def test_tiny_benchmark_writes_every_figure_with_its_command(tmp_path):
  out = tmp_path / "search.md"
  search.main(["--gallery", "2000", "--queries", "64", "--clusters", "50",
               "--ef_search", "64", "--hnsw_gallery", "1000", "--tmp", str(tmp_path), "--out",
               str(out)])
  text = out.read_text()
  assert "python -m experiments.bench.search --gallery 2000" in text
  for what in ("faiss IndexFlatIP", "circle_jax exact", "recall@10",
               "MiB on disk", "Load average"):
    assert what in text
  assert "100.0000%" in text  # exact search = faiss Flat here
  assert "on the first 1,000 gallery items only" in text
