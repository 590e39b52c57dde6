"""The loss benchmark's peer: every registered loss that PML has is built
as its PML class, from the migration table's one mapping."""

import pytest

from circle_jax import losses
from circle_jax import pml_names
from experiments.bench import peers


def test_every_registered_pml_loss_has_its_peer():
  mods, msg = peers.load_torch()
  if mods is None:
    pytest.skip(msg)
  torch = mods[0]
  names = [n for n in pml_names.PML_LOSS_CLASSES if n in losses.LOSSES]
  assert {"circle", "nca", "manifold", "vicreg", "p2s_grad"} <= set(names)
  for name in names:
    loss_fn, _ = peers.pml_loss(mods, name,
                                dict(losses.LOSSES[name].defaults), 4, 8)
    assert type(loss_fn).__name__ == pml_names.PML_LOSS_CLASSES[name], name
  # The generic build passes PML's own names and units through.
  angular, _ = peers.pml_loss(mods, "angular", {"alpha": 35.0}, 4, 8)
  assert angular.alpha == pytest.approx(torch.tensor(35.0).deg2rad())
  # VICReg's views are the rows 2i and 2i + 1; Manifold's labels, PML's
  # indices_tuple: both run.
  x = torch.randn(8, 8, dtype=torch.float64)
  labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
  for name in ("vicreg", "manifold", "nca"):
    loss_fn, miner = peers.pml_loss(
        mods, name, dict(losses.LOSSES[name].defaults), 4, 8)
    value = peers.pml_forward(name, loss_fn.double(), miner, x, labels)
    assert torch.isfinite(value), name
