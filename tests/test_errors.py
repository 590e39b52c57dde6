"""Tests of circle_jax/errors.py: UserError and the weights-file read guard.

The readers that wrap their reads (Keras .h5, .pth, timm ViT) are tested on
real damaged files in tests/models/test_inputs_and_weights_files.py; these
tests check the guard itself.
"""

import pathlib

import pytest

from circle_jax import errors


def test_weights_file_error_is_a_user_error_and_a_value_error():
  assert issubclass(errors.WeightsFileError, errors.UserError)
  assert issubclass(errors.WeightsFileError, ValueError)
  assert not issubclass(errors.UserError, ValueError)


def test_a_clean_read_passes_through(tmp_path):
  path = tmp_path / "w.bin"
  path.write_bytes(b"weights")
  with errors.reading_weights(path, "a .bin file"):
    got = pathlib.Path(path).read_bytes()
  assert got == b"weights"


def test_missing_file_and_folder_are_named_before_the_read(tmp_path):
  entered = []
  with pytest.raises(errors.WeightsFileError) as e:
    with errors.reading_weights(tmp_path / "nope.h5", "a Keras .h5 file"):
      entered.append(1)
  assert str(e.value) == (
      f"Pretrained weights {str(tmp_path / 'nope.h5')!r} not found; "
      "expected a Keras .h5 file (--config.model.pretrained).")
  with pytest.raises(errors.WeightsFileError, match="is a folder; give the "
                     "file itself: a Keras .h5 file"):
    with errors.reading_weights(str(tmp_path), "a Keras .h5 file"):
      entered.append(2)
  assert not entered


def test_a_failed_read_is_one_line_with_the_readers_first_line(tmp_path):
  path = tmp_path / "w.pth"
  path.write_bytes(b"garbage")
  with pytest.raises(errors.WeightsFileError) as e:
    with errors.reading_weights(path, "a .pth state dict"):
      raise RuntimeError("unpickling stack underflow\nat byte 3")
  msg = str(e.value)
  assert "\n" not in msg
  assert msg == (
      f"Cannot read the pretrained weights {str(path)!r} (RuntimeError: "
      "unpickling stack underflow): expected a .pth state dict; the file is "
      "damaged, truncated or of another kind: download it again "
      "(--config.model.pretrained).")
  assert isinstance(e.value.__cause__, RuntimeError)
  # An error without a message is named by its type.
  with pytest.raises(errors.WeightsFileError, match=r"\(KeyError: KeyError\)"):
    with errors.reading_weights(path, "x"):
      raise KeyError()


@pytest.mark.parametrize("inner", [errors.UserError("weights do not fit"),
                                   ImportError("no module named h5py")])
def test_user_errors_and_missing_readers_pass_unchanged(tmp_path, inner):
  path = tmp_path / "w.h5"
  path.write_bytes(b"x")
  with pytest.raises(type(inner)) as e:
    with errors.reading_weights(path, "x"):
      raise inner
  assert e.value is inner
