"""The device-ring engine (circle_jax.losses.engine.ring, ``collective="ring"``).

On the 8 simulated CPU devices, every rule-based loss computed on a ring
(dense: one tile per step; blockwise: tiles that do not divide the local
batch) has the value and gradient of the single-device loss of the global
batch, under ``jax.shard_map`` and ``jax.pmap``, with classes spread
unevenly over the devices and devices whose anchors have no positive; the
compiled program permutes shards and gathers nothing; other columns
(references with ids and a validity mask) plug in as local columns.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import circle_jax.losses as losses
from circle_jax import ops
from circle_jax.losses import engine
from circle_jax.losses.engine import ring
from circle_jax.losses.multi_similarity import MultiSimilarity

# Slow (every engine compiled per rule): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

N_DEV = 8
LOCAL = 4
B = N_DEV * LOCAL
# Rows of device d are LABELS[4 d: 4 d + 4]. Class 0 fills device 0 (its
# positives are all local); class 1 is on devices 1, 2 and 7 (one, two and
# one samples); device 3's anchors have no positive anywhere (labels 20-23
# are unique); class 9 is a pair split over devices 5 and 6.
LABELS = np.array([0, 0, 0, 0,  1, 2, 3, 4,  1, 1, 2, 5,  20, 21, 22, 23,
                   3, 4, 5, 6,  6, 7, 8, 9,  9, 7, 8, 2,  1, 5, 4, 6],
                  np.int32)

PUBLIC = {
    "circle": (losses.circle_loss, dict(gamma=32.0)),
    "unified": (losses.unified_loss, dict(gamma=16.0)),
    "ms": (losses.multi_similarity_loss, {}),
    "rll": (losses.ranked_list_loss, {}),
    "contrastive": (losses.contrastive_loss,
                    dict(pos_margin=0.3, neg_margin=1.2)),
}


def _embeddings(seed=0, dim=5):
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(LABELS.max() + 1, dim))
  return (centres[LABELS] + 0.9 * rng.normal(size=(B, dim))).astype(np.float32)


def _mesh():
  return Mesh(np.array(jax.devices()[:N_DEV]), ("d",))


def _all_losses(x, labels, names=tuple(PUBLIC), **kw):
  """The losses' values and gradients, in one program (one compilation)."""
  return {name: jax.value_and_grad(
      lambda x: PUBLIC[name][0](x, labels, **PUBLIC[name][1], **kw))(x)
          for name in names}


def _on_devices(fn, mode, x, *args, names=tuple(PUBLIC)):
  """``fn(x, *args) -> {name: (value, grad)}`` with the batch split over the
  8 devices (axis ``"d"``); returns the values and the global gradients."""
  if mode == "shard_map":
    out_specs = {k: (P(), P("d")) for k in names}
    return jax.jit(jax.shard_map(
        fn, mesh=_mesh(), in_specs=(P("d"),) * (1 + len(args)),
        out_specs=out_specs))(x, *args)
  split = [jnp.asarray(a).reshape((N_DEV, -1) + a.shape[1:])
           for a in (x,) + args]
  out = jax.pmap(fn, axis_name="d")(*split)
  for v, _ in out.values():  # the global loss on every device
    np.testing.assert_allclose(np.asarray(v), float(v[0]), rtol=1e-6)
  return {k: (v[0], g.reshape(x.shape)) for k, (v, g) in out.items()}


def _assert_vg_close(got, want):
  """Value to float32 rounding; gradient to rounding of its largest entry."""
  scale = float(jnp.max(jnp.abs(want[1])))
  assert scale > 1e-4  # the gradient is not trivially zero
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(got[1], want[1], rtol=1e-5, atol=2e-5 * scale)


@pytest.fixture(scope="module")
def single_device():
  """The single-device global-batch losses (dense engine, no axis)."""
  x, labels = jnp.asarray(_embeddings()), jnp.asarray(LABELS)
  return jax.jit(_all_losses)(x, labels)


@pytest.mark.parametrize("mode, block_size", [
    ("shard_map", None), ("shard_map", 3), ("pmap", 3)])
def test_ring_equals_the_single_device_global_batch(single_device, mode,
                                                    block_size):
  x, labels = jnp.asarray(_embeddings()), jnp.asarray(LABELS)
  got = _on_devices(
      lambda x, labels: _all_losses(x, labels, axis_name="d",
                                    block_size=block_size, collective="ring"),
      mode, x, labels)
  for name in PUBLIC:
    _assert_vg_close(got[name], single_device[name])


def test_ring_honours_miner_masks():
  rng = np.random.default_rng(3)
  x, labels = jnp.asarray(_embeddings(seed=1)), jnp.asarray(LABELS)
  pm, nm = (jnp.asarray(rng.random((B, B)) < 0.7) for _ in range(2))
  names = ("ms", "contrastive")
  want = jax.jit(_all_losses, static_argnums=2)(x, labels, names, pos_mask=pm,
                                                neg_mask=nm)
  got = _on_devices(
      lambda x, labels, pm, nm: _all_losses(
          x, labels, names, axis_name="d", block_size=3, collective="ring",
          pos_mask=pm, neg_mask=nm),
      "shard_map", x, labels, pm, nm, names=names)
  for name in names:
    _assert_vg_close(got[name], want[name])


@pytest.mark.parametrize("block_size", [None, 3])
def test_ring_permutes_shards_and_gathers_nothing(block_size):
  """The compiled ring has collective-permutes and no all-gather (the
  all-gather engine has the opposite), so the equalities above are the
  ring's."""
  x, labels = jnp.asarray(_embeddings()), jnp.asarray(LABELS)

  def hlo(collective):
    fn = jax.shard_map(
        lambda x, labels: jax.value_and_grad(lambda x: losses.circle_loss(
            x, labels, axis_name="d", block_size=block_size,
            collective=collective))(x),
        mesh=_mesh(), in_specs=(P("d"), P("d")), out_specs=(P(), P("d")))
    return jax.jit(fn).lower(x, labels).as_text()

  text = hlo("ring")
  assert "all_gather" not in text and "collective_permute" in text
  text = hlo("all_gather")
  assert "all_gather" in text and "collective_permute" not in text


@pytest.mark.parametrize("devices", [1, 2])
def test_ring_of_one_or_two_devices(devices):
  """The shortest rings: no step inside the loop (1), one (2)."""
  x, labels = jnp.asarray(_embeddings()), jnp.asarray(LABELS)
  want = jax.value_and_grad(lambda x: losses.multi_similarity_loss(x, labels))(
      x)
  fn = jax.shard_map(
      lambda x, labels: jax.value_and_grad(lambda x: (
          losses.multi_similarity_loss(x, labels, axis_name="d", block_size=5,
                                       collective="ring")))(x),
      mesh=Mesh(np.array(jax.devices()[:devices]), ("d",)),
      in_specs=(P("d"), P("d")), out_specs=(P(), P("d")))
  _assert_vg_close(jax.jit(fn)(x, labels), want)


def test_collective_without_axis_name_is_the_single_device_loss():
  x, labels = jnp.asarray(_embeddings()), jnp.asarray(LABELS)
  for block_size in (None, 3):
    loss = jax.jit(losses.circle_loss,
                   static_argnames=("block_size", "collective"))
    want = loss(x, labels, block_size=block_size)
    got = loss(x, labels, block_size=block_size, collective="ring")
    assert float(got) == float(want)


@pytest.mark.parametrize("fn", [losses.circle_loss, losses.unified_loss,
                                losses.multi_similarity_loss,
                                losses.ranked_list_loss,
                                losses.contrastive_loss])
def test_bad_collective_is_one_line_value_error(fn):
  x, labels = jnp.asarray(_embeddings()), jnp.asarray(LABELS)
  with pytest.raises(ValueError, match=r"^`collective` must be one of "
                     r"\('all_gather', 'ring'\); got 'allgather'\.$"):
    fn(x, labels, collective="allgather")


def test_registry_forwards_collective():
  entry = losses.get_loss("multi_similarity")
  assert "collective" in entry.execution_options
  assert "collective" not in entry.defaults
  x, labels = jnp.asarray(_embeddings()), jnp.asarray(LABELS)
  assert float(entry.apply(x, labels, collective="ring")) == float(
      entry.apply(x, labels))


# ----------------------------------------------------------------------------
# Other columns on the ring (the reference-embedding form of the engine).
# ----------------------------------------------------------------------------


def test_ring_with_other_columns_equals_dense_on_the_valid_columns():
  """Rows meet a separate column set (3 per device) with ids that mark some
  pairs as the same sample and invalid columns that take no part."""
  rule = MultiSimilarity()  # with a pre-pass
  rng = np.random.default_rng(5)
  per_dev = 3
  n_cols = N_DEV * per_dev
  zr = np.asarray(ops.l2_normalize(jnp.asarray(_embeddings(seed=2))))
  zc = np.asarray(ops.l2_normalize(jnp.asarray(
      rng.normal(size=(n_cols, zr.shape[1])).astype(np.float32))))
  col_labels = rng.integers(0, 6, n_cols).astype(np.int32)
  col_ids = np.arange(n_cols, dtype=np.int32) + 20  # ids 20.. meet rows 20..
  valid = rng.random(n_cols) < 0.75
  row_ids = np.arange(B, dtype=np.int32)
  row_labels = LABELS % 6

  def reference(zr, zc):
    """Dense engine on the valid columns, summed over every anchor."""
    keep = np.flatnonzero(valid)
    s = zr @ zc[keep].T
    same = row_labels[:, None] == col_labels[keep][None, :]
    other = row_ids[:, None] != col_ids[keep][None, :]  # not a self pair
    per_anchor, ok = engine.dense_per_anchor(rule, s, same & other,
                                              ~same & other)
    return jnp.sum(jnp.where(ok, per_anchor, 0.0))

  want = jax.value_and_grad(reference, argnums=(0, 1))(
      jnp.asarray(zr), jnp.asarray(zc))

  def local(zr, lr, ir, zc, lc, ic, vc):
    def total(zr, zc):
      per_anchor, ok = ring.ring_per_anchor(
          rule, engine.PairSide(zr, lr, ir),
          engine.PairSide(zc, lc, ic, vc), axis_name="d", block_size=2)
      return ops.global_sum(jnp.sum(jnp.where(ok, per_anchor, 0.0)), "d")
    return jax.value_and_grad(total, argnums=(0, 1))(zr, zc)

  got = jax.jit(jax.shard_map(
      local, mesh=_mesh(), in_specs=(P("d"),) * 7,
      out_specs=(P(), (P("d"), P("d")))))(
          zr, LABELS % 6, row_ids, zc, col_labels, col_ids, valid)
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1]):
    scale = float(jnp.max(jnp.abs(w)))
    assert scale > 1e-4
    chex.assert_trees_all_close(g, w, rtol=1e-5, atol=2e-5 * scale)
  # Invalid columns get no gradient.
  np.testing.assert_array_equal(np.asarray(got[1][1])[~valid], 0.0)


def test_ring_with_reference_embeddings_equals_the_single_device_loss():
  """The public losses with references (a memory of 16 rows, 2 per device,
  a quarter of them invalid, some sharing ids with the anchors): ring on 8
  devices == one device with the whole memory, values and both gradients."""
  rng = np.random.default_rng(11)
  x = jnp.asarray(_embeddings(seed=3))
  mem = jnp.asarray(rng.normal(size=(16, x.shape[1])).astype(np.float32))
  mem_labels = jnp.asarray(rng.integers(0, 10, 16).astype(np.int32))
  mem_valid = jnp.asarray(rng.random(16) < 0.75)
  ids = jnp.arange(B, dtype=jnp.int32)
  mem_ids = jnp.asarray(rng.permutation(40)[:16].astype(np.int32))
  names = ("circle", "ms", "contrastive")

  def run(x, labels, mem, mem_labels, mem_valid, ids, mem_ids, **kw):
    def one(name, x, mem):
      fn, hyper = PUBLIC[name]
      return fn(x, labels, ref=losses.Candidates(
          mem, mem_labels, valid=mem_valid, ids=mem_ids, anchor_ids=ids),
                **hyper, **kw)
    return {n: jax.value_and_grad(functools.partial(one, n), argnums=(0, 1))(
        x, mem) for n in names}

  args = (x, jnp.asarray(LABELS), mem, mem_labels, mem_valid, ids, mem_ids)
  want = jax.jit(run)(*args)
  local = functools.partial(run, axis_name="d", collective="ring",
                            block_size=3)
  got = jax.jit(jax.shard_map(
      local, mesh=_mesh(), in_specs=(P("d"),) * len(args),
      out_specs={n: (P(), (P("d"), P("d"))) for n in names}))(*args)
  for n in names:
    _assert_vg_close((got[n][0], got[n][1][0]), (want[n][0], want[n][1][0]))
    _assert_vg_close((got[n][0], got[n][1][1]), (want[n][0], want[n][1][1]))
    np.testing.assert_array_equal(np.asarray(got[n][1][1])[~mem_valid], 0.0)


@pytest.mark.parametrize("collective", ["all_gather", "ring"])
def test_a_tuple_axis_name_spans_both_mesh_axes(single_device, collective):
  """``axis_name=("x", "y")`` on a 2 x 4 mesh (a pod's data axes): the batch
  split over both axes gives the single-device global-batch loss, for the
  all-gather and the ring (a ring over the 8 devices in the axes' order)."""
  x, labels = jnp.asarray(_embeddings()), jnp.asarray(LABELS)
  mesh = Mesh(np.array(jax.devices()[:N_DEV]).reshape(2, 4), ("x", "y"))
  axes = ("x", "y")
  fn = jax.jit(jax.shard_map(
      lambda x, labels: _all_losses(x, labels, axis_name=axes, block_size=3,
                                    collective=collective),
      mesh=mesh, in_specs=(P(axes), P(axes)),
      out_specs={k: (P(), P(axes)) for k in PUBLIC}))
  got = fn(x, labels)
  for name in PUBLIC:
    _assert_vg_close(got[name], single_device[name])


def test_multi_hot_labels_on_every_engine():
  """Multi-hot labels (a pair positive when the label sets intersect):
  dense == blockwise == all-gathered == ring on the 8 devices, for the
  batch and for references (a cross-batch memory) with multi-hot labels."""
  from tests.losses import pml_checks
  rng = np.random.default_rng(7)
  sets = rng.random((16, 4)) < 0.35
  sets[5] = False  # no label: a negative of every sample
  mem_sets = rng.random((24, 4)) < 0.35
  x = rng.normal(size=(16, 5))
  fn = losses.multi_similarity_loss  # a rule with a pre-pass
  got = pml_checks.engines(fn, x, sets)
  for name in ("blockwise", "all_gather", "ring"):
    pml_checks.close(got[name], got["dense"])
  dense, blockwise, on_ring = pml_checks.with_references(
      fn, x, sets, rng.normal(size=(24, 5)), mem_sets)
  pml_checks.close(blockwise, dense)
  pml_checks.close(on_ring, dense)
