"""Tests of the triplet margin loss (circle_jax/losses/triplet.py); the checks
shared by the pair baselines are in engine/test_dispatch.py."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from circle_jax import losses
from tests.losses.conftest import DPN, S2, check_pair_case
from tests.losses.engine.cases import pair_batch
from tests.losses.reference import triplet_ref


def test_triplet_hand_computed(tiny):
  # anchor a: [1 - sqrt2 + 1]_+ ; anchor p: [1 - d_pn + 1]_+ ; n: no positive.
  # Semi-hard: for anchor p, n is closer than a (d_pn < 1): no negative is
  # farther, so the farthest negative (n itself) is used; same value here.
  want = ((2 - S2) + (2 - DPN)) / 2
  for mining in ("all", "batch_hard", "semi_hard"):
    np.testing.assert_allclose(tiny[f"triplet_{mining}"], want, rtol=1e-5)


def test_triplet_tensors_are_never_materialised():
  # "all" and "semi_hard" reduce over [B, B, B] triplet tables; value and
  # gradient must not keep one (a [256]^3 float32 tensor is 64 MiB; the
  # chunked evaluation keeps about 10 MiB).
  b = 256
  x = jnp.zeros((b, 8), jnp.float32)
  y = jnp.arange(b) % 16
  cube = b**3 * 4
  for mining in ("all", "semi_hard"):
    f = jax.value_and_grad(
        lambda x: losses.triplet_margin_loss(x, y, mining=mining))
    mem = jax.jit(f).lower(x).compile().memory_analysis()
    assert mem is not None and mem.temp_size_in_bytes < cube / 4, mining


@pytest.mark.parametrize("d_ap, chosen", [(0.5, 2), (0.9, 2), (0.3, 4)])
def test_semi_hard_tie_picks_the_lowest_column(d_ap, chosen):
  # Anchor 0, positive 1, negatives 2 and 3 at the same distance 0.7 and
  # negative 4 at 0.4. d_ap = 0.5: the closest farther negative is the tie
  # 2/3; d_ap = 0.9: none is farther, the farthest is the tie 2/3; d_ap =
  # 0.3: negative 4. Ties go to the lowest column; the gradient shows which.
  d = np.full((5, 5), 1.0, np.float32)
  d[0, 1] = d[1, 0] = d_ap
  d[0, 2] = d[0, 3] = 0.7
  d[0, 4] = 0.4
  labels = jnp.array([0, 0, 1, 1, 2])
  pos_mask = np.zeros((5, 5), bool)
  pos_mask[0, 1] = True  # only anchor 0's positive pair counts
  g = jax.grad(lambda d: losses.triplet_margin_loss_from_distance(
      d, labels, margin=1.0, mining="semi_hard", pos_mask=pos_mask))(
          jnp.asarray(d))
  row = np.asarray(g)[0]
  assert row[1] > 0 and row[chosen] < 0
  assert np.count_nonzero(row[2:]) == 1


# pytorch-metric-learning's options (issue 40 item 2): swap, smooth_loss,
# triplets_per_anchor, against PML 2.9 in float64.


def _pml():
  return pytest.importorskip("pytorch_metric_learning.losses")


# Slow (PML in float64, several compiles): CI runs it.
@pytest.mark.slow
def test_swap_and_smooth_loss_equal_pytorch_metric_learning():
  from tests.losses import pml_checks
  pml = _pml()
  x, y = pml_checks.batch(seed=1), pml_checks.LABELS
  for kw in ({"swap": True}, {"smooth_loss": True},
             {"swap": True, "smooth_loss": True}):
    want = pml_checks.pml_vg(pml.TripletMarginLoss(margin=0.1, **kw), x, y)
    pml_checks.close(pml_checks.vg(losses.triplet_margin_loss, x, y,
                                   margin=0.1, **kw), want)
  pml_checks.close(pml_checks.sharded_dense(
      losses.triplet_margin_loss, x, y, margin=0.1, **kw), want)


# Slow (PML in float64, several compiles): CI runs it.
@pytest.mark.slow
def test_sampled_triplets_equal_pmls_loss_on_the_same_triplets():
  import torch
  from tests.losses import pml_checks
  pml = _pml()
  x, y = pml_checks.batch(seed=1), pml_checks.LABELS
  key = jax.random.PRNGKey(3)
  same = y[:, None] == y[None, :]
  pos, neg = same & ~np.eye(16, dtype=bool), ~same
  p, n = map(np.asarray, losses.triplet.sample_triplets(
      jnp.asarray(pos), jnp.asarray(neg), 3, jax.random.fold_in(key, 0)))
  assert pos[np.arange(15)[:, None], p[:15]].all()  # row 15: no positive
  assert neg[np.arange(16)[:, None], n].all()
  a = np.repeat(np.arange(15), 3)
  triplets = tuple(torch.tensor(v, dtype=torch.int64)
                   for v in (a, p[:15].ravel(), n[:15].ravel()))
  want = pml_checks.pml_vg(pml.TripletMarginLoss(margin=0.1, swap=True), x,
                           y, indices_tuple=triplets)
  got = pml_checks.vg(losses.triplet_margin_loss, x, y, margin=0.1,
                      swap=True, triplets_per_anchor=3, key=key)
  pml_checks.close(got, want)
  # The same key, the same triplets; as a config's string too.
  again = pml_checks.vg(losses.triplet_margin_loss, x, y, margin=0.1,
                        swap=True, triplets_per_anchor="3", key=key)
  assert float(again[0]) == float(got[0])


def test_the_options_defaults_are_pmls():
  pml = _pml()
  loss = pml.TripletMarginLoss()
  defaults = losses.get_loss("triplet").defaults
  for name in ("swap", "smooth_loss", "triplets_per_anchor"):
    assert defaults[name] == getattr(loss, name), name


@pytest.mark.parametrize("kw,match", [
    ({"triplets_per_anchor": 2}, r"pass a PRNG `key`"),
    ({"triplets_per_anchor": 0, "key": jax.random.PRNGKey(0)},
     r"\"all\" or a positive integer"),
    ({"swap": True, "mining": "batch_hard"}, r"mining=\"all\""),
])
def test_bad_options_are_one_line(kw, match):
  x, y = jnp.ones((4, 3)), jnp.array([0, 0, 1, 1])
  with pytest.raises(ValueError, match=match) as err:
    losses.triplet_margin_loss(x, y, **kw)
  assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    f"triplet_{m}{s}" for m in ("all", "batch_hard", "semi_hard")
    for s in ("", "_masked")])
def test_matches_float64_reference(case_values, name):
  check_pair_case(case_values, name)


@pytest.mark.slow
def test_jit_and_vmap_equal_eager():
  _, y = pair_batch(17)
  xs = np.stack([pair_batch(17)[0], pair_batch(18)[0]])
  f = lambda x: losses.triplet_margin_loss(x, jnp.asarray(y), mining="all")
  eager = float(f(xs[0]))
  np.testing.assert_allclose(float(jax.jit(f)(xs[0])), eager, rtol=1e-6)
  got = np.asarray(jax.jit(jax.vmap(f))(xs))
  np.testing.assert_allclose(got[0], eager, rtol=1e-6)
  np.testing.assert_allclose(got[1], triplet_ref(xs[1], y, 0.2, "all"),
                             rtol=2e-5)
