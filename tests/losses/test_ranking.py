"""Tests of the ranking losses' shared pieces (circle_jax/losses/ranking.py):
the tiled block equals one tile, and the refused device ring; Smooth-AP and
FastAP on it: float64 references with masks and reference embeddings,
gradients, 8 devices, empty sets, range ends, bf16, bad input and memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax import losses
from circle_jax.losses import engine
from circle_jax.losses import ranking
from tests.losses.engine.cases import RANKING_B as B
from tests.losses.engine.cases import RANKING_CASES as CASES
from tests.losses.engine.cases import RANKING_D as D
from tests.losses.engine.cases import RANKING_LABELS as LABELS
from tests.losses.engine.cases import RANKING_LOSS as LOSS
from tests.losses.engine.cases import ranking_batch, ranking_case, ranking_vg
from tests.losses.engine.cases import ranking_close as close
from tests.losses.engine_checks import grad_ref, mesh



@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_tiles_of_any_size_equal_one_tile(case):
  fn, _, hyper = ranking_case(case)
  x, labels = ranking_batch(seed=1), jnp.asarray(LABELS)
  whole = ranking_vg(fn, x, labels, block_size=B, **hyper)
  for bs in (None, 1, 3, 5, 7, 64):
    close(ranking_vg(fn, x, labels, block_size=bs, **hyper), whole)


@pytest.mark.parametrize("name", ["smooth_ap", "fastap"])
def test_the_ring_is_refused_in_one_line(name):
  fn = LOSS[name][0]

  def local(x, y):
    return fn(x, y, axis_name="d", collective="ring")

  with pytest.raises(ValueError, match="no device-ring form") as err:
    jax.shard_map(local, mesh=mesh(), in_specs=(P("d"), P("d")),
                  out_specs=P())(jnp.asarray(ranking_batch(n=16)),
                                 jnp.zeros(16, jnp.int32))
  assert "\n" not in str(err.value)


def test_self_similarity_is_the_geometry_of_each_row_with_itself():
  """Hand values: cosine 1 for every non-zero row, the dot geometry the
  squared norm; float32 from bfloat16."""
  x = jnp.array([[3.0, 4.0], [1.0, 0.0]])
  np.testing.assert_allclose(ranking.self_similarity(x), [1.0, 1.0],
                             rtol=1e-6)
  np.testing.assert_allclose(ranking.self_similarity(x, "dot"), [25.0, 1.0],
                             rtol=1e-6)
  assert ranking.self_similarity(x.astype(jnp.bfloat16)).dtype == jnp.float32


def test_varying_scalar_is_x_as_a_float32_scalar():
  block = ranking.RankingBlock(jnp.zeros((2, 2)), jnp.eye(2, dtype=bool),
                               jnp.ones((2, 2), bool), 2)
  v = ranking.varying_scalar(0.25, block)
  assert v.shape == () and v.dtype == jnp.float32 and float(v) == 0.25
# ----------------------------------------------------------------------------
# Both ranking losses on the tiled ranking engine: gradients, miner masks,
# reference embeddings, 8 devices, empty sets, range ends, bf16, bad input
# and the compiled memory.
# ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name,hyper", [("smooth_ap", {"tau": 0.5}),
                                        ("fastap", {"L": 10})])
def test_check_grads(name, hyper):
  fn = LOSS[name][0]
  x, labels = jnp.asarray(ranking_batch(seed=3)), jnp.asarray(LABELS)
  for bs in (None, 4):
    f = jax.jit(lambda x, bs=bs: fn(x, labels, block_size=bs, **hyper))
    check_grads(f, (x,), order=1, modes=("rev",), eps=1e-3, atol=2e-3,
                rtol=2e-3)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["smooth_ap", "fastap"])
def test_miner_masks(case):
  fn, ref, hyper = ranking_case(case)
  x, labels = ranking_batch(seed=2), jnp.asarray(LABELS)
  rng = np.random.default_rng(5)
  pm, nm = rng.random((B, B)) < 0.7, rng.random((B, B)) < 0.6
  masks = {"pos_mask": jnp.asarray(pm), "neg_mask": jnp.asarray(nm)}
  got = ranking_vg(fn, x, labels, block_size=5, **masks, **hyper)
  np.testing.assert_allclose(float(got[0]),
                             ref(x, LABELS, pos_mask=pm, neg_mask=nm),
                             rtol=2e-5)
  assert not np.isclose(float(got[0]), ref(x, LABELS))
  close(ranking_vg(fn, x, labels, block_size=B, **masks, **hyper), got)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["smooth_ap", "fastap"])
def test_reference_embeddings(case):
  fn, ref, hyper = ranking_case(case)
  rng = np.random.default_rng(7)
  mem = rng.normal(size=(16, D)).astype(np.float32)
  mem_labels = rng.integers(0, 5, 16).astype(np.int32)
  x, labels = ranking_batch(seed=4), jnp.asarray(LABELS)

  def run(x, mem, **kw):
    return jax.value_and_grad(lambda x, mem: fn(
        x, labels, ref=losses.Candidates(mem, jnp.asarray(mem_labels)),
        **hyper, **kw), argnums=(0, 1))(x, mem)

  args = (jnp.asarray(x), jnp.asarray(mem))
  got = jax.jit(functools.partial(run, block_size=5))(*args)
  np.testing.assert_allclose(
      float(got[0]), ref(x, LABELS, cols=mem, col_y=mem_labels), rtol=2e-5)
  want_mem = grad_ref(
      lambda m: ref(x, LABELS, cols=m, col_y=mem_labels), mem)
  np.testing.assert_allclose(np.asarray(got[1][1]), want_mem, rtol=2e-3,
                             atol=2e-4 * np.abs(want_mem).max())
  whole = jax.jit(functools.partial(run, block_size=64))(*args)
  for k in (0, 1):
    close((got[0], got[1][k]), (whole[0], whole[1][k]))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["smooth_ap", "fastap"])
def test_eight_devices_equal_the_global_batch(case):
  assert jax.device_count() == 8
  fn, _, hyper = ranking_case(case)
  n = 16
  labels = jnp.asarray(np.random.default_rng(0).integers(0, 5, n), jnp.int32)
  x = ranking_batch(seed=6, n=n)
  rng = np.random.default_rng(8)
  pm = jnp.asarray(rng.random((n, n)) < 0.8)
  for masks in ((), (pm,)):
    want = ranking_vg(fn, x, labels, block_size=3, **dict(zip(("pos_mask",), masks)),
               **hyper)

    def local(x, labels, *masks):
      mk = dict(zip(("pos_mask",), masks))
      return jax.value_and_grad(
          lambda x: fn(x, labels, axis_name="d", block_size=3, **mk,
                       **hyper))(x)

    got = jax.jit(jax.shard_map(
        local, mesh=mesh(), in_specs=(P("d"),) * (2 + len(masks)),
        out_specs=(P(), P("d"))))(jnp.asarray(x), labels, *masks)
    close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smooth_ap", "fastap"])
def test_no_positive_gives_zero_loss_and_zero_gradient(name):
  fn = LOSS[name][0]
  labels = jnp.arange(B, dtype=jnp.int32)
  for bs in (None, 5):
    value, grad = ranking_vg(fn, ranking_batch(), labels, block_size=bs)
    assert float(value) == 0.0
    assert np.all(np.asarray(grad) == 0.0)


@pytest.mark.slow
def test_an_anchor_without_positives_has_zero_gradient_of_its_own():
  # Anchor 9 (label 3) has no positive: it is left out of the mean, so its
  # only gradient is that of being another anchor's negative.
  x, labels = ranking_batch(), jnp.asarray(LABELS)
  for fn in (losses.smooth_ap_loss, losses.fastap_loss):
    alone = np.zeros(B, bool)
    alone[9] = True
    neg = jnp.asarray(~alone[None, :] | alone[:, None])  # 9 is no negative
    _, grad = ranking_vg(fn, x, labels, neg_mask=neg, block_size=5)
    assert np.all(np.asarray(grad)[9] == 0.0)
    assert np.abs(np.asarray(grad)).max() > 0


@pytest.mark.slow
@pytest.mark.parametrize("name,hyper", [
    ("smooth_ap", {"tau": 1e-3}), ("smooth_ap", {"tau": 1e4}),
    ("fastap", {"L": 1}), ("fastap", {"L": 1000})])
def test_range_ends_stay_finite_and_exact_under_jit(name, hyper):
  fn, ref, _ = LOSS[name]
  x, labels = ranking_batch(seed=9), jnp.asarray(LABELS)
  value, grad = ranking_vg(fn, x, labels, block_size=5, **hyper)
  assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
  np.testing.assert_allclose(float(value), ref(x, LABELS, *hyper.values()),
                             rtol=1e-4)


@pytest.mark.slow
def test_bfloat16_embeddings_are_computed_in_float32():
  x = jnp.asarray(ranking_batch(seed=10)).astype(jnp.bfloat16)
  labels = jnp.asarray(LABELS)
  for name, (fn, ref, _) in LOSS.items():
    hyper = CASES[name]
    got = fn(x, labels, **hyper)
    assert got.dtype == jnp.float32
    want = ref(np.asarray(x.astype(jnp.float32)), LABELS, hyper[LOSS[name][2]])
    np.testing.assert_allclose(float(got), want, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("call,match", [
    (lambda x, y: losses.smooth_ap_loss(x, y, tau=1e-4), r"`tau` of Smooth"),
    (lambda x, y: losses.smooth_ap_loss(x, y, block_size=0),
     r"`block_size` must be >= 1"),
    (lambda x, y: losses.smooth_ap_loss(x[:, :, None], y), "rank 2"),
    (lambda x, y: losses.smooth_ap_loss(x, y[:-1]), "length 11"),
    (lambda x, y: losses.smooth_ap_loss(x, y, pos_mask=np.ones((3, 3), bool)),
     "`pos_mask` must have the shape"),
    (lambda x, y: losses.fastap_loss(x, y, L=0), r"`L` of FastAP"),
    (lambda x, y: losses.fastap_loss(x, y, L=2.5), "must be a Python int"),
    (lambda x, y: losses.fastap_loss(x, y, geometry=engine.DOT),
     "only the cosine geometry"),
])
def test_bad_input_is_one_line(call, match):
  with pytest.raises(ValueError, match=match) as err:
    call(jnp.asarray(ranking_batch()), jnp.asarray(LABELS))
  assert "\n" not in str(err.value)


def _compiled_bytes(fn, b, **kw):
  x = jax.ShapeDtypeStruct((b, 16), jnp.float32)
  y = jax.ShapeDtypeStruct((b,), jnp.int32)
  mem = jax.jit(jax.value_and_grad(lambda x, y: fn(x, y, **kw))).lower(
      x, y).compile().memory_analysis()
  return mem.temp_size_in_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smooth_ap", "fastap"])
def test_compiled_memory_grows_like_b_squared_not_b_cubed(name):
  fn = LOSS[name][0]
  small, large = (_compiled_bytes(fn, b, block_size=32) for b in (512, 1024))
  # B^2 grows 4x from 512 to 1024, B^3 8x.
  assert large / small < 5.0, (small, large)


@pytest.mark.slow
def test_the_memory_check_sees_a_cubic_tensor():
  # One tile holding the whole [B, B, B] (block_size >= B) grows 8x.
  small, large = (_compiled_bytes(losses.smooth_ap_loss, b, block_size=b)
                  for b in (64, 128))
  assert large / small > 6.0, (small, large)
