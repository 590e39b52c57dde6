"""experiments/configs/xbm.py: the XBM variants of SOP and In-Shop."""

import pathlib

import pytest

from circle_jax import config_facts

from circle_jax.train import config_checks
from experiments.configs import xbm


@pytest.mark.parametrize("variant", xbm.VARIANTS)
def test_every_variant_is_a_valid_memory_config(variant):
  c = xbm.get_config(variant)
  c.dataset.manual_dir = "/path/to/data"
  config_checks.check_config(c, device_count=8, process_count=1)
  dataset, loss = variant.split("-")
  assert (c.dataset.name, c.loss.name) == (dataset, loss)
  assert (c.model.name, c.model.embedding_dim) == ("bn_inception", 512)
  assert config_facts.global_batch_size(c) == 64
  assert c.xbm.size == xbm.MEMORY[dataset] and c.xbm.size % 64 == 0
  assert (c.xbm.start_step, c.xbm.weight) == (1000, 1.0)
  assert f"xbm.py:{variant} " in xbm.__doc__.replace("\\\n", " ")


def test_an_unknown_variant_names_the_valid_ones():
  with pytest.raises(ValueError, match="sop-contrastive, sop-multi_similarity"):
    xbm.get_config("cub200-contrastive")


def test_the_paper_table_has_a_row_with_the_launch_command_of_every_variant():
  table = (pathlib.Path(__file__).resolve().parents[3] / "experiments"
           / "results" / "main_paper_tables.md").read_text()
  for variant in xbm.VARIANTS:
    command = (f"--config=experiments/configs/xbm.py:{variant} "
               f"--workdir=/tmp/xbm_{variant} ")
    rows = [r for r in table.splitlines()
            if r.startswith("| XBM") and command in r]
    assert len(rows) == 1, variant
    doc = " ".join(xbm.__doc__.replace("\\\n", " ").split())
    assert command in doc
