"""Labels of an image folder: sub-folder names or a CSV."""

import numpy as np
import pytest

from circle_jax.search import build


def test_labels_from_sub_folders():
  got = build.read_labels("/g", ["cat/1.png", "dog/a/2.png"], build.FOLDERS)
  assert got.tolist() == ["cat", "dog"]
  with pytest.raises(build.LabelsError, match="'3.png' is not in a sub-fo"):
    build.read_labels("/g", ["cat/1.png", "3.png"], build.FOLDERS)
  assert build.read_labels("/g", ["1.png"], None) is None


def test_labels_from_a_csv(tmp_path):
  csv = tmp_path / "labels.csv"
  csv.write_text("path,label\n1.png,cat\n./sub/2.png, dog\n\n")
  got = build.read_labels("/g", ["sub/2.png", "1.png"], str(csv))
  np.testing.assert_array_equal(got, ["dog", "cat"])
  with pytest.raises(build.LabelsError, match="no label for '3.png'"):
    build.read_labels("/g", ["1.png", "3.png"], str(csv))
  csv.write_text("1.png\n")
  with pytest.raises(build.LabelsError, match="expected path,label"):
    build.read_labels("/g", ["1.png"], str(csv))
  with pytest.raises(build.LabelsError, match="neither `folders` nor a CSV"):
    build.read_labels("/g", ["1.png"], str(tmp_path / "missing.csv"))
