"""Smooth-AP and FastAP: float64 references written from the papers'
definitions, tiles, devices, references, masks, bad input and memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from jax.test_util import check_grads

from circle_jax import losses
from circle_jax.losses import engine
from tests.losses.engine_checks import grad_ref

# Slow (many compiled cases): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

B, D = 12, 8
LABELS = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4], np.int32)  # 3: alone


def _x(seed=0, n=B):
  return np.random.default_rng(seed).normal(size=(n, D)).astype(np.float32)


def _unit(x):
  x = np.asarray(x, np.float64)
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def _sets(y, col_y, i, pos_mask, neg_mask, self_pairs):
  """Anchor ``i``'s positives and candidates (lists of column indices)."""
  pos, cand = [], []
  for k in range(len(col_y)):
    if self_pairs and k == i:
      continue
    if col_y[k] == y[i] and (pos_mask is None or pos_mask[i, k]):
      pos.append(k)
      cand.append(k)
    elif col_y[k] != y[i] and (neg_mask is None or neg_mask[i, k]):
      cand.append(k)
  return pos, cand


def smooth_ap_ref(x, y, tau, pos_mask=None, neg_mask=None, cols=None,
                  col_y=None):
  """Brown et al.'s Smooth-AP, every (i, j, k) by hand, float64."""
  rows = _unit(x)
  self_pairs = cols is None
  cols, col_y = (rows, y) if self_pairs else (_unit(cols), col_y)
  s = rows @ cols.T
  sig = lambda v: 0.5 * (1.0 + np.tanh(0.5 * v))  # no overflow
  total, count = 0.0, 0
  for i in range(len(y)):
    pos, cand = _sets(y, col_y, i, pos_mask, neg_mask, self_pairs)
    if not pos:
      continue
    ap = 0.0
    for j in pos:
      num = 1.0 + sum(sig((s[i, k] - s[i, j]) / tau) for k in pos if k != j)
      den = 1.0 + sum(sig((s[i, k] - s[i, j]) / tau) for k in cand if k != j)
      ap += num / den
    total += 1.0 - ap / len(pos)
    count += 1
  return total / max(count, 1)


def fastap_ref(x, y, L, pos_mask=None, neg_mask=None, cols=None, col_y=None):
  """Cakir et al.'s FastAP: triangular histograms by hand, float64."""
  rows = _unit(x)
  self_pairs = cols is None
  cols, col_y = (rows, y) if self_pairs else (_unit(cols), col_y)
  d = np.clip(2.0 - 2.0 * rows @ cols.T, 0.0, 4.0)
  delta = 4.0 / L
  total, count = 0.0, 0
  for i in range(len(y)):
    pos, cand = _sets(y, col_y, i, pos_mask, neg_mask, self_pairs)
    if not pos:
      continue
    h_pos, h_all = np.zeros(L + 1), np.zeros(L + 1)
    for l in range(L + 1):
      for k in cand:
        pulse = max(0.0, 1.0 - abs(d[i, k] - l * delta) / delta)
        h_all[l] += pulse
        h_pos[l] += pulse if k in pos else 0.0
    ap, cum_pos, cum_all = 0.0, 0.0, 0.0
    for l in range(L + 1):
      cum_pos += h_pos[l]
      cum_all += h_all[l]
      if cum_all > 0:
        ap += h_pos[l] * cum_pos / cum_all
    total += 1.0 - ap / len(pos)
    count += 1
  return total / max(count, 1)


LOSS = {"smooth_ap": (losses.smooth_ap_loss, smooth_ap_ref, "tau"),
        "fastap": (losses.fastap_loss, fastap_ref, "L")}
CASES = {"smooth_ap": {"tau": 0.1}, "smooth_ap_default": {"tau": 0.01},
         "fastap": {"L": 10}, "fastap_coarse": {"L": 3}}


def _case(case):
  name = "smooth_ap" if case.startswith("smooth_ap") else "fastap"
  fn, ref, key = LOSS[name]
  hyper = CASES[case]
  return fn, functools.partial(ref, **{key: hyper[key]}), hyper


def _vg(fn, x, labels, **kw):
  return jax.jit(jax.value_and_grad(lambda x: fn(x, labels, **kw)))(
      jnp.asarray(x))


def _close(got, want, rtol=2e-5):
  scale = float(np.max(np.abs(np.asarray(want[1])))) or 1.0
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=rtol,
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]),
                             rtol=1e-4, atol=1e-4 * scale)


def test_hand_computed_smooth_ap_is_the_exact_ap_at_a_small_temperature():
  # Unit vectors at 0, 60, 30 and 180 degrees, labels 0, 0, 1, 1. Ranks of
  # each anchor's one positive among its 3 candidates: 2, 2, 3, 2, so the
  # APs are 1/2, 1/2, 1/3, 1/2 and the loss 1 - (11/6) / 4 = 13/24.
  angles = np.deg2rad([0.0, 60.0, 30.0, 180.0])
  x = np.stack([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
  y = np.array([0, 0, 1, 1])
  for bs in (None, 1, 3):
    got = float(losses.smooth_ap_loss(x, y, tau=1e-3, block_size=bs))
    np.testing.assert_allclose(got, 13 / 24, rtol=1e-6)


def test_hand_computed_fastap_on_bin_centres():
  # L = 2: centres 0, 2, 4. x0 = x1 = e1 (label 0), x2 = e2, x3 = -e2
  # (label 1). Anchors 0, 1: the positive at d = 0, the negatives at d = 2:
  # FastAP 1. Anchors 2, 3: the positive at d = 4, the negatives at 2:
  # h+ = (0, 0, 1), H = (0, 2, 3): FastAP 1/3. Loss 1 - (8/3) / 4 = 1/3.
  x = np.array([[1, 0], [1, 0], [0, 1], [0, -1]], np.float32)
  y = np.array([0, 0, 1, 1])
  for bs in (None, 1, 3):
    got = float(losses.fastap_loss(x, y, L=2, block_size=bs))
    np.testing.assert_allclose(got, 1 / 3, rtol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_value_and_gradient_equal_the_float64_reference(case):
  fn, ref, hyper = _case(case)
  x = _x()
  value, grad = _vg(fn, x, jnp.asarray(LABELS), block_size=5, **hyper)
  want = ref(x, LABELS)
  assert 0 < want < 1
  np.testing.assert_allclose(float(value), want, rtol=2e-5)
  want_grad = grad_ref(lambda v: ref(v, LABELS), x)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-3,
                             atol=2e-4 * np.abs(want_grad).max())


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiles_of_any_size_equal_one_tile(case):
  fn, _, hyper = _case(case)
  x, labels = _x(seed=1), jnp.asarray(LABELS)
  whole = _vg(fn, x, labels, block_size=B, **hyper)
  for bs in (None, 1, 3, 5, 7, 64):
    _close(_vg(fn, x, labels, block_size=bs, **hyper), whole)


@pytest.mark.parametrize("name,hyper", [("smooth_ap", {"tau": 0.5}),
                                        ("fastap", {"L": 10})])
def test_check_grads(name, hyper):
  fn = LOSS[name][0]
  x, labels = jnp.asarray(_x(seed=3)), jnp.asarray(LABELS)
  for bs in (None, 4):
    f = jax.jit(lambda x, bs=bs: fn(x, labels, block_size=bs, **hyper))
    check_grads(f, (x,), order=1, modes=("rev",), eps=1e-3, atol=2e-3,
                rtol=2e-3)


def test_the_temperature_gradient_is_exact():
  x, labels = jnp.asarray(_x(seed=4)), jnp.asarray(LABELS)
  f = jax.jit(lambda tau: losses.smooth_ap_loss(x, labels, tau=tau,
                                                block_size=5))
  check_grads(f, (jnp.float32(0.3),), order=1, modes=("rev",), eps=1e-3,
              atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("case", ["smooth_ap", "fastap"])
def test_miner_masks(case):
  fn, ref, hyper = _case(case)
  x, labels = _x(seed=2), jnp.asarray(LABELS)
  rng = np.random.default_rng(5)
  pm, nm = rng.random((B, B)) < 0.7, rng.random((B, B)) < 0.6
  masks = {"pos_mask": jnp.asarray(pm), "neg_mask": jnp.asarray(nm)}
  got = _vg(fn, x, labels, block_size=5, **masks, **hyper)
  np.testing.assert_allclose(float(got[0]),
                             ref(x, LABELS, pos_mask=pm, neg_mask=nm),
                             rtol=2e-5)
  assert not np.isclose(float(got[0]), ref(x, LABELS))
  _close(_vg(fn, x, labels, block_size=B, **masks, **hyper), got)


@pytest.mark.parametrize("case", ["smooth_ap", "fastap"])
def test_reference_embeddings(case):
  fn, ref, hyper = _case(case)
  rng = np.random.default_rng(7)
  mem = rng.normal(size=(16, D)).astype(np.float32)
  mem_labels = rng.integers(0, 5, 16).astype(np.int32)
  x, labels = _x(seed=4), jnp.asarray(LABELS)

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
    _close((got[0], got[1][k]), (whole[0], whole[1][k]))


def _mesh():
  return Mesh(np.array(jax.devices()), ("d",))


@pytest.mark.parametrize("case", ["smooth_ap", "fastap"])
def test_eight_devices_equal_the_global_batch(case):
  assert jax.device_count() == 8
  fn, _, hyper = _case(case)
  n = 16
  labels = jnp.asarray(np.random.default_rng(0).integers(0, 5, n), jnp.int32)
  x = _x(seed=6, n=n)
  rng = np.random.default_rng(8)
  pm = jnp.asarray(rng.random((n, n)) < 0.8)
  for masks in ((), (pm,)):
    want = _vg(fn, x, labels, block_size=3, **dict(zip(("pos_mask",), masks)),
               **hyper)

    def local(x, labels, *masks):
      mk = dict(zip(("pos_mask",), masks))
      return jax.value_and_grad(
          lambda x: fn(x, labels, axis_name="d", block_size=3, **mk,
                       **hyper))(x)

    got = jax.jit(jax.shard_map(
        local, mesh=_mesh(), in_specs=(P("d"),) * (2 + len(masks)),
        out_specs=(P(), P("d"))))(jnp.asarray(x), labels, *masks)
    _close(got, want)


@pytest.mark.parametrize("name", ["smooth_ap", "fastap"])
def test_no_positive_gives_zero_loss_and_zero_gradient(name):
  fn = LOSS[name][0]
  labels = jnp.arange(B, dtype=jnp.int32)
  for bs in (None, 5):
    value, grad = _vg(fn, _x(), labels, block_size=bs)
    assert float(value) == 0.0
    assert np.all(np.asarray(grad) == 0.0)


def test_an_anchor_without_positives_has_zero_gradient_of_its_own():
  # Anchor 9 (label 3) has no positive: it is left out of the mean, so its
  # only gradient is that of being another anchor's negative.
  x, labels = _x(), jnp.asarray(LABELS)
  for fn in (losses.smooth_ap_loss, losses.fastap_loss):
    alone = np.zeros(B, bool)
    alone[9] = True
    neg = jnp.asarray(~alone[None, :] | alone[:, None])  # 9 is no negative
    _, grad = _vg(fn, x, labels, neg_mask=neg, block_size=5)
    assert np.all(np.asarray(grad)[9] == 0.0)
    assert np.abs(np.asarray(grad)).max() > 0


@pytest.mark.parametrize("name,hyper", [
    ("smooth_ap", {"tau": 1e-3}), ("smooth_ap", {"tau": 1e4}),
    ("fastap", {"L": 1}), ("fastap", {"L": 1000})])
def test_range_ends_stay_finite_and_exact_under_jit(name, hyper):
  fn, ref, _ = LOSS[name]
  x, labels = _x(seed=9), jnp.asarray(LABELS)
  value, grad = _vg(fn, x, labels, block_size=5, **hyper)
  assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
  np.testing.assert_allclose(float(value), ref(x, LABELS, *hyper.values()),
                             rtol=1e-4)


def test_bfloat16_embeddings_are_computed_in_float32():
  x = jnp.asarray(_x(seed=10)).astype(jnp.bfloat16)
  labels = jnp.asarray(LABELS)
  for name, (fn, ref, _) in LOSS.items():
    hyper = CASES[name]
    got = fn(x, labels, **hyper)
    assert got.dtype == jnp.float32
    want = ref(np.asarray(x.astype(jnp.float32)), LABELS, hyper[LOSS[name][2]])
    np.testing.assert_allclose(float(got), want, rtol=2e-5)


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
    call(jnp.asarray(_x()), jnp.asarray(LABELS))
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["smooth_ap", "fastap"])
def test_the_ring_is_refused_in_one_line(name):
  fn = LOSS[name][0]

  def local(x, y):
    return fn(x, y, axis_name="d", collective="ring")

  with pytest.raises(ValueError, match="no device-ring form") as err:
    jax.shard_map(local, mesh=_mesh(), in_specs=(P("d"), P("d")),
                  out_specs=P())(jnp.asarray(_x(n=16)),
                                 jnp.zeros(16, jnp.int32))
  assert "\n" not in str(err.value)


def test_smooth_ap_takes_another_geometry():
  x, labels = _x(seed=11), jnp.asarray(LABELS)
  # Ranking is invariant to a positive scale of the similarity: the raw
  # inner products of vectors of one norm rank as their cosines.
  x = x / np.linalg.norm(x, axis=1, keepdims=True) * 3.0
  dot = losses.smooth_ap_loss(x, labels, tau=0.9, geometry=engine.DOT)
  cos = losses.smooth_ap_loss(x, labels, tau=0.1)
  np.testing.assert_allclose(float(dot), float(cos), rtol=1e-5)


def test_registry_apply_runs_both():
  x, labels = jnp.asarray(_x()), jnp.asarray(LABELS)
  for name, (fn, _, key) in LOSS.items():
    entry = losses.get_loss(name)
    assert entry.kind == "pair" and entry.supports_ref
    assert key in entry.hyper_ranges
    np.testing.assert_allclose(
        float(entry.apply(x, labels, block_size=4)), float(fn(x, labels)),
        rtol=1e-6)


def _compiled_bytes(fn, b, **kw):
  x = jax.ShapeDtypeStruct((b, 16), jnp.float32)
  y = jax.ShapeDtypeStruct((b,), jnp.int32)
  mem = jax.jit(jax.value_and_grad(lambda x, y: fn(x, y, **kw))).lower(
      x, y).compile().memory_analysis()
  return mem.temp_size_in_bytes


@pytest.mark.parametrize("name", ["smooth_ap", "fastap"])
def test_compiled_memory_grows_like_b_squared_not_b_cubed(name):
  fn = LOSS[name][0]
  small, large = (_compiled_bytes(fn, b, block_size=32) for b in (512, 1024))
  # B^2 grows 4x from 512 to 1024, B^3 8x.
  assert large / small < 5.0, (small, large)


def test_the_memory_check_sees_a_cubic_tensor():
  # One tile holding the whole [B, B, B] (block_size >= B) grows 8x.
  small, large = (_compiled_bytes(losses.smooth_ap_loss, b, block_size=b)
                  for b in (64, 128))
  assert large / small > 6.0, (small, large)


def test_fastap_equals_pytorch_metric_learning():
  torch = pytest.importorskip("torch")
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  x, labels = _x(seed=12), LABELS
  xt = torch.tensor(x, requires_grad=True)
  want = pml.FastAPLoss(num_bins=10)(xt, torch.tensor(labels, dtype=torch.int64))
  want.backward()
  got = _vg(losses.fastap_loss, x, jnp.asarray(labels), block_size=5)
  _close(got, (want.item(), xt.grad.numpy()))


def _official_smooth_ap(x, y, tau):
  """The official code's sets: the anchor is its own positive and one of
  the candidates; only k = j is left out of each rank."""
  s = _unit(x) @ _unit(x).T
  sig = lambda v: 0.5 * (1.0 + np.tanh(0.5 * v))
  aps = []
  for i in range(len(y)):
    group = [j for j in range(len(y)) if y[j] == y[i]]
    ap = 0.0
    for j in group:
      num = 1 + sum(sig((s[i, k] - s[i, j]) / tau) for k in group if k != j)
      den = 1 + sum(sig((s[i, k] - s[i, j]) / tau) for k in range(len(y))
                    if k != j)
      ap += num / den
    aps.append(ap / len(group))
  return 1.0 - np.mean(aps)


def test_what_pytorch_metric_learning_computes():
  # PML 2.9.0's SmoothAPLoss is the official form (anchor included) when
  # the batch has as many classes as samples per class, and groups the
  # batch by the class count otherwise; ours is the paper's sets.
  torch = pytest.importorskip("torch")
  pml = pytest.importorskip("pytorch_metric_learning.losses")
  for classes, per_class, same in ((4, 4, True), (2, 3, False)):
    y = np.repeat(np.arange(classes), per_class)
    x = _x(seed=13, n=len(y))
    want = pml.SmoothAPLoss(temperature=0.1)(
        torch.tensor(x), torch.tensor(y)).item()
    official = _official_smooth_ap(x, y, 0.1)
    assert np.isclose(want, official, rtol=1e-5) == same
    ours = float(losses.smooth_ap_loss(x, jnp.asarray(y), tau=0.1))
    np.testing.assert_allclose(ours, smooth_ap_ref(x, y, 0.1), rtol=2e-5)
    assert not np.isclose(ours, official)


@pytest.mark.parametrize("name,bad,message", [
    ("smooth_ap", {"tau": 1e-4}, "config.loss.tau: must be in [0.001, "
     "10000] for loss 'smooth_ap'"),
    ("fastap", {"L": 0}, "config.loss.L: must be in [1, 1000] for loss "
     "'fastap'"),
])
def test_the_trainer_takes_them_by_name_and_checks_their_ranges(name, bad,
                                                                 message):
  from circle_jax import config as config_lib
  from circle_jax.train import config_checks
  from tests.train import helpers
  c = helpers.digits_config()
  c.loss = config_lib.loss_config(name, **bad)
  with pytest.raises(config_checks.ConfigError) as err:
    config_checks.check_config(c, device_count=8, process_count=1)
  assert str(err.value).startswith(message)
  c.loss = config_lib.loss_config(name, block_size=16)
  config_checks.check_config(c, device_count=8, process_count=1)
