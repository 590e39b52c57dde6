"""The main job from the command line: loss switching, every loss, errors."""

import json
import os
import subprocess
import sys

import pytest

from circle_jax import config as config_lib
from circle_jax import config_flag
from circle_jax import hostenv
from circle_jax import losses
from circle_jax.train import loop
from circle_jax.train import workdir as workdir_lib
from experiments.configs import digits
from experiments.configs import omniglot_small
from tests import test_config
from tests.train import helpers

# Slow (whole training jobs): not in the fast tier (CONTRIBUTING.md). The
# in-process runs share one persistent compilation cache (tests/conftest.py):
# every loss's run loads the evaluation programs the first one compiled.
pytestmark = [pytest.mark.slow,
              pytest.mark.usefixtures("module_compilation_cache")]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
DIGITS = "experiments/configs/digits.py"


def parse(*overrides, config=DIGITS):
  """The config that `python -m experiments.main` builds from these flags."""
  return test_config.parse(os.path.join(REPO, config), *overrides,
                           define=config_flag.DEFINE_config_file)


def test_the_digits_config_is_the_trainer_tests_and_old_workdirs_config():
  """tests/train builds digits' config from the package schema; the two must
  not drift apart, and a workdir of the code before the schema moved into the
  package (its config.json) resumes with digits.py."""
  assert digits.get_config().to_dict() == helpers.digits_config().to_dict()
  assert omniglot_small.get_config().to_dict() == (
      helpers.omniglot_small_config().to_dict())
  with open(os.path.join(REPO, "tests", "train", "data",
                         "digits_config_2c032ff.json")) as f:
    old = json.load(f)
  assert workdir_lib.config_diff(
      old, workdir_lib.config_to_dict(parse())) == []


def test_the_command_line_switches_losses_with_their_defaults():
  c = parse("--config.loss.name=multi_similarity", "--config.loss.beta=40")
  assert (c.loss.name, c.loss.beta, c.loss.alpha) == ("multi_similarity",
                                                      40.0, 2.0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


# Losses whose paper defaults cost too much for two CPU steps: smaller
# settings of the same code paths (HIER's 512 proxies x 50 triplets each).
CHEAPER = {"hier": {"num_proxies": 16, "triplets_per_anchor": 4}}
# Losses that need more of the model than its embeddings, with the flags that
# give them one: VPTSP-G's class prompts enter a (tiny) ViT's blocks.
MODEL_FLAGS = {"vptsp_proxy_anchor": (
    "--config.model.name=vit_ti16",
    '--config.model.kwargs={"depth": 1, "width": 16, "num_heads": 2, '
    '"patch_size": 4, "image_size": 8}',
    "--config.semantic_proxies.prompt_depth=1")}


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_every_registered_loss_trains_two_steps_from_the_command_line(
    name, data_dir, tmp_path):
  cheaper = CHEAPER.get(name, {})
  # A one-block conv4 of width 8 (unless the loss needs another model): the
  # same job on the same 8 devices, about half the compile of digits' four
  # blocks of 32 (2.4 against 4.2 s of CPU a loss, with the shared cache).
  model = MODEL_FLAGS.get(name, ("--config.model.kwargs.width=8",
                                 "--config.model.kwargs.num_blocks=1"))
  c = parse(f"--config.loss.name={name}", *model,
            "--config.num_train_steps=2",
            "--config.eval_at_init=false", "--config.eval_clustering=false",
            f"--config.dataset.data_dir={data_dir}",
            "--config.dataset.num_threads=2",
            *(f"--config.loss.{k}={v}" for k, v in cheaper.items()))
  result = loop.train_and_evaluate(c, str(tmp_path))
  # As saved in config.json (a tuple default, RS@k's k, reads as a list).
  assert result["config"]["loss"] == json.loads(json.dumps(dict(
      config_lib.loss_config(name).to_dict(), name=name, **cheaper)))
  assert 0.0 <= result["final"]["recall@1"] <= 1.0


def test_blockwise_loss_from_the_command_line(data_dir, tmp_path):
  c = parse("--config.loss.block_size=16", "--config.num_train_steps=2",
            "--config.eval_at_init=false", "--config.eval_clustering=false",
            f"--config.dataset.data_dir={data_dir}")
  result = loop.train_and_evaluate(c, str(tmp_path))
  assert result["config"]["loss"]["block_size"] == 16


def _main(*args, cwd=REPO, pythonpath=True, env=None):
  base = {k: v for k, v in os.environ.items()
          if k not in ("GLIBC_TUNABLES", "CIRCLE_JAX_NO_HUGEPAGES")}
  env = dict(base, JAX_PLATFORMS="cpu", XLA_FLAGS="", **(env or {}))
  env.pop("PYTHONPATH", None)
  if pythonpath:
    env["PYTHONPATH"] = (REPO + os.pathsep
                         + os.environ.get("PYTHONPATH", "")).rstrip(os.pathsep)
  return subprocess.run([sys.executable, "-m", "experiments.main", *args],
                        cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=300)


def test_runs_from_the_repository_root_without_pythonpath(tmp_path):
  """``python -m experiments.main`` from the repository root needs no
  PYTHONPATH, and imports this checkout's package (the working directory
  comes first on the path, before an installed copy)."""
  proc = _main("--helpfull", pythonpath=False)
  assert "ModuleNotFoundError" not in proc.stderr, proc.stderr[-2000:]
  assert "--workdir: Output folder." in proc.stdout, proc.stderr[-2000:]
  proc = _main(f"--config={DIGITS}", f"--workdir={tmp_path / 'w'}",
               "--config.optim.learing_rate=1", pythonpath=False)
  assert proc.returncode == 1
  assert ("config.optim.learing_rate: the config does not have this field; "
          "did you mean config.optim.learning_rate?") in proc.stderr


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


@pytest.mark.skipif(not hostenv.hugepage_malloc_supported(),
                    reason="glibc < 2.35 has no huge-page malloc tunable")
def test_the_job_runs_with_huge_page_malloc_unless_told_not_to(tmp_path):
  args = (f"--config={DIGITS}", f"--workdir={tmp_path}",
          "--config.batch.images_per_class=1", "--verbose")  # fails fast
  proc = _main(*args)
  assert "malloc: GLIBC_TUNABLES=" in proc.stderr, proc.stderr[-2000:]
  assert "glibc.malloc.hugetlb=1" in proc.stderr
  proc = _main(*args, env={"CIRCLE_JAX_NO_HUGEPAGES": "1"})
  assert "malloc: default (4 KiB pages)" in proc.stderr, proc.stderr[-2000:]


def test_the_job_keeps_its_compiled_programs_where_the_config_says(
    tmp_path, data_dir):
  # Off by default in the tests (conftest); the config field turns it on.
  cache = tmp_path / "cache"
  proc = _main(f"--config={DIGITS}", f"--workdir={tmp_path / 'w'}",
               "--config.num_train_steps=2", "--config.eval_at_init=false",
               "--config.eval_clustering=false",
               "--config.model.kwargs.width=8",  # a quarter of the compile
               "--config.model.kwargs.num_blocks=1",
               f"--config.dataset.data_dir={data_dir}",
               f"--config.compilation_cache_dir={cache}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert len(os.listdir(cache)) > 5, os.listdir(cache)
