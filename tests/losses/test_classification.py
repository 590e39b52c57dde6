"""Tests of the softmax / NormFace / CosFace / ArcFace losses."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax import losses
from tests.losses import reference as ref
from tests.losses.reference import arcface_ref, cosface_ref, softmax_ref

_RNG = np.random.default_rng(0)
_C, _D = 6, 4
_Y = np.array([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3])
_W = _RNG.normal(size=(_C, _D)).astype(np.float32)
_BIAS = _RNG.normal(size=(_C,)).astype(np.float32)
_X = _RNG.normal(size=(16, _D)).astype(np.float32)
# Two samples pointing away from their class weight (theta_y + m > pi), to
# reach ArcFace's fallback branch.
_X[0] = -_W[0] + 0.05 * _RNG.normal(size=_D)
_X[1] = -_W[1]


_CASES = {
    "softmax": (lambda x, y, w: losses.softmax_loss(x, y, w),
                lambda: softmax_ref(_X, _Y, _W)),
    "softmax_bias": (lambda x, y, w: losses.softmax_loss(x, y, w,
                                                         bias=_BIAS),
                     lambda: softmax_ref(_X, _Y, _W, _BIAS)),
    "normface": (lambda x, y, w: losses.normface_loss(x, y, w, scale=5.0),
                 lambda: cosface_ref(_X, _Y, _W, 0.0, 5.0)),
    "cosface": (lambda x, y, w: losses.cosface_loss(x, y, w),
                lambda: cosface_ref(_X, _Y, _W, 0.35, 64.0)),
    "cosface_small": (lambda x, y, w: losses.cosface_loss(x, y, w,
                                                          margin=0.1,
                                                          scale=3.0),
                      lambda: cosface_ref(_X, _Y, _W, 0.1, 3.0)),
    "arcface": (lambda x, y, w: losses.arcface_loss(x, y, w),
                lambda: arcface_ref(_X, _Y, _W, 0.5, 64.0)),
    "arcface_small": (lambda x, y, w: losses.arcface_loss(x, y, w,
                                                          margin=0.3,
                                                          scale=4.0),
                      lambda: arcface_ref(_X, _Y, _W, 0.3, 4.0)),
    "arcface_easy": (lambda x, y, w: losses.arcface_loss(
        x, y, w, margin=0.3, scale=4.0, easy_margin=True),
                     lambda: arcface_ref(_X, _Y, _W, 0.3, 4.0, True)),
}


@pytest.fixture(scope="module")
def values():
  @jax.jit
  def run(x, y, w):
    out = {name: fn(x, y, w) for name, (fn, _) in _CASES.items()}
    # Hand-computed: x = e0, W = [e0, e1], scale 2, margin 0.5.
    e = jnp.eye(2, dtype=jnp.float32)
    y0 = jnp.array([0])
    out["hand_cosface"] = losses.cosface_loss(e[:1], y0, e, margin=0.5,
                                              scale=2.0)
    out["hand_arcface"] = losses.arcface_loss(e[:1], y0, e, margin=0.5,
                                              scale=2.0)
    out["hand_softmax"] = losses.softmax_loss(3.0 * e[:1], y0, e)
    return out
  return jax.tree.map(np.asarray, run(_X, _Y, _W))


def test_fallback_branch_is_exercised():
  c = ref.cos(_X, _W)
  assert np.arccos(c[0, 0]) + 0.5 > np.pi and np.arccos(c[1, 1]) + 0.5 > np.pi


@pytest.mark.parametrize("name", sorted(_CASES))
def test_matches_float64_reference(values, name):
  np.testing.assert_allclose(float(values[name]), _CASES[name][1](),
                             rtol=2e-5)


def test_hand_computed(values):
  # cos = [1, 0]: CosFace logits [2 (1 - 0.5), 0] = [1, 0];
  # ArcFace: theta = 0, cos(0.5) target; softmax: logits [3, 0].
  np.testing.assert_allclose(values["hand_cosface"], np.log1p(np.exp(-1.0)),
                             rtol=1e-6)
  np.testing.assert_allclose(values["hand_arcface"],
                             np.log1p(np.exp(-2 * np.cos(0.5))), rtol=1e-6)
  np.testing.assert_allclose(values["hand_softmax"], np.log1p(np.exp(-3.0)),
                             rtol=1e-6)


def test_check_grads_and_finite_gradient_at_theta_zero():
  @jax.jit
  def f(x, w):
    return (losses.softmax_loss(x, _Y, w)
            + 2.0 * losses.cosface_loss(x, _Y, w, scale=3.0)
            + 3.0 * losses.arcface_loss(x, _Y, w, margin=0.3, scale=3.0))
  x = _X.copy()
  x[0] = -_W[0] + 0.3  # keep the numerical check away from theta = pi
  check_grads(f, (x, _W), order=1, modes=["rev"], eps=1e-3, atol=2e-2,
              rtol=2e-2)
  # Embedding exactly on its class weight (theta = 0, sin theta = 0) and
  # exactly opposite (theta = pi): finite gradients, bf16 in.
  xb = jnp.asarray(_X).at[2].set(_W[2]).at[1].set(-_W[1]).astype(
      jnp.bfloat16)
  v, g = jax.jit(jax.value_and_grad(
      lambda x: losses.arcface_loss(x, _Y, _W)))(xb)
  assert v.dtype == jnp.float32 and np.isfinite(float(v))
  assert np.all(np.isfinite(np.asarray(g, np.float32)))


def test_bad_inputs_raise_clear_errors():
  with pytest.raises(ValueError, match="class_weights"):
    losses.cosface_loss(_X, _Y, _W[0])
  with pytest.raises(ValueError, match="dimension"):
    losses.arcface_loss(_X, _Y, _W[:, :2])
  with pytest.raises(ValueError, match="bias"):
    losses.softmax_loss(_X, _Y, _W, bias=_BIAS[:2])
  with pytest.raises(ValueError, match="scale"):
    losses.normface_loss(_X, _Y, _W, scale=-1.0)
  with pytest.raises(TypeError, match="labels"):
    losses.softmax_loss(_X, _Y.astype(np.float32), _W)


def _all(x, y, w, axis_name=None):
  return jnp.stack([
      losses.softmax_loss(x, y, w, axis_name=axis_name),
      losses.normface_loss(x, y, w, axis_name=axis_name),
      losses.cosface_loss(x, y, w, scale=3.0, axis_name=axis_name),
      losses.arcface_loss(x, y, w, scale=3.0, axis_name=axis_name),
  ])


def _value_and_jacobians(f):
  return lambda *a: (f(*a), jax.jacrev(f, argnums=(0, 2))(*a))


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_global_batch_equals_single_device(mode):
  ref_v, (ref_gx, ref_gw) = jax.jit(_value_and_jacobians(_all))(_X, _Y, _W)
  local = _value_and_jacobians(functools.partial(_all, axis_name="d"))
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, (gx, gw) = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P("d"), P("d"), P()),
        out_specs=(P(), (P(None, "d"), P()))))(_X, _Y, _W)
  else:
    def per_device(x, y, w):
      v, (gx, gw) = local(x, y, w)
      return v, (gx, jax.lax.psum(gw, "d"))
    v, (gx, gw) = jax.pmap(per_device, axis_name="d",
                           in_axes=(0, 0, None))(
                               _X.reshape(8, 2, _D), _Y.reshape(8, 2), _W)
    v, gw = v[0], gw[0]
    gx = jnp.moveaxis(gx, 0, 1).reshape(ref_gx.shape)
  np.testing.assert_allclose(np.asarray(v), np.asarray(ref_v), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(gx), np.asarray(ref_gx), atol=1e-5)
  np.testing.assert_allclose(np.asarray(gw), np.asarray(ref_gw), atol=1e-5)


# Slow (PyTorch and PML imported, eager ops): CI runs it.
@pytest.mark.slow
def test_subcenter_arcface_outliers_equal_pmls_get_outliers():
  # PML's SubCenterArcFaceLoss.get_outliers (issue 40 item 2); class 4 has
  # no sample (PML leaves its centre uninitialised: not compared).
  torch = pytest.importorskip("torch")
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  c, k, d = 5, 3, 8
  rng = np.random.default_rng(4)
  x = rng.normal(size=(16, d))
  y = np.arange(16) % 4
  w = rng.normal(size=(c * k, d))
  for threshold in (75.0, 60.0):
    loss = pml.SubCenterArcFaceLoss(num_classes=c, embedding_size=d,
                                    sub_centers=k)
    loss.W.data = torch.tensor(w.T)
    idx, centers = loss.get_outliers(torch.tensor(x), torch.tensor(y),
                                     threshold=threshold)
    mask, got = losses.subcenter_arcface_outliers(
        jnp.asarray(x), jnp.asarray(y), jnp.asarray(w), centers_per_class=k,
        threshold=threshold)
    np.testing.assert_array_equal(np.flatnonzero(mask), np.sort(idx.numpy()))
    np.testing.assert_allclose(np.asarray(got)[:4], centers.numpy().T[:4],
                               rtol=1e-6)
    assert 0 < mask.sum() < 16  # some outliers, not all
  np.testing.assert_array_equal(np.asarray(got)[4], np.float32(w[4 * k]))


# --- Unicom's subspace ArcFace (issue 41) -----------------------------------

_K = 5  # of _D2 = 8 dimensions
_D2 = 8
_XS = _RNG.normal(size=(8, _D2))
_YS = np.array([0, 1, 2, 3, 4, 0, 1, 2])
_WS = _RNG.normal(size=(5, _D2))
_XS[0] = -_WS[0]  # theta = pi: past pi - m, where the code has no extension


def unicom_official(x, y, w, features, s, m):
  """A float64 transcription of the official loss (deepglint/unicom,
  ``unicom/partial_fc.py``: ``PartialFC_V2.forward`` on one rank with
  ``sample_rate=1`` and ``CombinedMarginLoss`` with ``m1=1, m3=0``, and
  ``DistCrossEntropyFunc`` with its hand-written backward), the drawn
  feature ids (``ids_shuffle``) given as ``features``. Returns the value and
  the gradients w.r.t. ``x`` and ``w``."""
  import torch  # pylint: disable=import-outside-toplevel
  from torch.nn.functional import linear, normalize  # pylint: disable=import-outside-toplevel

  class DistCrossEntropyFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, label):
      batch_size = logits.size(0)
      max_logits, _ = torch.max(logits, dim=1, keepdim=True)
      logits.sub_(max_logits)
      logits.exp_()
      logits.div_(torch.sum(logits, dim=1, keepdim=True))
      index = torch.where(label != -1)[0]
      loss = torch.zeros(batch_size, 1, dtype=logits.dtype)
      loss[index] = logits[index].gather(1, label[index])
      ctx.save_for_backward(index, logits, label)
      return loss.clamp_min_(1e-30).log_().mean() * (-1)

    @staticmethod
    def backward(ctx, loss_gradient):
      index, logits, label = ctx.saved_tensors
      one_hot = torch.zeros(size=[index.size(0), logits.size(1)],
                            dtype=logits.dtype)
      one_hot.scatter_(1, label[index], 1)
      logits[index] -= one_hot
      logits.div_(logits.size(0))
      return logits * loss_gradient.item(), None

  xt = torch.tensor(x, requires_grad=True)
  wt = torch.tensor(w, requires_grad=True)
  labels = torch.tensor(y).long().view(-1, 1)
  ids_shuffle = torch.tensor(np.asarray(features)).long()
  weight = wt.index_select(1, ids_shuffle)
  embeddings = xt.index_select(1, ids_shuffle)
  logits = linear(normalize(embeddings), normalize(weight)).clamp(-1, 1)
  index_positive = torch.where(labels != -1)[0]
  target_logit = logits[index_positive, labels[index_positive].view(-1)]
  with torch.no_grad():
    target_logit.arccos_()
    logits.arccos_()
    final_target_logit = target_logit + m
    logits[index_positive, labels[index_positive].view(-1)] = (
        final_target_logit)
    logits.cos_()
  logits = logits * s
  loss = DistCrossEntropyFunc.apply(logits, labels)
  loss.backward()
  return loss.item(), xt.grad.numpy(), wt.grad.numpy()


def _subspace(x, y, w, **hyper):
  return jax.value_and_grad(losses.subspace_arcface_loss, argnums=(0, 2))(
      jnp.asarray(x, jnp.float32), jnp.asarray(y), jnp.asarray(w, jnp.float32),
      **hyper)


def _subspace_ref(x, y, w, features, s, m):
  """Naive float64 value: the normalised restricted vectors, the code's
  target ``cos(arccos(c) + m)`` (no extension), a loop over samples."""
  xs, ws = x[:, features], w[:, features]
  total = 0.0
  for i in range(len(y)):
    xi = xs[i] / np.linalg.norm(xs[i])
    logits = []
    for c in range(len(ws)):
      cos_c = np.clip(xi @ ws[c] / np.linalg.norm(ws[c]), -1.0, 1.0)
      logits.append(s * (np.cos(np.arccos(cos_c) + m) if c == y[i]
                         else cos_c))
    total += np.log(np.sum(np.exp(logits))) - logits[y[i]]
  return total / len(y)


@jax.jit
def _subspace_cases(x, w, x_away, key):
  """Every case of the next test in one compiled program."""
  loss_grads = jax.value_and_grad(losses.subspace_arcface_loss,
                                  argnums=(0, 2))
  grads = lambda x, class_weights, **hyper: loss_grads(
      x, _YS, class_weights, **hyper)
  dims = losses.subspace_indices(key, _D2, _K)
  arc = dict(straight_through=False, scale=4.0, margin=0.3)
  return {
      "dims": dims,
      "other_dims": losses.subspace_indices(jax.random.PRNGKey(8), _D2, _K),
      "drawn": grads(x, class_weights=w, num_features=_K, key=key),
      "given": grads(x, class_weights=w, features=dims),
      "not_st": grads(x_away, class_weights=w, features=dims, **arc),
      "arcface": jax.value_and_grad(losses.arcface_loss, argnums=(0, 2))(
          jnp.take(x_away, dims, 1), _YS, jnp.take(w, dims, 1), scale=4.0,
          margin=0.3),
      "full": losses.subspace_arcface_loss(x_away, _YS, w, num_features=_D2,
                                           **arc),
  }


def test_subspace_arcface_value_subspace_and_variants():
  x_away = _XS.copy()
  x_away[0] = -_WS[0] + 0.3  # away from theta = pi for the ArcFace checks
  out = jax.tree.map(np.asarray, _subspace_cases(
      jnp.asarray(_XS, jnp.float32), jnp.asarray(_WS, jnp.float32),
      jnp.asarray(x_away, jnp.float32), jax.random.PRNGKey(7)))
  dims = out["dims"]
  assert len(set(dims)) == _K and set(dims) <= set(range(_D2))
  # Another step, another subspace.
  assert set(out["other_dims"]) != set(dims)
  v, (gx, gw) = out["drawn"]
  np.testing.assert_allclose(
      float(v), _subspace_ref(_XS, _YS, _WS, dims, 32.0, 0.25), rtol=3e-5)
  outside = np.setdiff1d(np.arange(_D2), dims)  # not this step's: no grad
  assert np.all(gx[:, outside] == 0) and np.all(gw[:, outside] == 0)
  assert np.abs(gx[:, dims]).min() > 0
  # The same dimensions passed as `features`: the same step.
  v2, (gx2, _) = out["given"]
  np.testing.assert_allclose([v2, *gx2.ravel()], [v, *gx.ravel()],
                             rtol=1e-6)
  # straight_through=False is ArcFace (with its extension past pi - m) on S.
  a, (ax, aw) = out["not_st"]
  b, (bx, bw) = out["arcface"]
  np.testing.assert_allclose([a, *ax[:, dims].ravel(), *aw[:, dims].ravel()],
                             [b, *bx.ravel(), *bw.ravel()], rtol=1e-5,
                             atol=1e-7)
  # k >= D: every dimension, no key needed.
  np.testing.assert_allclose(out["full"],
                             arcface_ref(x_away, _YS, _WS, 0.3, 4.0),
                             rtol=1e-5)


def test_subspace_arcface_check_grads():
  dims = jnp.array([0, 2, 3, 5, 7])
  x = _XS.copy()
  x[0] = -_WS[0] + 0.3

  @jax.jit
  def f(x, w):
    return losses.subspace_arcface_loss(
        x, _YS, w, features=dims, straight_through=False, margin=0.3,
        scale=3.0)
  check_grads(f, (x.astype(np.float32), _WS.astype(np.float32)), order=1,
              modes=["rev"], eps=1e-3, atol=2e-2, rtol=2e-2)


def test_subspace_arcface_sharded_classes_equal_whole():
  # One key on every device: one subspace; the class rows over 8 devices
  # (padding rows, absent classes) and the batch alone sharded.
  from tests.losses import class_matrix_checks  # pylint: disable=import-outside-toplevel
  class_matrix_checks.check_sharded_equals_whole(
      losses.subspace_arcface_loss, num_features=5, scale=4.0,
      key=jax.random.PRNGKey(3))


def test_subspace_arcface_bad_inputs():
  with pytest.raises(ValueError, match="pass the step's PRNG `key`"):
    losses.subspace_arcface_loss(_XS, _YS, _WS, num_features=_K)
  with pytest.raises(ValueError, match="num_features"):
    losses.subspace_arcface_loss(_XS, _YS, _WS, num_features=0)
  with pytest.raises(ValueError, match="features"):
    losses.subspace_arcface_loss(_XS, _YS, _WS, features=np.ones(3))
  with pytest.raises(ValueError, match="scale"):
    losses.subspace_arcface_loss(_XS, _YS, _WS, num_features=_D2, scale=0.0)
  with pytest.raises(ValueError, match="dimension"):  # before the selection
    losses.subspace_arcface_loss(_XS, _YS, _WS[:, :6], features=np.arange(4))


# Slow (PyTorch imported, eager ops): CI runs it.
@pytest.mark.slow
def test_subspace_arcface_equals_the_official_code():
  # Value and gradients against the transcription, theta = pi included (the
  # code's cos(arccos(c) + m) past pi - m, its straight-through gradient).
  pytest.importorskip("torch")
  for seed, (s, m) in enumerate([(32.0, 0.25), (4.0, 0.5)]):
    key = jax.random.PRNGKey(seed)
    dims = np.asarray(losses.subspace_indices(key, _D2, _K))
    want = unicom_official(_XS, _YS, _WS, dims, s, m)
    v, (gx, gw) = _subspace(_XS, _YS, _WS, num_features=_K, key=key,
                            scale=s, margin=m)
    # float32 against float64: arccos at theta = pi is ill-conditioned.
    np.testing.assert_allclose(float(v), want[0], rtol=3e-5)
    for a, b in zip((gx, gw), want[1:]):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
