"""Histogram loss: a hand-computed case, pytorch-metric-learning 2.9's value
and gradient (defaults, other bin counts, miner pairs, 8 devices), the
refused engines and bad inputs."""

import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses import engine_checks
from tests.losses import pml_checks

# Slow (value and gradient against PML, 8 simulated devices): not in the
# fast tier (CONTRIBUTING.md); CI runs it.
pytestmark = pytest.mark.slow

pml = pytest.importorskip("pytorch_metric_learning.losses")

X, Y = pml_checks.batch(seed=1), pml_checks.LABELS


def histogram_ref(x, y, n_bins, ref, ref_y):
  """The histogram loss of the (anchor, reference) pairs, pair by pair, in
  float64."""
  unit = lambda v: v / np.linalg.norm(v, axis=1, keepdims=True)
  s = unit(x) @ unit(ref).T
  delta = 2 / n_bins

  def density(values):
    h = np.zeros(n_bins + 1)
    for v in values:
      r = min(int(np.floor((v + 1) / delta)), n_bins - 1)
      h[r + 1] += (v + 1 - r * delta) / delta
      h[r] += ((r + 1) * delta - 1 - v) / delta
    return h / max(len(values), 1)

  same = y[:, None] == ref_y[None, :]
  anchors = same.any(1) & (~same).any(1)
  ap = [s[i, j] for i, j in zip(*np.nonzero(same)) if anchors[i]]
  an = [s[i, j] for i, j in zip(*np.nonzero(~same)) if anchors[i]]
  return float(np.sum(density(an) * np.cumsum(density(ap))))


def test_hand_computed():
  # One positive pair at s = 0 and one negative pair at s = 0.5 (rows 0 and
  # 2; row 1 pairs with row 2 at s = cos 120 deg): 2 bins of width 1.
  x = jnp.array([[1.0, 0.0], [1.0, 0.0], [0.5, np.sqrt(0.75)]])
  got = losses.histogram_loss(x, jnp.array([0, 0, 1]), n_bins=2)
  # positives: one pair at node 2 (s = 1); negatives: two pairs at s = 0.5,
  # half on node 1 and half on node 2; Phi+ = (0, 0, 1).
  np.testing.assert_allclose(float(got), 0.5, rtol=1e-6)


def test_equals_pytorch_metric_learning():
  for kw in ({}, {"n_bins": 10}, {"delta": 0.25}):
    want = pml_checks.pml_vg(pml.HistogramLoss(**kw), X, Y)
    pml_checks.close(pml_checks.vg(losses.histogram_loss, X, Y, **kw), want)
  want = pml_checks.pml_vg(pml.HistogramLoss(n_bins=10), X, Y)
  pml_checks.close(
      pml_checks.sharded_dense(losses.histogram_loss, X, Y, n_bins=10), want)


def test_miner_pairs_equal_pmls_indices_tuple():
  rng = np.random.default_rng(3)
  pm, nm = (rng.random((16, 16)) < 0.5 for _ in range(2))
  want = pml_checks.pml_vg(pml.HistogramLoss(n_bins=8), X, Y,
                           indices_tuple=pml_checks.pairs_of(
                               pm & (Y[:, None] == Y) & ~np.eye(16, dtype=bool),
                               nm & (Y[:, None] != Y)))
  got = pml_checks.vg(losses.histogram_loss, X, Y, n_bins=8,
                      pos_mask=jnp.asarray(pm), neg_mask=jnp.asarray(nm))
  pml_checks.close(got, want)


def test_reference_embeddings_pair_each_anchor_with_each_reference():
  mem = pml_checks.batch(seed=2, n=8)
  mem_y = np.array([0, 1, 2, 3, 0, 1, 7, 7])
  f = lambda x: histogram_ref(x, Y, 10, mem, mem_y)
  got = engine_checks.vg(
      lambda x, y: losses.histogram_loss(
          x, y, n_bins=10, ref=losses.Candidates(jnp.asarray(mem, jnp.float32),
                                                  jnp.asarray(mem_y))),
      jnp.asarray(X, jnp.float32), jnp.asarray(Y))
  pml_checks.close(got, (f(X), engine_checks.grad_ref(f, X)))


def test_the_defaults_are_pmls():
  assert losses.get_loss("histogram").defaults == {"n_bins": None,
                                                   "delta": None}
  assert pml.HistogramLoss().delta == 2 / 100
  assert losses.histogram.bin_width(None, None) == 2 / 100


def test_no_triplet_gives_zero_loss_and_zero_gradient():
  value, grad = pml_checks.vg(losses.histogram_loss, X, np.arange(16))
  assert float(value) == 0.0
  np.testing.assert_array_equal(np.asarray(grad), 0.0)


@pytest.mark.parametrize("kw,match", [
    ({"n_bins": 10, "delta": 0.1}, r"delta = 2 / n_bins"),
    ({"n_bins": 0}, r"n_bins"),
    ({"delta": 3.0}, r"delta.*\(0, 2\]"),
    ({"block_size": 4}, r"only the dense engine \(its value multiplies"),
    ({"geometry": "dot"}, r"cosine geometry"),
])
def test_bad_input_is_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as err:
    losses.histogram_loss(jnp.asarray(X), jnp.asarray(Y), **kw)
  assert "\n" not in str(err.value)
