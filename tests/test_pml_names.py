"""Tests of circle_jax/pml_names.py: the PML -> circle_jax name table.

That the committed migration table is current and says "present" only for
names that resolve is checked in tests/test_docs.py.
"""

import inspect
import re

import pytest

from circle_jax import losses
from circle_jax import pml_names


def test_every_installed_pml_component_has_one_row():
  pytest.importorskip("pytorch_metric_learning")
  rows = [c.pml for c in pml_names.COMPONENTS]
  assert len(rows) == len(set(rows))
  assert sorted(rows) == list(pml_names.installed_components())
  # The rule counts the components a user calls, not the abstract bases.
  assert "losses.CircleLoss" in rows and "miners.HDCMiner" in rows
  assert not any(".Base" in r or r.endswith("Mixin") or "Generic" in r
                 for r in rows)


def test_loss_classes_are_pml_classes_and_registry_names():
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  assert pml_names.PML_LOSS_CLASSES["circle"] == "CircleLoss"
  assert pml_names.PML_LOSS_CLASSES["n_pair"] == "NPairsLoss"
  for name, cls in pml_names.PML_LOSS_CLASSES.items():
    assert inspect.isclass(getattr(pml, cls)), cls
    assert re.fullmatch(r"[a-z0-9_]+", name), name
  # Every registered loss that PML has is in the table.
  assert {"circle", "nca", "vicreg", "manifold"} <= set(
      pml_names.PML_LOSS_CLASSES)


def _pml_defaults(cls):
  return {k: p.default for k, p in inspect.signature(cls.__init__)
          .parameters.items() if p.default is not p.empty}


def test_a_default_that_differs_from_pml_is_stated():
  """Where a registered loss's default differs from PML's constructor's
  (after the row's renames, "`pml` -> `ours`"), the row says PML's value."""
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  unstated = []
  for c in pml_names.COMPONENTS:
    name = c.needs[0].split(":", 1)[1] if c.needs else ""
    if not c.needs[0:1] or not c.needs[0].startswith("loss:") or (
        name not in losses.LOSSES):
      continue
    renames = pml_names.renames(c)
    ours = losses.LOSSES[name].defaults
    for k, v in _pml_defaults(getattr(pml, c.pml.split(".")[1])).items():
      o = renames.get(k, k)
      if o in ours and ours[o] != v and f"{v}" not in c.difference:
        unstated.append(f"{c.pml}: {k}={v} (ours {o}={ours[o]})")
  assert unstated == []
  # What it catches, and the renames it reads.
  nt_xent = pml_names.find("losses.NTXentLoss")
  assert nt_xent.difference.endswith("(PML: 0.07)")
  assert pml_names.renames(nt_xent) == {"temperature": "tau"}
  assert pml_names.renames(pml_names.find(
      "losses.NormalizedSoftmaxLoss")) == {}


def test_needs_resolve_by_kind():
  ok = ["loss:circle", "attr:circle_jax.losses.batch_hard_miner",
        "attr:circle_jax.train.loop.train_and_evaluate", "geometry:cosine",
        "option:circle:pos_mask", "option:triplet:mining",
        "param:circle_jax.losses.batch_hard_miner:axis_name",
        "dataset:cub200", "in:circle_jax.data.DATASETS:cub200"]
  bad = ["loss:no_such_loss", "attr:circle_jax.losses.no_such_fn",
         "attr:circle_jax.no_such_module.x", "geometry:no_such",
         "option:circle:no_such", "option:no_such:margin",
         "param:circle_jax.losses.batch_hard_miner:no_such",
         "dataset:no_such", "in:circle_jax.data.DATASETS:no_such",
         "in:circle_jax.no_such.NAMES:x"]
  assert [n for n in ok if not pml_names.resolves(n)] == []
  assert [n for n in bad if pml_names.resolves(n)] == []
  with pytest.raises(ValueError, match="Unknown need 'nope:x'"):
    pml_names.resolves("nope:x")


def test_status_and_missing_options():
  c = pml_names.Component
  assert pml_names.status(c("x.A", needs=("loss:circle",))) == "present"
  assert pml_names.status(c("x.A", needs=("loss:circle", "loss:no_such"))
                          ) == "not yet"
  assert pml_names.status(c("x.A", left_out="why")) == "left out"
  row = c("x.A", needs=("loss:triplet",), options=("mining", "no_such"))
  assert pml_names.missing_options(row) == ("no_such",)


def test_left_out_rows_say_why_and_trainers_point_to_ours():
  out = [c for c in pml_names.COMPONENTS if c.left_out]
  assert out and all(len(c.left_out) > 20 and not c.needs for c in out)
  assert "circle_jax.train" in pml_names.find(
      "trainers.CascadedEmbeddings").left_out
  assert "PML 3" in pml_names.find("trainers.CascadedEmbeddings").left_out


def test_accuracy_options_are_pmls_constructor_options():
  """The audit counts AccuracyCalculator's options from its signature."""
  acc = pytest.importorskip(
      "pytorch_metric_learning.utils.accuracy_calculator").AccuracyCalculator
  params = set(inspect.signature(acc.__init__).parameters) - {"self"}
  assert set(pml_names.ACCURACY_OPTIONS) == params - {"device"}
  assert len(pml_names.installed_components()) == 106
