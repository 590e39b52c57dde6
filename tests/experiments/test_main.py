"""The main job from the command line: loss switching, every loss, errors."""

import os
import subprocess
import sys

from absl import flags
import pytest

from circle_jax import losses
from circle_jax.train import loop
from experiments import config_flag
from experiments.configs import base

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
DIGITS = "experiments/configs/digits.py"


def parse(*overrides, config=DIGITS):
  """The config that `python -m experiments.main` builds from these flags."""
  argv = ["main", f"--config={os.path.join(REPO, config)}", *overrides]
  fv = flags.FlagValues()
  holder = config_flag.DEFINE_config_file("config", flag_values=fv,
                                          sys_argv=argv)
  fv(argv)
  return holder.value


def test_loss_name_swaps_in_that_losses_own_defaults():
  c = parse("--config.loss.name=multi_similarity")
  assert dict(c.loss) == {"name": "multi_similarity", "alpha": 2.0,
                          "beta": 50.0, "base": 0.5, "epsilon": 0.1,
                          "mining": True, "block_size": None}
  # Circle's class-level variant gets its own gamma/m, not Circle's.
  c = parse("--config.loss.name=circle_class_level")
  assert (c.loss.gamma, c.loss.margin) == (256.0, 0.25)


@pytest.mark.parametrize("order", [0, 1])
def test_hyperparameter_overrides_apply_in_any_order(order):
  flags_ = ["--config.loss.name=multi_similarity", "--config.loss.beta=40",
            "--config.loss.mining=false"]
  if order:
    flags_ = flags_[::-1]
  c = parse(*flags_)
  assert (c.loss.name, c.loss.beta, c.loss.mining, c.loss.alpha) == (
      "multi_similarity", 40.0, False, 2.0)


def test_the_files_loss_values_stay_without_a_name_change():
  c = parse("--config.loss.gamma=64", "--config.loss.name=circle")
  assert (c.loss.gamma, c.loss.margin) == (64.0, 0.4)
  c = parse("--config.loss.block_size=512")
  assert c.loss.block_size == 512 and c.loss.gamma == 80.0


def test_unknown_loss_or_hyperparameter_names_what_is_accepted():
  with pytest.raises(flags.IllegalFlagValueError,
                     match=r"config\.loss\.gamma: loss 'multi_similarity' has "
                           r"no hyperparameter 'gamma'; it accepts \['alpha'"):
    parse("--config.loss.name=multi_similarity", "--config.loss.gamma=3")
  with pytest.raises(flags.IllegalFlagValueError,
                     match="unknown loss 'circel'; known losses: arcface"):
    parse("--config.loss.name=circel")
  with pytest.raises(flags.IllegalFlagValueError, match="block_size"):
    parse("--config.loss.name=proxy_anchor", "--config.loss.block_size=64")


def test_loss_config_lists_every_hyperparameter_and_rejects_unknown_ones():
  for name, entry in losses.LOSSES.items():
    c = base.loss_config(name)
    want = dict(entry.defaults, name=name)
    if entry.execution_options:
      want["block_size"] = None
    assert dict(c) == want, name
  with pytest.raises(ValueError, match="has no hyperparameter"):
    base.loss_config("circle", alpha=1.0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_every_registered_loss_trains_two_steps_from_the_command_line(
    name, data_dir, tmp_path):
  c = parse(f"--config.loss.name={name}", "--config.num_train_steps=2",
            "--config.eval_at_init=false", "--config.eval_clustering=false",
            f"--config.dataset.data_dir={data_dir}",
            "--config.dataset.num_threads=2")
  result = loop.train_and_evaluate(c, str(tmp_path))
  assert result["config"]["loss"] == dict(
      base.loss_config(name).to_dict(), name=name)
  assert 0.0 <= result["final"]["recall@1"] <= 1.0


def test_blockwise_loss_from_the_command_line(data_dir, tmp_path):
  c = parse("--config.loss.block_size=16", "--config.num_train_steps=2",
            "--config.eval_at_init=false", "--config.eval_clustering=false",
            f"--config.dataset.data_dir={data_dir}")
  result = loop.train_and_evaluate(c, str(tmp_path))
  assert result["config"]["loss"]["block_size"] == 16


def _main(*args, cwd=REPO):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.run([sys.executable, "-m", "experiments.main", *args],
                        cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=300)


def test_user_errors_print_one_line_without_traceback(tmp_path):
  proc = _main(f"--config={DIGITS}", f"--workdir={tmp_path}",
               "--config.batch.images_per_class=1")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      "error: config.batch.images_per_class: pair loss 'circle' needs "
      "positive pairs: use at least 2 images per class; got 1."]
  assert proc.stdout == ""
  proc = _main(f"--config={DIGITS}", f"--workdir={tmp_path}",
               "--config.batch.images_per_class=1", "--verbose")
  assert proc.returncode == 1 and "Traceback" in proc.stderr
  # A dataset whose files are missing: the folder given is named.
  proc = _main(f"--config={DIGITS}", f"--workdir={tmp_path}",
               "--config.dataset.name=cub200",
               f"--config.dataset.manual_dir={tmp_path}",
               f"--config.dataset.data_dir={tmp_path / 'tfds'}",
               "--config.batch.classes_per_batch=4")
  assert proc.returncode == 1, proc.stderr
  assert "Traceback" not in proc.stderr
  line = proc.stderr.strip().splitlines()[-1]
  assert line.startswith(
      f"error: Dataset 'cub200': 'CUB_200_2011.tgz' not found in manual_dir "
      f"'{tmp_path}'")
  assert line.endswith("(--verbose for details)")
