"""Instance loss: pytorch-metric-learning 2.9's value and gradient where its
target is right (labels 0..B-1), a float64 loop reference of the paper's
in-batch form elsewhere (PML's label bug), every engine, references and
miner masks."""

import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses import pml_checks

# Slow (value and gradient against PML on every engine, 8 simulated devices):
# not in the fast tier (CONTRIBUTING.md); CI runs it.
pytestmark = pytest.mark.slow

pml = pytest.importorskip("pytorch_metric_learning.losses")
torch = pytest.importorskip("torch")

X, Y = pml_checks.batch(seed=1), pml_checks.LABELS


def instance_ref(x, y, gamma, pos_mask=None, neg_mask=None, ref=None,
                 ref_y=None):
  """The paper's instance loss in the batch, anchor by anchor, in float64
  torch: ``(value, dx)`` or, with ``ref``, ``(value, (dx, dref))``."""
  xt = torch.tensor(x, requires_grad=True)
  rt = xt if ref is None else torch.tensor(ref, requires_grad=True)
  cy = y if ref is None else ref_y
  z = torch.nn.functional.normalize(xt, dim=1)
  c = torch.nn.functional.normalize(rt, dim=1)
  terms = []
  for i in range(len(y)):
    num = den = torch.exp(torch.tensor(float(gamma), dtype=torch.float64))
    for j in range(len(cy)):
      if ref is None and j == i:
        continue
      w = torch.exp(gamma * torch.dot(z[i], c[j]))
      if cy[j] == y[i] and (pos_mask is None or pos_mask[i, j]):
        num = num + w
        den = den + w
      elif cy[j] != y[i] and (neg_mask is None or neg_mask[i, j]):
        den = den + w
    terms.append(-torch.log(num / den))
  value = torch.stack(terms).mean()
  value.backward()
  value = float(value.detach())
  if ref is None:
    return value, xt.grad.numpy()
  return value, (xt.grad.numpy(), rt.grad.numpy())


def test_hand_computed():
  x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
  got = losses.instance_loss(x, jnp.array([0, 0, 1]), gamma=1.0)
  e = np.e
  # anchor 0: own e, positive 1 (s=0), negative e; anchor 1: own e,
  # positive 1, negative 1; anchor 2: own e, negatives e and 1.
  want = np.mean([np.log((2 * e + 1) / (e + 1)), np.log((e + 2) / (e + 1)),
                  np.log((2 * e + 1) / e)])
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


def test_equals_pytorch_metric_learning_on_distinct_labels():
  y = np.arange(16)
  for gamma in (64.0, 3.0):
    want = pml_checks.pml_vg(pml.InstanceLoss(gamma=gamma), X, y)
    pml_checks.close(pml_checks.vg(losses.instance_loss, X, y, gamma=gamma),
                     want)
    pml_checks.close(instance_ref(X, y, gamma), want, rtol=1e-10,
                     grad_atol=1e-10)


def test_repeated_labels_follow_the_paper_not_pmls_target_column():
  want = instance_ref(X, Y, 2.0)
  pml_checks.close(pml_checks.vg(losses.instance_loss, X, Y, gamma=2.0),
                   want)
  # PML's target is the label's rank used as a column index: another value.
  other = pml_checks.pml_vg(pml.InstanceLoss(gamma=2.0), X, Y)[0]
  assert abs(other - want[0]) > 1e-3


def test_the_defaults_are_pmls():
  assert losses.get_loss("instance").defaults == {"gamma": 64.0}
  assert pml.InstanceLoss().gamma == 64


def test_every_engine_equals_the_reference():
  runs = pml_checks.engines(losses.instance_loss, X, Y, gamma=4.0)
  want = instance_ref(X, Y, 4.0)
  for got in runs.values():
    pml_checks.close(got, want)


def test_references_and_miner_masks():
  mem = pml_checks.batch(seed=2, n=8)
  mem_y = np.array([0, 1, 2, 3, 0, 1, 7, 7])
  want = instance_ref(X, Y, 4.0, ref=mem, ref_y=mem_y)
  for got in pml_checks.with_references(losses.instance_loss, X, Y, mem,
                                        mem_y, gamma=4.0):
    pml_checks.close(got, want)
  rng = np.random.default_rng(3)
  pm, nm = (rng.random((16, 16)) < 0.6 for _ in range(2))
  want = instance_ref(X, Y, 4.0, pm, nm)
  for got in pml_checks.masked(losses.instance_loss, X, Y, pm, nm, gamma=4.0):
    pml_checks.close(got, want)


def test_no_negative_gives_zero_loss_and_zero_gradient():
  pml_checks.zero_everywhere(losses.instance_loss, X, np.zeros(16, int))


@pytest.mark.parametrize("kw,match", [
    ({"gamma": -1.0}, r"gamma.*\[1e-06, 10000\]"),
    ({"geometry": "dot"}, r"cosine geometry"),
])
def test_bad_input_is_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as err:
    losses.instance_loss(jnp.asarray(X), jnp.asarray(Y), **kw)
  assert "\n" not in str(err.value)
