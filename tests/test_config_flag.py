"""circle_jax.config_flag: the --config flag switches the model's own
options when the command line names another model, and sets any field.
(The loss switch is specified with the schema in tests/test_config.py.)"""

from absl import flags
import pytest

from tests.test_config import parse


@pytest.fixture
def conv4_file(tmp_path):
  """A config file whose model has options of its own (conv4's width)."""
  path = tmp_path / "conv4_config.py"
  path.write_text(
      "from circle_jax import config as config_lib\n\n"
      "def get_config():\n"
      "  c = config_lib.base_config()\n"
      "  c.model.kwargs.width = 32\n"
      "  c.model.pretrained = '/weights/conv4.npz'\n"
      "  c.model.pooling = 'max'\n"
      "  return c\n")
  return str(path)


@pytest.mark.parametrize("order", ["name_first", "option_first"])
def test_model_name_swaps_in_that_models_own_options(conv4_file, order):
  flags_ = ["--config.model.name=bn_inception",
            "--config.model.kwargs.bn_momentum=0.5"]
  if order == "option_first":
    flags_.reverse()
  c = parse(conv4_file, *flags_)
  assert c.model.name == "bn_inception"
  assert c.model.kwargs.to_dict() == {"bn_momentum": 0.5}  # width is gone
  assert c.model.pretrained == ""          # conv4's weights file too
  assert c.model.pooling == "max"          # every model's fields stay
  c = parse(conv4_file, "--config.model.name=resnet50",
            "--config.model.pretrained=/w/resnet50.h5")
  assert c.model.kwargs.to_dict() == {"bn_momentum": 0.99}
  assert c.model.pretrained == "/w/resnet50.h5"


def test_the_files_model_options_stay_without_a_name_change(conv4_file):
  c = parse(conv4_file, "--config.model.name=conv4")
  assert c.model.kwargs.to_dict() == {"width": 32}
  assert c.model.pretrained == "/weights/conv4.npz"
  # '{}' on the command line clears the options (the model's defaults).
  c = parse(conv4_file, "--config.model.kwargs={}")
  assert c.model.kwargs.to_dict() == {}
  with pytest.raises(flags.IllegalFlagValueError, match="unknown model 'vgg'"):
    parse(conv4_file, "--config.model.name=vgg")


def test_the_image_size_can_be_set_on_the_command_line(conv4_file):
  assert parse(conv4_file).dataset.preprocess.image_size is None
  c = parse(conv4_file, "--config.dataset.preprocess.image_size=64")
  assert c.dataset.preprocess.image_size == 64
