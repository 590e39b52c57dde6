"""Reference embeddings (a cross-batch memory) for every pair loss.

Wang, Zhang, Huang, Scott, "Cross-Batch Memory for Embedding Learning", CVPR
2020 mines the anchors of a batch against stored reference embeddings. Every
pair loss takes ``ref=Candidates(embeddings, labels, valid, ids,
anchor_ids)``; these tests hold each loss to a float64 numpy reference
written naively (one anchor at a time, over the anchor's reference
positives and negatives), for references disjoint from the batch and
references containing it (self pairs excluded by ids, or by passing the batch
itself), invalid rows, the blockwise engine, 8 simulated devices, gradients
and bad inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

import circle_jax.losses as losses
from tests.losses import reference as ref
from tests.losses.engine import cases
from tests.losses.engine_checks import close, with_references
from tests.losses.reference import loss_ref

# Slow (many compiled cases): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow

Y = np.array([0, 1, 2, 0, 1, 2, 3, 0], np.int32)                      # B = 8
RY = np.array([0, 1, 2, 3, 4, 0, 1, 2, 0, 3, 1, 2, 4, 0], np.int32)   # M = 14
BETA = np.array([1.0, 1.1, 0.9, 1.2, 1.05], np.float32)  # margin's beta

# name -> (function, hyperparameters); small scales keep float32 close to
# float64. Circle is the paper's default margin at a smaller gamma.
LOSSES = {
    "circle": (losses.circle_loss, dict(margin=0.25, gamma=16.0)),
    "unified": (losses.unified_loss, dict(margin=0.2, gamma=8.0)),
    "ms": (losses.multi_similarity_loss, dict(beta=10.0)),
    "ms_no_mining": (losses.multi_similarity_loss,
                     dict(mining=False, beta=10.0)),
    "rll": (losses.ranked_list_loss, dict(t_pos=2.0, t_neg=4.0)),
    "contrastive": (losses.contrastive_loss,
                    dict(pos_margin=0.3, neg_margin=1.2)),
    "triplet_all": (losses.triplet_margin_loss, dict(margin=0.3)),
    "triplet_hard": (losses.triplet_margin_loss,
                     dict(margin=0.3, mining="batch_hard")),
    "triplet_semi": (losses.triplet_margin_loss,
                     dict(margin=0.3, mining="semi_hard")),
    "lifted": (losses.lifted_structure_loss, dict(margin=1.0)),
    "n_pair": (losses.n_pair_loss, dict(l2_reg=0.02)),
    "margin": (lambda x, y, **kw: losses.margin_loss(x, y, BETA, **kw),
               dict(margin=0.2, nu=0.1)),
}
RULE_BASED = ("circle", "unified", "ms", "ms_no_mining", "rll", "contrastive")


def _data(seed=0, b=8, m=14, d=4):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(b, d)).astype(np.float32),
          rng.normal(size=(m, d)).astype(np.float32))


# ----------------------------------------------------------------------------
# Float64 references, one anchor at a time, over the reference candidates.
# ----------------------------------------------------------------------------


def _sets(y, ry, i, valid, ids, rids):
  """Anchor i's positives and negatives among the references."""
  pos, neg = [], []
  for j in range(len(ry)):
    if not valid[j] or (ids is not None and ids[i] == rids[j]):
      continue
    (pos if ry[j] == y[i] else neg).append(j)
  return pos, neg


def _wmean(h, t):
  """sum w h / sum w with w = exp(t h); 0 when empty."""
  if not h:
    return 0.0
  h = np.array(h)
  w = np.exp(t * h - np.max(t * h))
  return float(np.sum(w * h) / np.sum(w))


def _mean_nonzero(v):
  v = [t for t in v if t > 0]
  return float(np.mean(v)) if v else 0.0


def reference(name, x, y, r, ry, valid=None, ids=None, rids=None):
  """The float64 loss of anchors ``x`` against references ``r``."""
  _, hyper = LOSSES[name]
  valid = np.ones(len(ry), bool) if valid is None else np.asarray(valid)
  s = ref.cos(x, r)
  d = np.sqrt(np.maximum(2.0 - 2.0 * s, 0.0))
  sets = [_sets(y, ry, i, valid, ids, rids) for i in range(len(y))]
  b = len(y)
  # The anchor's candidates (valid, not itself by id) as a [B, M] mask.
  allowed = np.zeros((b, len(ry)), bool)
  for i, (pos, neg) in enumerate(sets):
    allowed[i, pos + neg] = True
  if name in ("circle", "unified"):
    anchor = (ref.ref_circle_anchor if name == "circle"
              else ref.ref_unified_anchor)
    return ref.ref_pair_loss(anchor, s, y, allowed, allowed, col_y=ry,
                             margin=hyper["margin"], gamma=hyper["gamma"])
  if name.startswith("ms"):
    return ref.ref_ms(s, y, beta=hyper["beta"],
                      mining=hyper.get("mining", True), pos_mask=allowed,
                      neg_mask=allowed, col_y=ry)
  if name == "rll":
    alpha, m, lam = 1.2, 0.4, 0.5
    total = 0.0
    for i, (pos, neg) in enumerate(sets):
      hp = [d[i, j] - (alpha - m) for j in pos if d[i, j] > alpha - m]
      hn = [alpha - d[i, j] for j in neg if d[i, j] < alpha]
      total += ((1 - lam) * _wmean(hp, hyper["t_pos"])
                + lam * _wmean(hn, hyper["t_neg"]))
    return total / b
  if name == "contrastive":
    tp = [max(0.0, d[i, j] - hyper["pos_margin"])
          for i, (pos, _) in enumerate(sets) for j in pos]
    tn = [max(0.0, hyper["neg_margin"] - d[i, j])
          for i, (_, neg) in enumerate(sets) for j in neg]
    return _mean_nonzero(tp) + _mean_nonzero(tn)
  if name.startswith("triplet"):
    mg, terms = hyper["margin"], []
    for a, (pos, neg) in enumerate(sets):
      if name == "triplet_all":
        terms += [max(0.0, d[a, p] - d[a, n] + mg) for p in pos for n in neg]
      elif name == "triplet_hard":
        if pos and neg:
          terms.append(max(0.0, max(d[a, pos]) - min(d[a, neg]) + mg))
      elif neg:
        for p in pos:
          farther = [d[a, n] for n in neg if d[a, n] > d[a, p]]
          dn = min(farther) if farther else max(d[a, neg])
          terms.append(max(0.0, d[a, p] - dn + mg))
    if name == "triplet_all":
      return _mean_nonzero(terms)
    return float(np.mean(terms)) if terms else 0.0
  if name == "lifted":
    total, count = 0.0, 0
    for i, (pos, neg) in enumerate(sets):
      for j in pos:
        if neg:  # only the anchor's negatives among the references
          lse = ref.logsumexp([hyper["margin"] - d[i, k] for k in neg])
          total += max(0.0, lse + d[i, j]) ** 2
        count += 1
    return 0.5 * total / count if count else 0.0
  if name == "n_pair":
    f, fr = np.asarray(x, np.float64), np.asarray(r, np.float64)
    ip = f @ fr.T
    terms = [np.log1p(sum(np.exp(ip[a, n] - ip[a, p]) for n in neg))
             for a, (pos, neg) in enumerate(sets) if neg for p in pos]
    tuplet = float(np.mean(terms)) if terms else 0.0
    return tuplet + hyper["l2_reg"] * float(np.mean((f * f).sum(1)))
  assert name == "margin"
  total, count = 0.0, 0.0
  for a, (pos, neg) in enumerate(sets):
    ba = float(BETA[y[a]])
    for p in pos:
      lp = max(0.0, d[a, p] - ba + hyper["margin"])
      total += lp + hyper["nu"] * ba
      count += lp > 0
    for n in neg:
      ln = max(0.0, ba - d[a, n] + hyper["margin"])
      total += ln
      count += ln > 0
  return total / max(count, 1.0)


def _loss(name, x, y, **kw):
  fn, hyper = LOSSES[name]
  return fn(x, y, **{**hyper, **kw})


def _close(got, want):
  np.testing.assert_allclose(float(got), want, rtol=2e-4, atol=1e-5)


# ----------------------------------------------------------------------------
# Values against the float64 references.
# ----------------------------------------------------------------------------


def test_hand_computed_tiny_case():
  # One anchor on the x axis; references at 60 degrees (same class, distance
  # 1) and 90 degrees (other class, distance sqrt 2): the only triplet costs
  # [1 - sqrt(2) + 0.5]_+.
  x = np.array([[2.0, 0.0]], np.float32)
  r = np.array([[0.5, np.sqrt(3) / 2], [0.0, 3.0]], np.float32)
  got = losses.triplet_margin_loss(x, np.array([0]), margin=0.5,
                                   ref=losses.Candidates(r, np.array([0, 1])))
  np.testing.assert_allclose(float(got), 1.5 - np.sqrt(2.0), rtol=1e-5)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_disjoint_references_match_float64_reference(name):
  x, r = _data()
  got = _loss(name, x, Y, ref=losses.Candidates(r, RY))
  want = reference(name, x, Y, r, RY)
  assert want != 0.0
  _close(got, want)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_references_containing_the_anchors_exclude_self_pairs(name):
  x, r = _data()
  big = np.concatenate([r, x])      # the batch inside a larger memory
  big_y = np.concatenate([RY, Y])
  ids = np.arange(8, dtype=np.int32) + 100
  rids = np.concatenate([np.arange(14), ids]).astype(np.int32)
  got = _loss(name, x, Y, ref=losses.Candidates(big, big_y, ids=rids,
                                                anchor_ids=ids))
  _close(got, reference(name, x, Y, big, big_y, ids=ids, rids=rids))
  # Without ids an anchor meets itself (a positive at distance 0).
  without = _loss(name, x, Y, ref=losses.Candidates(big, big_y))
  _close(without, reference(name, x, Y, big, big_y))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_the_batch_itself_as_references_excludes_self_pairs(name):
  x, _ = _data()
  xj = jnp.asarray(x)  # the same object twice: ids default to the rows
  got = _loss(name, xj, Y, ref=losses.Candidates(xj, Y))
  rows = np.arange(8)
  _close(got, reference(name, x, Y, x, Y, ids=rows, rids=rows))
  plain = _loss(name, xj, Y)
  if name == "lifted":
    # The plain loss adds the positive's own negatives (the N_j term); with
    # references only the anchor's negatives count.
    assert abs(float(got) - float(plain)) > 1e-3
  else:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_invalid_references_equal_dropping_them(name):
  x, r = _data()
  valid = np.ones(14, bool)
  valid[[1, 4, 9, 13]] = False
  got = _loss(name, x, Y, ref=losses.Candidates(r, RY, valid=valid))
  dropped = _loss(name, x, Y, ref=losses.Candidates(r[valid], RY[valid]))
  np.testing.assert_allclose(float(got), float(dropped), rtol=1e-6, atol=1e-7)
  _close(got, reference(name, x, Y, r, RY, valid=valid))


def test_no_valid_reference_gives_zero_loss_and_zero_gradient():
  x, r = _data()

  @jax.jit
  def all_losses(x, r):
    return {name: jax.value_and_grad(
        lambda x, r: _loss(name, x, Y, ref=losses.Candidates(
            r, RY, valid=jnp.zeros(14, bool))),
        argnums=(0, 1))(x, r) for name in sorted(LOSSES)}

  for name, (v, grads) in all_losses(x, r).items():
    want = 0.02 * float(np.mean((x * x).sum(1))) if name == "n_pair" else 0.0
    np.testing.assert_allclose(float(v), want, rtol=1e-6, err_msg=name)
    if name != "n_pair":  # (its L2 penalty has a gradient)
      np.testing.assert_array_equal(np.asarray(grads[0]), 0.0)
    np.testing.assert_array_equal(np.asarray(grads[1]), 0.0)


# ----------------------------------------------------------------------------
# Engines and devices.
# ----------------------------------------------------------------------------


def _ref_kwargs():
  x, r = _data(seed=3, b=16, m=24)
  y = np.tile(Y, 2)
  ry = np.concatenate([RY, RY[:10]])
  valid = np.arange(24) % 7 != 3
  ids = np.arange(16, dtype=np.int32)
  rids = np.concatenate([np.arange(100, 116), np.arange(8)]).astype(np.int32)
  r[16:] = x[:8]  # the last references are anchors 0..7
  return x, y, r, dict(labels=ry, valid=valid, ids=rids, anchor_ids=ids)


def _value_and_grads(name, x, y, r, kw, **extra):
  return jax.jit(jax.value_and_grad(
      lambda x, r: _loss(name, x, y, ref=losses.Candidates(r, **kw), **extra),
      argnums=(0, 1)))(x, r)


def _assert_vg_close(got, want):
  (v, (gx, gr)), (wv, (wx, wr)) = got, want
  np.testing.assert_allclose(float(v), float(wv), rtol=1e-5, atol=1e-6)
  for a, b in ((gx, wx), (gr, wr)):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4,
                               atol=1e-5 * max(1.0, np.abs(b).max()))


# Block sizes that divide neither the 16 anchors nor the 24 references.
@pytest.mark.parametrize("name,block_size",
                         [(n, 3 + 2 * (k % 2)) for k, n in enumerate(RULE_BASED)])
def test_blockwise_equals_dense(name, block_size):
  x, y, r, kw = _ref_kwargs()
  want = _value_and_grads(name, x, y, r, kw)
  assert float(want[0]) != 0.0 and np.abs(np.asarray(want[1][1])).max() > 0
  _assert_vg_close(_value_and_grads(name, x, y, r, kw, block_size=block_size),
                   want)


def _sharded(name, x, y, r, kw, mode, **extra):
  n = jax.device_count()

  def local(x, y, r, ry, valid, ids, rids):
    return jax.value_and_grad(lambda x, r: _loss(
        name, x, y, ref=losses.Candidates(r, ry, valid=valid, ids=rids,
                                          anchor_ids=ids),
        axis_name="d", **extra), argnums=(0, 1))(x, r)

  args = (x, y, r, kw["labels"], kw["valid"], kw["anchor_ids"], kw["ids"])
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"),) * 7,
                                 out_specs=(P(), (P("d"), P("d")))))(*args)
  v, (gx, gr) = jax.pmap(local, axis_name="d")(
      *(np.reshape(a, (n, -1) + np.shape(a)[1:]) for a in args))
  np.testing.assert_allclose(np.asarray(v), float(v[0]), rtol=1e-6)
  return v[0], (gx.reshape(x.shape), gr.reshape(r.shape))


_SHARDED = ([(n, None, "shard_map") for n in sorted(LOSSES)
             if n not in ("ms_no_mining", "triplet_hard")]
            + [(n, 5, "shard_map") for n in ("ms", "rll", "contrastive")]
            + [(n, None, "pmap") for n in ("circle", "lifted", "n_pair")]
            + [("circle", 5, "pmap")])


@pytest.mark.parametrize("name,block_size,mode", _SHARDED)
def test_axis_name_with_sharded_anchors_and_references(name, block_size,
                                                       mode):
  x, y, r, kw = _ref_kwargs()
  extra = {} if block_size is None else {"block_size": block_size}
  want = _value_and_grads(name, x, y, r, kw, **extra)
  _assert_vg_close(_sharded(name, x, y, r, kw, mode, **extra), want)


@pytest.mark.parametrize("name", ["circle", "triplet_semi"])
def test_the_batch_itself_as_references_on_8_devices(name):
  # Each device passes its shard as both anchors and references: the ids
  # default to the global row indices, so the loss is the plain one.
  x, y, _, _ = _ref_kwargs()

  def local(x, y):
    return (_loss(name, x, y, axis_name="d"),
            _loss(name, x, y, ref=losses.Candidates(x, y), axis_name="d"))

  mesh = Mesh(np.array(jax.devices()), ("d",))
  plain, with_refs = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(P(), P())))(x, y)
  assert float(plain) > 0
  np.testing.assert_allclose(float(with_refs), float(plain), rtol=1e-6)


@pytest.mark.parametrize("mode", ["shard_map"])
def test_margin_sampling_with_references_does_not_depend_on_devices(mode):
  x, y, r, kw = _ref_kwargs()
  extra = dict(key=jax.random.PRNGKey(4))
  want = _value_and_grads("margin", x, y, r, kw, **extra)
  assert float(want[0]) != float(_value_and_grads("margin", x, y, r, kw)[0])
  _assert_vg_close(_sharded("margin", x, y, r, kw, mode, **extra), want)


# ----------------------------------------------------------------------------
# Gradients.
# ----------------------------------------------------------------------------


# Circle's alphas and Ranked List's weights are constants in backprop by
# design, so their gradient is not the finite difference of the value. The
# contrastive and margin losses divide by the number of non-zero pairs, a
# step function: their margins here make every pair non-zero.
@pytest.mark.parametrize("name,hyper", [
    ("unified", {}), ("ms_no_mining", {}), ("triplet_all", {}),
    ("lifted", {}), ("n_pair", {}),
    ("contrastive", dict(pos_margin=0.0, neg_margin=2.0)),
    ("margin", dict(margin=2.0))])
def test_check_grads(name, hyper):
  x, r = _data(seed=5, b=4, m=6)
  y, ry = Y[:4], RY[:6]
  f = jax.jit(lambda x, r: _loss(name, x, y, ref=losses.Candidates(r, ry),
                                 **hyper))
  check_grads(f, (x, r), order=1, modes=("rev",), eps=1e-3, atol=2e-3,
              rtol=2e-3)


def test_stop_gradient_keeps_the_memory_constant():
  x, r = _data()
  g = jax.grad(lambda r: losses.circle_loss(
      x, Y, ref=losses.Candidates(jax.lax.stop_gradient(r), RY)))(r)
  np.testing.assert_array_equal(np.asarray(g), 0.0)


# ----------------------------------------------------------------------------
# The registry and bad inputs.
# ----------------------------------------------------------------------------


def test_registry_forwards_references_and_rejects_them_for_other_losses():
  x, r = _data()
  supported = {n for n, e in losses.LOSSES.items() if e.supports_ref}
  assert supported == {"circle", "unified", "multi_similarity", "ranked_list",
                       "contrastive", "triplet", "lifted_structure", "n_pair",
                       "margin", "supcon", "nt_xent", "pairwise_ce",
                       "pairwise_sigmoid", "smooth_ap", "fastap"} | {
                       # issue #40's, each tested with references in its
                       # own test file
                       "nca", "angular", "generalized_lifted_structure",
                       "intra_pair_variance", "snr_contrastive",
                       "tuplet_margin", "threshold_consistent_margin", "pnp",
                       "instance", "histogram", "dynamic_soft_margin"} | {
                       "potential_field", "recall_at_k"}  # issue 41, own files
  got = losses.get_loss("circle").apply(
      x, Y, ref=losses.Candidates(r, RY, valid=np.ones(14, bool)))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(
      losses.circle_loss(x, Y, ref=losses.Candidates(r, RY))))
  assert "ref" not in losses.get_loss("circle").defaults
  entry = losses.get_loss("proxy_anchor")
  p = entry.init_params(jax.random.PRNGKey(0), 5, 4)
  with pytest.raises(ValueError, match="'proxy_anchor' does not support "
                                       "reference embeddings"):
    entry.apply(x, Y, p, ref=losses.Candidates(r, RY))


def _one_line_error(fn, match):
  with pytest.raises(ValueError, match=match) as info:
    fn()
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["circle", "triplet_all", "n_pair"])
def test_bad_inputs_give_one_line_errors(name):
  x, r = _data()
  ids, rids = np.arange(8), np.arange(14)
  cases = [
      (dict(ref=losses.Candidates(r, None)), "needs its `labels`"),
      (dict(ref=losses.Candidates(r[:, :3], RY)), "dimension 3"),
      (dict(ref=losses.Candidates(r, RY[:13])), r"`ref.labels` has length "
                                                   r"13 but there are 14"),
      (dict(ref=losses.Candidates(r, RY, ids=rids, anchor_ids=ids + 0.5)),
       "`ref.anchor_ids` must be an integer array"),
      (dict(ref=losses.Candidates(r, RY, ids=rids * 1.0, anchor_ids=ids)),
       "`ref.ids` must be an integer array"),
      (dict(ref=losses.Candidates(r, RY, anchor_ids=ids)), "both `ref.ids` and "
                                                   "`ref.anchor_ids`"),
      (dict(ref=losses.Candidates(r, RY, valid=np.ones(14))),
       "`ref.valid` must be a bool array"),
      (dict(ref=losses.Candidates(r, RY, valid=np.ones(13, bool))),
       r"`ref.valid` must have shape \(14,\)"),
  ]
  for kw, match in cases:
    _one_line_error(lambda: _loss(name, x, Y, **kw), match)
  with pytest.raises(TypeError, match="`ref` must be a circle_jax.losses."
                                      "Candidates"):
    _loss(name, x, Y, ref=(r, RY))


@pytest.mark.parametrize("case", sorted(cases.FAMILY_CASES))
def test_contrastive_family_reference_embeddings_on_every_engine(case):
  name, fn, hyper = cases.family_case(case)
  rng = np.random.default_rng(7)
  mem = rng.normal(size=(16, 5)).astype(np.float32)
  mem_labels = rng.integers(0, 6, 16).astype(np.int32)
  x, labels = cases.family_batch(seed=4), jnp.asarray(cases.FAMILY_LABELS)

  want, *others = with_references(fn, x, labels, mem, mem_labels,
                                  **cases.geometry_kw(hyper))
  np.testing.assert_allclose(
      float(want[0]),
      loss_ref(name, x, cases.FAMILY_LABELS, hyper, cols=mem,
               col_y=mem_labels),
      rtol=2e-5)
  for got in others:
    for k in (0, 1):
      close((got[0], got[1][k]), (want[0], want[1][k]))
