"""Tests of the blockwise Circle / Multi-Similarity / Ranked List losses.

The blockwise functions must equal the dense losses (values and gradients to
float32 rounding) at every block size, including sizes that do not divide the
batch, on one device and across 8 simulated devices, without ever building a
``[B, B]`` array. References: float64 numpy per-anchor loops (values), Circle's
closed-form gradient (its alpha factors are constants in backprop, so finite
differences do not apply) and float64 central differences of the reference for
the other two, and the dense public functions once they are implemented.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import circle_jax.losses as losses
from tests.losses import reference as ref

# Slow (every engine compiled per rule): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

# ----------------------------------------------------------------------------
# Float64 numpy references (naive per-anchor loops).
# ----------------------------------------------------------------------------


def _pairs(labels, i, pos_mask=None, neg_mask=None):
  b = len(labels)
  pos = [j for j in range(b) if labels[j] == labels[i] and j != i
         and (pos_mask is None or pos_mask[i, j])]
  neg = [j for j in range(b) if labels[j] != labels[i]
         and (neg_mask is None or neg_mask[i, j])]
  return pos, neg


def circle_ref(x, labels, margin=0.4, gamma=80.0, pos_mask=None, neg_mask=None):
  """Returns (loss, dL/dx): the loss of the float64 reference
  (``reference.ref_circle_anchor``) and the paper's closed-form gradient
  (alpha_p, alpha_n constant)."""
  z = ref.l2n(x)
  s = z @ z.T
  b = len(labels)
  total, count = 0.0, 0
  g = np.zeros((b, b))
  for i in range(b):
    pos, neg = _pairs(labels, i, pos_mask, neg_mask)
    if not pos or not neg:
      continue
    a_p = np.maximum(1 + margin - s[i, pos], 0)
    a_n = np.maximum(s[i, neg] + margin, 0)
    l_p = -gamma * a_p * (s[i, pos] - (1 - margin))
    l_n = gamma * a_n * (s[i, neg] - margin)
    lse_p, lse_n = ref.logsumexp(l_p), ref.logsumexp(l_n)
    total += ref.ref_circle_anchor(s[i, pos], s[i, neg], margin, gamma)
    count += 1
    sig = 1 / (1 + np.exp(-(lse_p + lse_n)))
    g[i, pos] = -sig * np.exp(l_p - lse_p) * gamma * a_p
    g[i, neg] = sig * np.exp(l_n - lse_n) * gamma * a_n
  count = max(count, 1)
  return total / count, _grad_x_from_grad_s(x, g / count)


def _grad_x_from_grad_s(x, g):
  """Chains dL/dS (S = z z^T, z = x/||x||) to dL/dx in float64."""
  x = np.asarray(x, np.float64)
  z = ref.l2n(x)
  dz = g @ z + g.T @ z
  norm = np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
  return (dz - z * np.sum(z * dz, axis=1, keepdims=True)) / norm


def ms_ref(x, labels, alpha=2.0, beta=50.0, base=0.5, epsilon=0.1, mining=True,
           pos_mask=None, neg_mask=None):
  """Multi-Similarity of embeddings: reference.ref_ms on their cosines."""
  return ref.ref_ms(ref.cos(x), labels, alpha=alpha, beta=beta, base=base,
                    epsilon=epsilon, mining=mining, pos_mask=pos_mask,
                    neg_mask=neg_mask)


def rll_ref(x, labels, alpha=1.2, margin=0.4, t_neg=10.0, t_pos=0.0,
            imbalance=0.5, pos_mask=None, neg_mask=None):
  """Returns (loss, dL/dx) of reference.rll_reference on the embeddings'
  distances ``d = sqrt(2 - 2 cos)``; the normalised weights are constants in
  backprop."""
  d = np.sqrt(np.maximum(2 - 2 * ref.cos(x), 0))
  value, g_d = ref.rll_reference(d, labels, alpha=alpha, margin=margin,
                                 t_neg=t_neg, t_pos=t_pos,
                                 imbalance=imbalance, pos_mask=pos_mask,
                                 neg_mask=neg_mask)
  g_s = -g_d / np.where(d > 0, d, np.inf)  # d = sqrt(2 - 2s)
  return value, _grad_x_from_grad_s(x, g_s)


def numeric_grad(f, x, h=1e-6):
  x = np.asarray(x, np.float64)
  g = np.zeros_like(x)
  for idx in np.ndindex(*x.shape):
    xp, xm = x.copy(), x.copy()
    xp[idx] += h
    xm[idx] -= h
    g[idx] = (f(xp) - f(xm)) / (2 * h)
  return g


# ----------------------------------------------------------------------------
# Fixtures.
# ----------------------------------------------------------------------------

LABELS = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4, 5])  # 3 and 5: no positives


@pytest.fixture(scope="module")
def batch():
  x = np.random.default_rng(0).normal(size=(len(LABELS), 4)).astype(np.float32)
  return x, LABELS


@functools.lru_cache(maxsize=None)
def _jitted_vg(fn, kw_items):
  kw = dict(kw_items)
  return jax.jit(jax.value_and_grad(
      lambda x, labels, masks: fn(x, labels, **masks, **kw)))


def _vg(fn, x, labels, masks=None, **kw):
  """Value and gradient of ``fn`` (one compilation per fn, hyper and shape)."""
  f = _jitted_vg(fn, tuple(sorted(kw.items())))
  v, g = f(jnp.asarray(x), jnp.asarray(labels), masks or {})
  return float(v), np.asarray(g, np.float64)


def _assert_close(got, want, name):
  v, g = got
  want_v, want_g = want
  np.testing.assert_allclose(v, want_v, rtol=2e-5, atol=1e-6, err_msg=name)
  scale = max(np.abs(want_g).max(), 1e-6)
  np.testing.assert_allclose(g, want_g, atol=2e-5 * scale, rtol=1e-4,
                             err_msg=name)


BLOCK_SIZES = [4, 64]  # 4 does not divide B=13; 64 > B (one block)
HYPER = {
    "circle": dict(margin=0.4, gamma=80.0),
    "multi_similarity": dict(alpha=2.0, beta=50.0, base=0.5, epsilon=0.1,
                             mining=True),
    "ranked_list": dict(alpha=1.2, margin=0.4, t_neg=10.0, t_pos=2.0,
                        imbalance=0.5),
}


# ----------------------------------------------------------------------------
# Values and gradients against the float64 references.
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references(batch):
  x, labels = batch
  x64 = x.astype(np.float64)
  rll_kw = dict(t_pos=2.0)
  return {
      "circle": circle_ref(x64, labels),
      "ms": (ms_ref(x64, labels),
             numeric_grad(lambda v: ms_ref(v, labels), x64)),
      "rll": rll_ref(x64, labels, **rll_kw),
  }


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_circle_matches_reference(batch, references, block_size):
  x, labels = batch
  got = _vg(losses.circle_loss, x, labels, block_size=block_size,
            **HYPER["circle"])
  _assert_close(got, references["circle"], f"circle bs={block_size}")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_multi_similarity_matches_reference(batch, references, block_size):
  x, labels = batch
  got = _vg(losses.multi_similarity_loss, x, labels,
            block_size=block_size, **HYPER["multi_similarity"])
  _assert_close(got, references["ms"], f"ms bs={block_size}")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_ranked_list_matches_reference(batch, references, block_size):
  x, labels = batch
  got = _vg(losses.ranked_list_loss, x, labels,
            block_size=block_size, **HYPER["ranked_list"])
  _assert_close(got, references["rll"], f"rll bs={block_size}")


def test_multi_similarity_without_mining_matches_reference(batch):
  x, labels = batch
  x64 = x.astype(np.float64)
  want = (ms_ref(x64, labels, mining=False),
          numeric_grad(lambda v: ms_ref(v, labels, mining=False), x64))
  got = _vg(losses.multi_similarity_loss, x, labels, mining=False,
            block_size=1)  # 13 x 13 blocks of a single pair
  _assert_close(got, want, "ms mining=False")


def test_miner_masks_are_intersected_with_label_masks(batch):
  x, labels = batch
  rng = np.random.default_rng(1)
  pm = rng.random((13, 13)) < 0.7
  nm = rng.random((13, 13)) < 0.7
  x64 = x.astype(np.float64)
  masks = dict(pos_mask=jnp.asarray(pm), neg_mask=jnp.asarray(nm))
  # (The masks are sliced by the shared block engine; one loss suffices.)
  got = _vg(losses.ranked_list_loss, x, labels, masks,
            block_size=5, **HYPER["ranked_list"])
  _assert_close(got, rll_ref(x64, labels, t_pos=2.0, pos_mask=pm, neg_mask=nm),
                "rll masks")


def test_hand_computed_circle_is_the_paper_circle():
  # Anchors 0 and 1 (class 0, angles 0 and 0.3) have one positive and one
  # negative (class 1, angle 1.0); anchor 2 has no positive and is not
  # counted. With one pair each, alpha_n (s_n - m) - alpha_p (s_p - 1 + m)
  # = (s_n + m)(s_n - m) - (1 + m - s_p)(s_p - 1 + m)
  # = s_n^2 + (s_p - 1)^2 - 2 m^2: the paper's circle decision boundary.
  angles = np.array([0.0, 0.3, 1.0])
  x = np.stack([np.cos(angles), np.sin(angles)], 1).astype(np.float32) * 3.0
  labels = np.array([0, 0, 1])
  m, gamma = 0.25, 4.0
  s_p = np.cos(0.3)
  s_n = np.array([np.cos(1.0), np.cos(0.7)])
  want = np.mean(np.log1p(np.exp(gamma * (s_n**2 + (s_p - 1)**2 - 2 * m**2))))
  got = jax.jit(functools.partial(losses.circle_loss, margin=m,
                                  gamma=gamma, block_size=2))(x, labels)
  np.testing.assert_allclose(float(got), want, rtol=1e-6)


# ----------------------------------------------------------------------------
# Equality with the dense public losses (once implemented).
# ----------------------------------------------------------------------------

DENSE = {
    "circle": (losses.circle_loss, losses.circle_loss),
    "multi_similarity": (losses.multi_similarity_loss,
                         losses.multi_similarity_loss),
    "ranked_list": (losses.ranked_list_loss,
                    losses.ranked_list_loss),
}


def _dense_or_skip(fn, *args, **kw):
  try:
    return fn(*args, **kw)
  except NotImplementedError:
    pytest.skip(f"dense {fn.__name__} is not implemented yet")


@pytest.mark.parametrize("name", sorted(DENSE))
def test_equals_dense_public_loss(batch, name):
  dense, block = DENSE[name]
  kw = HYPER[name]
  x, labels = batch
  want = _dense_or_skip(
      jax.jit(jax.value_and_grad(lambda x: dense(x, labels, **kw))),
      jnp.asarray(x))
  want = float(want[0]), np.asarray(want[1], np.float64)
  for bs in (4, 64):  # compiled already by the reference tests
    _assert_close(_vg(block, x, labels, block_size=bs, **kw), want,
                  f"{name} bs={bs}")


# ----------------------------------------------------------------------------
# Multi-device: each device keeps its anchor rows against gathered columns.
# ----------------------------------------------------------------------------

FNS = {
    "circle": losses.circle_loss,
    "multi_similarity": losses.multi_similarity_loss,
    "ranked_list": losses.ranked_list_loss,
}


@pytest.fixture(scope="module")
def global_batch():
  n = jax.device_count()
  assert n == 8
  x = np.random.default_rng(2).normal(size=(24, 5)).astype(np.float32)
  labels = np.array([0, 1, 2, 3, 4, 5] * 3 + [6, 7, 8, 0, 1, 9])
  return x, labels


@pytest.fixture(scope="module")
def global_references(global_batch):
  x, labels = global_batch
  x64 = x.astype(np.float64)
  return {
      "circle": circle_ref(x64, labels),
      "multi_similarity": (ms_ref(x64, labels),
                           numeric_grad(lambda v: ms_ref(v, labels), x64)),
      "ranked_list": rll_ref(x64, labels),
  }


# pmap goes through the same code as shard_map; one loss (the one with the
# mining pre-pass) keeps the test time down.
@pytest.mark.parametrize("name,mode", [
    ("circle", "shard_map"), ("multi_similarity", "shard_map"),
    ("ranked_list", "shard_map"), ("multi_similarity", "pmap")])
def test_multi_device_equals_single_device(global_batch, global_references,
                                           name, mode):
  x, labels = global_batch
  fn = FNS[name]
  want = global_references[name]
  # block 2 does not divide the 3 local anchors nor the 24 gathered columns.
  f = jax.value_and_grad(
      lambda x, y: fn(x, y, block_size=2, axis_name="d"))
  n = jax.device_count()
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P("d")),
                                 out_specs=(P(), P("d"))))(x, labels)
  else:
    v, g = jax.pmap(f, axis_name="d")(x.reshape(n, 3, 5), labels.reshape(n, 3))
    np.testing.assert_allclose(np.asarray(v), float(v[0]), rtol=1e-6)
    v, g = v[0], g.reshape(24, 5)
  _assert_close((float(v), np.asarray(g, np.float64)), want, f"{name} {mode}")


# ----------------------------------------------------------------------------
# Memory: no [B, B] buffer in the compiled program.
# ----------------------------------------------------------------------------


def test_compiled_memory_is_not_quadratic():
  b, d, block = 4096, 8, 256
  x = jax.ShapeDtypeStruct((b, d), jnp.float32)
  y = jax.ShapeDtypeStruct((b,), jnp.int32)

  def all_three(x, y):  # one compilation for the three losses
    return sum(fn(x, y, block_size=block) for fn in FNS.values())

  stats = jax.jit(jax.value_and_grad(all_three)).lower(x, y).compile()
  stats = stats.memory_analysis()
  # The dense similarity matrix alone would be b*b*4 = 64 MiB; the blockwise
  # program needs a few [block, block] tiles and [B, D] gradient buffers.
  assert stats.temp_size_in_bytes < b * b * 4 // 16, stats


# ----------------------------------------------------------------------------
# Transformations, edge cases, numerics.
# ----------------------------------------------------------------------------


def test_vmap_over_problems_equals_loop(batch):
  x, labels = batch
  xs = np.stack([x, x[::-1] * 2.0])
  ys = np.stack([labels, labels])
  f = jax.value_and_grad(lambda x, y: losses.multi_similarity_loss(
      x, y, block_size=4))
  v, g = jax.jit(jax.vmap(f))(xs, ys)
  for k in range(2):
    _assert_close((float(v[k]), np.asarray(g[k], np.float64)),
                  _vg(losses.multi_similarity_loss, xs[k], ys[k],
                      block_size=4), f"vmap {k}")


@pytest.mark.parametrize("name", sorted(FNS))
def test_degenerate_batches_give_zero_or_finite(batch, name):
  x, labels = batch  # shapes and hyperparameters of the reference tests:
  vg = functools.partial(_vg, FNS[name], block_size=4, **HYPER[name])
  b = len(labels)
  # Circle / MS: one class (no negatives) and all-distinct labels (no
  # positives) give loss 0 and zero gradient. Ranked List has no such case (its
  # positive and negative terms are separate), except identical embeddings of
  # one class (every positive is trivial).
  one_class = np.zeros(b, np.int32)
  if name == "ranked_list":
    cases = {"one_class_identical": (np.ones_like(x), one_class)}
  else:
    cases = {"one_class": (x, one_class), "distinct": (x, np.arange(b))}
  for case, (xx, yy) in cases.items():
    v, g = vg(xx, yy)
    assert v == 0.0, (name, case)
    np.testing.assert_array_equal(g, 0.0, err_msg=f"{name} {case}")
  for case, xx in {
      "zeros": np.zeros_like(x),
      "identical": np.ones_like(x),
      "huge": x * 1e30,
  }.items():
    v, g = vg(xx, labels)
    assert np.isfinite(v) and np.all(np.isfinite(g)), (name, case)
  if name == "circle":  # a batch of one (one more compilation: one loss)
    v, g = vg(x[:1], labels[:1])
    assert v == 0.0 and np.all(g == 0.0)


def test_bfloat16_inputs_compute_in_float32(batch):
  # (tests/losses/test_bf16.py covers the dense losses at the papers' scales;
  # the blockwise ones equal them.)
  x, labels = batch
  fn = functools.partial(losses.circle_loss, block_size=4,
                         gamma=256.0, margin=0.25)

  @jax.jit
  def both(x16):
    return (jax.value_and_grad(fn)(x16, labels),
            jax.value_and_grad(fn)(x16.astype(jnp.float32), labels))

  (v16, g16), (v32, g32) = both(jnp.asarray(x, jnp.bfloat16))
  assert v16.dtype == jnp.float32 and g16.dtype == jnp.bfloat16
  # Same (bf16-rounded) inputs, float32 compute: identical values; gradients
  # differ only by their final rounding to bfloat16 (8 bits of mantissa).
  np.testing.assert_allclose(float(v16), float(v32), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(g16, np.float32), np.asarray(g32),
                             rtol=2**-8, atol=1e-30)
  assert np.all(np.isfinite(np.asarray(g16, np.float32)))


def test_bad_inputs_raise_clear_errors(batch):
  x, labels = batch
  fn = losses.circle_loss
  with pytest.raises(ValueError, match="block_size"):
    fn(x, labels, block_size=0)
  with pytest.raises(TypeError, match="block_size"):
    fn(x, labels, block_size=2.5)
  with pytest.raises(TypeError, match="block_size"):
    fn(x, labels, block_size=jnp.asarray(4))
  with pytest.raises(ValueError, match="embeddings"):
    fn(x[0], labels, block_size=4)
  with pytest.raises(TypeError, match="labels"):
    fn(x, labels.astype(np.float32), block_size=4)
  with pytest.raises(ValueError, match="labels"):
    fn(x, labels[:-1], block_size=4)
  with pytest.raises(ValueError, match="pos_mask"):
    fn(x, labels, block_size=4, pos_mask=jnp.ones((3, 3), bool))
  with pytest.raises(ValueError, match="gamma"):
    fn(x, labels, block_size=4, gamma=0.0)
  out = jax.eval_shape(functools.partial(fn, block_size=np.int64(4)), x, labels)
  assert out.shape == () and out.dtype == jnp.float32


def test_no_retracing_for_repeated_calls(batch):
  x, labels = batch
  traces = []

  @jax.jit
  def f(x, y):
    traces.append(1)
    return losses.ranked_list_loss(x, y, block_size=4)

  for k in range(3):
    f(x + k, labels)
  assert len(traces) == 1


CASES = [
    (losses.circle_loss, dict(margin=0.3, gamma=64.0)),
    (losses.multi_similarity_loss,
     dict(alpha=3.0, beta=40.0, base=0.4, epsilon=0.2, mining=True)),
    (losses.ranked_list_loss,
     dict(alpha=1.1, margin=0.3, t_neg=8.0, t_pos=1.0, imbalance=0.4)),
    # Every rule-based loss takes block_size (circle_jax.losses.engine).
    (losses.unified_loss, dict(gamma=32.0, margin=0.3)),
    (losses.contrastive_loss, dict(neg_margin=1.2, pos_margin=0.2)),
]


@pytest.mark.parametrize("fn,hyper", CASES, ids=lambda c: getattr(c, "__name__", ""))
@pytest.mark.parametrize("block_size", [4, 7])
def test_block_size_matches_dense_values_and_gradients(fn, hyper, block_size):
  key = jax.random.PRNGKey(3)
  x = jax.random.normal(key, (18, 6))
  labels = jnp.array([0, 1, 2, 3, 4, 5] * 3)
  dense = jax.jit(jax.value_and_grad(lambda x: fn(x, labels, **hyper)))
  block = jax.jit(jax.value_and_grad(
      lambda x: fn(x, labels, block_size=block_size, **hyper)))
  (vd, gd), (vb, gb) = dense(x), block(x)
  assert float(vd) > 0
  np.testing.assert_allclose(float(vb), float(vd), rtol=1e-5)
  # float32 rounding, relative to the largest gradient entry (gamma * |s|
  # amplifies the rounding of the similarities).
  scale = float(np.abs(np.asarray(gd)).max())
  np.testing.assert_allclose(np.asarray(gb), np.asarray(gd), rtol=1e-4,
                             atol=2e-5 * scale)
  # A changed hyperparameter must change the blockwise result too, i.e. it is
  # forwarded and not replaced by a default.
  name, value = next(iter(hyper.items()))
  other = dict(hyper, **{name: value * 0.5})
  assert float(fn(x, labels, block_size=block_size, **other)) != pytest.approx(
      float(vb), rel=1e-4)
