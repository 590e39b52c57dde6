"""Source trees (circle_jax/data/builders/sources.py): folders, zips and tars
read alike; finding an archive or its extracted folder; encrypted zips."""

import pytest

from circle_jax.data.builders import sources
from tests.data import fixtures

FILES = {"top/a.txt": b"alpha\n", "top/sub/b.png": fixtures.encode("PNG", 1),
         "top/sub/c.jpg": fixtures.encode("JPEG", 2), "other.txt": b"o"}


@pytest.mark.parametrize("archive", [None, "x.zip", "x.tgz"])
def test_trees_agree(tmp_path, archive):
  path = fixtures.write_tree(FILES, tmp_path, archive=archive)
  tree = sources.open_tree(path)
  assert sorted(tree.names()) == sorted(FILES)
  assert tree.read_bytes("top/a.txt") == b"alpha\n"
  got = dict(tree.iter_files(["top/sub/c.jpg", "top/sub/b.png"]))
  assert got == {k: FILES[k] for k in ("top/sub/c.jpg", "top/sub/b.png")}
  with pytest.raises(sources.CorruptImageError, match="top/nope.png"):
    list(tree.iter_files(["top/sub/b.png", "top/nope.png"]))


def test_find_source_layouts(tmp_path):
  fixtures.write_tree({"DS/marker.txt": b"", "DS/i.png": b""}, tmp_path / "ex")
  fixtures.write_tree({"DS/marker.txt": b""}, tmp_path / "ar", archive="DS.zip")
  find = lambda d: sources.find_source(d, folder="DS", archives=("DS.zip",),
                                    marker="marker.txt")
  assert isinstance(find(tmp_path / "ex"), sources.DirTree)
  assert find(tmp_path / "ex" / "DS").root == tmp_path / "ex"  # the folder itself
  assert isinstance(find(tmp_path / "ar"), sources.ZipTree)
  assert find(tmp_path) is None and find(None) is None


def test_find_source_takes_the_extracted_folder_under_any_name(tmp_path):
  fixtures.write_tree({"marker.txt": b"m", "i.png": b"p"}, tmp_path / "mine")
  tree = sources.find_source(tmp_path / "mine", folder="DS", archives=(),
                             marker="marker.txt")
  assert sorted(tree.names()) == ["DS/i.png", "DS/marker.txt"]
  assert tree.read_bytes("DS/marker.txt") == b"m"
  assert not tree.exists("i.png")


def test_find_source_prefers_the_extracted_folder_to_the_archive(tmp_path):
  fixtures.write_tree({"DS/marker.txt": b""}, tmp_path)
  fixtures.encrypted_zip({"DS/marker.txt": b""}, tmp_path / "DS.zip",
                         tool=False)
  tree = sources.find_source(tmp_path, folder="DS", archives=("DS.zip",))
  assert isinstance(tree, sources.DirTree)
  (tmp_path / "DS" / "marker.txt").unlink()
  (tmp_path / "DS").rmdir()
  with pytest.raises(sources.EncryptedArchiveError) as e:
    sources.find_source(tmp_path, folder="DS", archives=("DS.zip",))
  assert f"so that its files are in '{tmp_path / 'DS'}/'" in str(e.value)
