"""Tests of the Circle loss and the unified loss (Sun et al., CVPR 2020)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax.losses import (
    circle_loss,
    circle_loss_class_level,
    circle_loss_from_similarity,
    pair_weights,
    unified_loss,
    unified_loss_class_level,
    unified_loss_from_similarity,
)
from tests.losses import reference as ref
from tests.losses.reference import (ref_circle_anchor, ref_class_level,
                                    ref_pair_loss, ref_unified_anchor)

LOG2 = float(np.log(2.0))


# ----------------------------------------------------------------------------
# Float64 references, written naively: one anchor at a time.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# Data.
# ----------------------------------------------------------------------------

LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 4, 2], np.int32)


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(12, 6)).astype(np.float32)
  return x, LABELS


def _binary_similarity(s_p, s_n):
  """3 samples, labels [0, 0, 1]: anchors 0 and 1 each see exactly one
  positive (s_p) and one negative (s_n); anchor 2 has no positive."""
  return np.array([[1.0, s_p, s_n], [s_p, 1.0, s_n], [s_n, s_n, 1.0]],
                  np.float32)


# Compiled once per input shape and reused by the tests below: hyperparameters
# are traced keyword arguments, so new values do not recompile.
CIRCLE = jax.jit(circle_loss)
UNIFIED = jax.jit(unified_loss)
CIRCLE_S = jax.jit(circle_loss_from_similarity)
UNIFIED_S = jax.jit(unified_loss_from_similarity)
CIRCLE_C = jax.jit(circle_loss_class_level)
UNIFIED_C = jax.jit(unified_loss_class_level)
CIRCLE_S_GRAD = jax.jit(jax.grad(circle_loss_from_similarity))


# ----------------------------------------------------------------------------
# Values.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "s_p, s_n, margin, gamma, want",
    [
        # On the decision circle: alpha_p = alpha_n = 0.5, both margins hit.
        (0.75, 0.25, 0.25, 8.0, LOG2),
        # alpha_p = 0.25, s_p - Delta_p = 0.25; alpha_n = 0.25,
        # s_n - Delta_n = -0.25: softplus(8 * (-1/16 - 1/16)) = softplus(-1).
        (1.0, 0.0, 0.25, 8.0, float(np.log1p(np.exp(-1.0)))),
        # s_n < -m: alpha_n = 0 so the negative logit is 0; alpha_p = 1.0,
        # s_p - Delta_p = -0.2: softplus(0 + 4 * 1.0 * 0.2) = softplus(0.8).
        (0.4, -0.5, 0.4, 4.0, float(np.log1p(np.exp(0.8)))),
    ],
)
def test_circle_hand_computed_binary_cases(s_p, s_n, margin, gamma, want):
  got = CIRCLE_S(
      _binary_similarity(s_p, s_n), np.array([0, 0, 1]), margin=margin,
      gamma=gamma)
  assert got.dtype == jnp.float32 and got.shape == ()
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


def test_unified_hand_computed_binary_case():
  # log(1 + exp(10 * (0.2 - 0.5 + 0.1))) = log(1 + e^-2).
  got = UNIFIED_S(
      _binary_similarity(0.5, 0.2), np.array([0, 0, 1]), gamma=10.0,
      margin=0.1)
  np.testing.assert_allclose(float(got), np.log1p(np.exp(-2.0)), rtol=1e-6)


@pytest.mark.parametrize(
    "loss_fn, anchor_fn, hyper",
    [
        (CIRCLE, ref_circle_anchor, dict(margin=0.4, gamma=80.0)),
        (CIRCLE, ref_circle_anchor, dict(margin=0.25, gamma=256.0)),
        (UNIFIED, ref_unified_anchor, dict(margin=0.4, gamma=80.0)),
        (UNIFIED, ref_unified_anchor, dict(margin=0.1, gamma=2.0)),
    ],
)
def test_pair_losses_match_float64_reference(batch, loss_fn, anchor_fn, hyper):
  x, labels = batch
  got = loss_fn(x, labels, **hyper)
  want = ref_pair_loss(anchor_fn, ref.cos(x), labels, **hyper)
  np.testing.assert_allclose(float(got), want, rtol=2e-5, atol=1e-5)


def test_miner_masks_are_intersected_with_labels(batch):
  x, labels = batch
  rng = np.random.default_rng(1)
  pos_mask = rng.random((12, 12)) < 0.6
  neg_mask = rng.random((12, 12)) < 0.6
  for loss_fn, anchor_fn in [(CIRCLE, ref_circle_anchor),
                             (UNIFIED, ref_unified_anchor)]:
    got = loss_fn(x, labels, pos_mask=pos_mask, neg_mask=neg_mask)
    want = ref_pair_loss(anchor_fn, ref.cos(x), labels, pos_mask, neg_mask,
                         margin=0.4, gamma=80.0)
    np.testing.assert_allclose(float(got), want, rtol=2e-5)
    assert abs(float(got) - float(loss_fn(x, labels))) > 1e-3


def test_similarity_form_equals_embedding_form(batch):
  x, labels = batch
  s = ref.cos(x).astype(np.float32)
  np.testing.assert_allclose(float(CIRCLE_S(s, labels)),
                             float(CIRCLE(x, labels)), rtol=1e-5)
  np.testing.assert_allclose(float(UNIFIED_S(s, labels)),
                             float(UNIFIED(x, labels)), rtol=1e-5)


@pytest.mark.parametrize(
    "loss_fn, anchor_fn, hyper",
    [
        (CIRCLE_C, ref_circle_anchor, dict(margin=0.25, gamma=256.0)),
        (UNIFIED_C, ref_unified_anchor, dict(margin=0.35, gamma=64.0)),
    ],
)
def test_class_level_matches_float64_reference(batch, loss_fn, anchor_fn,
                                               hyper):
  x, labels = batch
  w = np.random.default_rng(2).normal(size=(5, 6)).astype(np.float32)
  got = loss_fn(x, labels, w, **hyper)
  want = ref_class_level(anchor_fn, x, labels, w, **hyper)
  np.testing.assert_allclose(float(got), want, rtol=2e-5)


def test_class_level_defaults_are_the_papers():
  x = np.random.default_rng(3).normal(size=(4, 3)).astype(np.float32)
  w = np.random.default_rng(4).normal(size=(3, 3)).astype(np.float32)
  y = np.array([0, 1, 2, 1])
  np.testing.assert_allclose(
      float(CIRCLE_C(x, y, w)),
      ref_class_level(ref_circle_anchor, x, y, w, margin=0.25, gamma=256.0),
      rtol=2e-5)
  np.testing.assert_allclose(
      float(UNIFIED_C(x, y, w)),
      ref_class_level(ref_unified_anchor, x, y, w, margin=0.35, gamma=64.0),
      rtol=2e-5)


# ----------------------------------------------------------------------------
# The paper's degenerations of the unified loss.
# ----------------------------------------------------------------------------


def test_unified_class_level_is_am_softmax(batch):
  """Eq. (2): class-level labels and cosine similarity give AM-Softmax."""
  x, labels = batch
  w = np.random.default_rng(5).normal(size=(5, 6)).astype(np.float32)
  gamma, margin = 30.0, 0.35
  cos = ref.cos(x, w)
  logits = gamma * (cos - margin * np.eye(5)[labels])
  want = optax.softmax_cross_entropy_with_integer_labels(
      jnp.asarray(logits, jnp.float32), jnp.asarray(labels)).mean()
  got = UNIFIED_C(x, labels, w, gamma=gamma, margin=margin)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  # The gradients agree too (w.r.t. embeddings and class weights).
  def am_softmax(x, w):
    cos = (x / jnp.linalg.norm(x, axis=1, keepdims=True)) @ (
        w / jnp.linalg.norm(w, axis=1, keepdims=True)).T
    logits = gamma * (cos - margin * jax.nn.one_hot(labels, 5))
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()
  got_g = jax.jit(jax.grad(lambda x, w: unified_loss_class_level(
      x, labels, w, gamma=gamma, margin=margin), argnums=(0, 1)))(x, w)
  want_g = jax.jit(jax.grad(am_softmax, argnums=(0, 1)))(x, w)
  for a, b in zip(got_g, want_g):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_unified_over_gamma_tends_to_hard_mined_triplet(batch):
  """Eq. (3): (1/gamma) L_uni -> mean_i [max s_n - min s_p + m]_+."""
  x, labels = batch
  s = ref.cos(x)
  margin = 0.4
  hinge, log_pairs = [], []
  for i in range(len(labels)):
    sp, sn = ref.anchor_sets(s, labels, i)
    if sp.size and sn.size:
      hinge.append(max(sn.max() - sp.min() + margin, 0.0))
      log_pairs.append(np.log(sp.size * sn.size) + np.log(2.0))
  triplet = float(np.mean(hinge))
  # Per anchor 0 <= l / gamma - hinge <= log(2 |P| |N|) / gamma.
  slack = float(np.mean(log_pairs))
  gaps = []
  for gamma in [1.0, 10.0, 100.0, 1e4]:
    scaled = float(UNIFIED_S(s.astype(np.float32), labels, gamma=gamma,
                             margin=margin)) / gamma
    gap = scaled - triplet
    assert -1e-5 <= gap <= slack / gamma + 1e-5, (gamma, gap)
    gaps.append(gap)
  assert gaps == sorted(gaps, reverse=True) and gaps[0] > 0.1
  assert gaps[-1] < 1e-3


# ----------------------------------------------------------------------------
# Gradients.
# ----------------------------------------------------------------------------


def test_circle_gradients_are_the_papers_closed_form():
  """Eqs. (9)-(10) with Z = 1 - exp(-L), divided by the number of anchors."""
  rng = np.random.default_rng(6)
  labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3], np.int32)
  n = len(labels)
  # Not symmetric, and inside the unclipped region s_n > -m (eqs. 9-10 do
  # not model the [.]_+ of alpha).
  s = rng.uniform(-0.2, 0.99, size=(n, n))
  margin, gamma = 0.25, 32.0
  got = np.asarray(CIRCLE_S_GRAD(
      s.astype(np.float32), labels, margin=margin, gamma=gamma))
  want = np.zeros((n, n))
  for i in range(n):
    pos = [j for j in range(n) if labels[j] == labels[i] and j != i]
    neg = [j for j in range(n) if labels[j] != labels[i]]
    loss_i = ref_circle_anchor(s[i, pos], s[i, neg], margin, gamma)
    z = 1.0 - np.exp(-loss_i)
    en = np.exp(gamma * (s[i, neg] ** 2 - margin**2))
    ep = np.exp(gamma * ((s[i, pos] - 1) ** 2 - margin**2))
    want[i, neg] = z * en / en.sum() * gamma * (s[i, neg] + margin)
    want[i, pos] = z * ep / ep.sum() * gamma * (s[i, pos] - 1 - margin)
  # Anchor 8 (label 3) has no positive: it contributes nothing and is not
  # counted in the mean.
  want /= n - 1
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  # alpha is a constant in backprop: the derivative of the value (alpha
  # differentiated too) is different; finite differences of the float64
  # reference at a negative pair show it.
  i, h = 0, 1e-6
  j = int(np.argmax(got[i]))  # the most weighted negative of anchor 0
  plus, minus = s.copy(), s.copy()
  plus[i, j] += h
  minus[i, j] -= h
  fd = (ref_pair_loss(ref_circle_anchor, plus, labels, margin=margin,
                      gamma=gamma) -
        ref_pair_loss(ref_circle_anchor, minus, labels, margin=margin,
                      gamma=gamma)) / (2 * h)
  # d/ds [gamma (s + m)(s - m)] = 2 gamma s instead of gamma (s + m).
  full = want[i, j] * 2 * s[i, j] / (s[i, j] + margin)
  np.testing.assert_allclose(fd, full, rtol=1e-4)
  assert not np.isclose(fd, got[i, j], rtol=1e-2)


def test_circle_clipped_alphas_give_zero_gradient():
  # s_n = -0.6 < -m: alpha_n = 0; s_p = 1.5 > 1 + m: alpha_p = 0.
  s = _binary_similarity(0.8, -0.1)
  s[0, 2] = -0.6
  s[1, 0] = 1.5
  g = np.asarray(CIRCLE_S_GRAD(s, np.array([0, 0, 1]), margin=0.4,
                               gamma=80.0))
  assert g[0, 2] == 0.0 and g[1, 0] == 0.0
  assert g[0, 1] != 0.0 and g[1, 2] != 0.0


def test_pair_weights_of_circle_match_signs():
  """Positives are pulled (dL/ds_p < 0), negatives pushed (dL/ds_n > 0)."""
  rng = np.random.default_rng(7)
  s = rng.uniform(-0.3, 0.9, size=(6, 6)).astype(np.float32)
  labels = np.array([0, 0, 1, 1, 2, 2])
  g = np.asarray(CIRCLE_S_GRAD(s, labels))
  w_pos, w_neg = jax.jit(functools.partial(
      pair_weights, circle_loss_from_similarity))(s, labels)
  same = labels[:, None] == labels[None, :]
  pos = same & ~np.eye(6, dtype=bool)
  assert np.all(g[pos] < 0) and np.all(g[~same] > 0)
  np.testing.assert_array_equal(np.asarray(w_pos)[pos], -g[pos])
  np.testing.assert_array_equal(np.asarray(w_neg)[~same], g[~same])


@pytest.mark.parametrize("which", ["unified", "unified_class"])
def test_check_grads(which):
  # (Circle's alphas are constants in backprop, so its gradient is by design
  # not the finite difference of its value: it is checked against the
  # paper's closed form above instead.)
  rng = np.random.default_rng(8)
  x = rng.normal(size=(6, 4)).astype(np.float32)
  labels = np.array([0, 0, 1, 1, 2, 2])
  w = rng.normal(size=(3, 4)).astype(np.float32)
  if which == "unified":
    f = lambda x: UNIFIED(x, labels, gamma=4.0, margin=0.2)
  else:
    f = lambda x: UNIFIED_C(x, labels, w, gamma=4.0, margin=0.2)
  check_grads(f, (x,), order=1, modes=("rev",), eps=1e-3, atol=2e-3,
              rtol=2e-3)


# ----------------------------------------------------------------------------
# The decision boundary of the binary case is a circle.
# ----------------------------------------------------------------------------


def test_binary_decision_boundary_is_the_circle():
  """alpha_n (s_n - m) - alpha_p (s_p - 1 + m) = 0 iff
  s_n^2 + (s_p - 1)^2 = 2 m^2, i.e. the binary loss equals log 2."""
  margin, gamma = 0.4, 80.0
  labels = np.array([0, 0, 1])
  loss = jax.jit(jax.vmap(
      lambda s: CIRCLE_S(s, labels, margin=margin,
                                            gamma=gamma)))
  build = jax.vmap(lambda sp, sn: jnp.array(
      [[1.0, sp, sn], [sp, 1.0, sn], [sn, sn, 1.0]]))
  # Points on the circle inside the region alpha_n > 0, s_p <= 1.
  theta = np.linspace(-2.2, 0.0, 23)
  r = np.sqrt(2.0) * margin
  sn, sp = r * np.cos(theta), 1.0 + r * np.sin(theta)
  on = np.asarray(loss(build(jnp.asarray(sp, jnp.float32),
                             jnp.asarray(sn, jnp.float32))))
  np.testing.assert_allclose(on, LOG2, atol=2e-5)
  # A grid: inside the circle the loss is below log 2, outside above.
  grid_sp, grid_sn = np.meshgrid(np.linspace(0.0, 1.0, 21),
                                 np.linspace(-0.35, 1.0, 28))
  grid_sp, grid_sn = grid_sp.ravel(), grid_sn.ravel()
  side = grid_sn**2 + (grid_sp - 1.0) ** 2 - 2 * margin**2
  keep = np.abs(side) > 1e-2
  vals = np.asarray(loss(build(jnp.asarray(grid_sp, jnp.float32),
                               jnp.asarray(grid_sn, jnp.float32))))
  np.testing.assert_array_equal(np.sign(vals - LOG2)[keep], np.sign(side)[keep])


# ----------------------------------------------------------------------------
# jit, vmap, retracing and devices.
# ----------------------------------------------------------------------------


def test_jit_vmap_and_no_retracing(batch):
  x, labels = batch
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x, labels):
    return circle_loss(x, labels, margin=0.25, gamma=64.0)

  want = ref_pair_loss(ref_circle_anchor, ref.cos(x), labels, margin=0.25,
                       gamma=64.0)
  np.testing.assert_allclose(float(f(x, labels)), want, rtol=2e-5)
  f(x + 1.0, (labels + 1) % 5)  # same shapes: no new trace
  with pytest.raises(AssertionError):
    f(x[:8], labels[:8])  # a new shape retraces, and the guard notices
  # vmap over a leading axis of 3 independent problems.
  xs = np.stack([x, x[::-1], 2 * x + 0.1])
  ys = np.stack([labels, labels[::-1], np.roll(labels, 1)])
  for loss_fn, anchor_fn in ((circle_loss, ref_circle_anchor),
                             (unified_loss, ref_unified_anchor)):
    got = jax.jit(jax.vmap(loss_fn))(xs, ys)
    want = [ref_pair_loss(anchor_fn, ref.cos(a), b, margin=0.4, gamma=80.0)
            for a, b in zip(xs, ys)]
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5)


def _global_value_and_grad(loss_fn, x, labels, mode, pos_mask=None):
  n = jax.device_count()
  assert n == 8
  f = jax.value_and_grad(
      lambda x, y, m: loss_fn(x, y, axis_name="d", pos_mask=m))
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    return jax.jit(jax.shard_map(
        f, mesh=mesh, in_specs=(P("d"), P("d"), P("d")),
        out_specs=(P(), P("d"))))(x, labels, pos_mask)
  b = x.shape[0] // n
  v, g = jax.pmap(f, axis_name="d")(
      x.reshape(n, b, -1), labels.reshape(n, b), pos_mask.reshape(n, b, -1))
  return v[0], g.reshape(x.shape)


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
@pytest.mark.parametrize("loss_fn", [circle_loss, unified_loss])
def test_global_batch_equals_single_device(loss_fn, mode):
  rng = np.random.default_rng(9)
  x = rng.normal(size=(16, 5)).astype(np.float32)
  labels = np.array([0, 1, 2, 3, 4, 5, 6, 7] * 2, np.int32)
  labels[-1] = 9  # one anchor without a positive anywhere
  pos_mask = rng.random((16, 16)) < 0.8
  ref_v, ref_g = jax.jit(jax.value_and_grad(
      lambda x: loss_fn(x, labels, pos_mask=pos_mask)))(x)
  v, g = _global_value_and_grad(loss_fn, x, labels, mode, pos_mask)
  np.testing.assert_allclose(float(v), float(ref_v), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(g), np.asarray(ref_g), atol=1e-5)


# ----------------------------------------------------------------------------
# Numerics and degenerate batches.
# ----------------------------------------------------------------------------


# Jitted value-and-gradient (w.r.t. the embeddings) of each loss, compiled
# once per input shape and dtype; the hyperparameters are traced.
VG = {
    "circle": jax.jit(jax.value_and_grad(circle_loss)),
    "unified": jax.jit(jax.value_and_grad(unified_loss)),
    "circle_class": jax.jit(jax.value_and_grad(circle_loss_class_level)),
    "unified_class": jax.jit(jax.value_and_grad(unified_loss_class_level)),
}
PAIR_SETTINGS = [("circle", dict(gamma=256.0, margin=0.25)),
                 ("circle", dict(gamma=80.0, margin=0.4)),
                 ("unified", dict(gamma=256.0, margin=0.4))]
CLASS_SETTINGS = [("circle_class", dict(gamma=256.0, margin=0.25)),
                  ("unified_class", dict(gamma=256.0, margin=0.35))]


def _finite(name, *args, **hyper):
  v, g = VG[name](*args, **hyper)
  assert v.dtype == jnp.float32 and v.shape == ()
  assert np.isfinite(float(v))
  assert g.dtype == args[0].dtype
  assert np.all(np.isfinite(np.asarray(g, np.float32)))
  return float(v), np.asarray(g, np.float32)


W = np.random.default_rng(10).normal(size=(5, 6)).astype(np.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_large_scales_are_finite(batch, dtype):
  x, labels = batch
  x, w = jnp.asarray(x, dtype), jnp.asarray(W, dtype)
  for name, hyper in PAIR_SETTINGS:
    v, _ = _finite(name, x, labels, **hyper)
    assert v > 0
  for name, hyper in CLASS_SETTINGS:
    v, _ = _finite(name, x, labels, w, **hyper)
    assert v > 0


@pytest.mark.parametrize("labels", [np.zeros(12, np.int32),
                                    np.arange(12, dtype=np.int32)],
                         ids=["one_class", "all_distinct"])
def test_no_positives_or_no_negatives_give_zero_loss_and_gradient(batch,
                                                                  labels):
  x, _ = batch
  for name, hyper in PAIR_SETTINGS:
    for dtype in (jnp.float32, jnp.bfloat16):
      v, g = _finite(name, jnp.asarray(x, dtype), labels, **hyper)
      assert v == 0.0
      np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("case", ["zero", "identical", "huge", "one"])
def test_degenerate_embeddings_are_finite(batch, case):
  x, labels = batch
  unit = x / np.linalg.norm(x, axis=1, keepdims=True)
  if case == "zero":
    x = np.zeros_like(x)
  elif case == "identical":
    x = np.tile(x[:1], (12, 1))
  elif case == "huge":
    x = x * np.float32(1e18)
  elif case == "one":
    x, labels = x[:1], labels[:1]
  for name, hyper in PAIR_SETTINGS:
    v, _ = _finite(name, x, labels, **hyper)
    if case == "huge":  # the loss only sees the direction
      np.testing.assert_allclose(v, _finite(name, unit, labels, **hyper)[0],
                                 rtol=1e-5)
    if case == "one":
      assert v == 0.0
    if case in ("zero", "identical"):  # all similarities 0 (or 1): finite > 0
      assert v > 0
  for name, hyper in CLASS_SETTINGS:
    _finite(name, x, labels, W, **hyper)


@pytest.mark.parametrize("scale", [
    1e30,
    3e38,
])
def test_norms_beyond_the_float32_square_range_keep_their_direction(scale):
  """|x|^2 overflows float32 above ~1.8e19; the loss still sees x / |x|."""
  labels = np.array([0, 0, 1, 1], np.int32)
  x = np.random.default_rng(12).uniform(-1, 1, size=(4, 8)).astype(np.float32)
  want = ref_pair_loss(ref_circle_anchor, ref.cos(x), labels, margin=0.4,
                       gamma=80.0)
  v, _ = _finite("circle", x * np.float32(scale), labels, gamma=80.0,
                 margin=0.4)
  np.testing.assert_allclose(v, want, rtol=1e-5)


# ----------------------------------------------------------------------------
# Bad inputs.
# ----------------------------------------------------------------------------


def test_bad_inputs_name_the_argument():
  x = np.ones((4, 3), np.float32)
  y = np.array([0, 0, 1, 1])
  w = np.ones((2, 3), np.float32)
  for f in (circle_loss, unified_loss):
    with pytest.raises(ValueError, match="embeddings"):
      f(x[0], y)
    with pytest.raises(TypeError, match="embeddings"):
      f(x.astype(np.int32), y)
    with pytest.raises(ValueError, match="labels"):
      f(x, y[:3])
    with pytest.raises(ValueError, match="labels"):
      f(x, y[:, None])
    with pytest.raises(TypeError, match="labels"):
      f(x, y.astype(np.float32))
    with pytest.raises(ValueError, match="gamma"):
      f(x, y, gamma=0.0)
    with pytest.raises(ValueError, match="pos_mask"):
      f(x, y, pos_mask=np.ones((4, 3), bool))
  for f in (circle_loss_class_level, unified_loss_class_level):
    with pytest.raises(ValueError, match="class_weights"):
      f(x, y, np.ones((2, 5), np.float32))
    with pytest.raises(ValueError, match="class_weights"):
      f(x, y, np.ones((3,), np.float32))
    with pytest.raises(TypeError, match="labels"):
      f(x, y.astype(np.float32), w)
    with pytest.raises(ValueError, match="labels"):
      f(x, y[:2], w)
  for f in (circle_loss_from_similarity, unified_loss_from_similarity):
    with pytest.raises(ValueError, match="similarity"):
      f(np.ones((4, 3), np.float32), y)
    with pytest.raises(ValueError, match="labels"):
      f(np.ones((4, 4), np.float32), y[:3])
