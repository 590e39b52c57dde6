"""PML 2.9's miners in circle_jax.losses.pml_miners: the mined pairs and
triplets equal PML's on random float64 batches (ours compute in float32),
at the defaults and at other hyperparameters; 8 devices equal one."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from circle_jax import losses
from circle_jax.losses import pml_miners as pm
from tests.losses import pml_checks

torch = pytest.importorskip("torch")
pml_miners = pytest.importorskip("pytorch_metric_learning.miners")
pml_losses = pytest.importorskip("pytorch_metric_learning.losses")

Y = pml_checks.LABELS  # 5 classes of 3 and a singleton
# 4 classes of 4: 48 positive and 192 negative ordered pairs, so that HDC's
# ceil(f |P|) is even for f in {0.25, 0.5, 0.75} and never splits the two
# equal distances of (i, j) and (j, i) (whose order torch.topk leaves open).
Y4 = np.repeat(np.arange(4), 4)
_KEY = jax.random.PRNGKey(3)


def _pml(miner, x, y):
  with torch.no_grad():
    return miner(torch.tensor(x), torch.tensor(y, dtype=torch.int64))


def _pairs(out, b=16):
  """PML's indices as ``(pos_mask, neg_mask)`` (triplets: their pairs)."""
  idx = [v.numpy() for v in out]
  a1, p, a2, n = idx if len(idx) == 4 else (idx[0], idx[1], idx[0], idx[2])
  pm_, nm = np.zeros((b, b), bool), np.zeros((b, b), bool)
  pm_[a1, p] = True
  nm[a2, n] = True
  return pm_, nm


def _triplets(out, b=16):
  t = np.zeros((b, b, b), bool)
  t[tuple(v.numpy() for v in out)] = True
  return t


def _same(got, want, what):
  for g, w, side in zip(got, want, ("pos", "neg")):
    np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{what} {side}")


_MARGIN_CASES = [(0.2, "all"), (0.2, "hard"), (0.2, "semihard"),
                 (0.2, "easy"), (0.5, "all"), (0.05, "semihard"),
                 (-0.1, "hard"), (0.4, "easy")]
_ANGLES = [20, 10, 35, 45]


def _batches(n):
  return np.stack([pml_checks.batch(seed) for seed in range(n)])


@jax.jit
def _triplet_miners(xs):
  """Every case of the two triplet miners in one compiled program."""
  tm = [(pm.triplet_margin_triplets(x, Y, margin=m, type_of_triplets=k),
         pm.triplet_margin_miner(x, Y, margin=m, type_of_triplets=k))
        for x, (m, k) in zip(xs, _MARGIN_CASES)]
  ang = [(pm.angular_triplets(x, Y, angle=a), pm.angular_miner(x, Y, angle=a))
         for x, a in zip(xs, _ANGLES)]
  return tm, ang


def test_triplet_margin_and_angular_equal_pml():
  xs = _batches(len(_MARGIN_CASES))
  tm, ang = _triplet_miners(xs)
  cases = ([(pml_miners.TripletMarginMiner(margin=m, type_of_triplets=k),
             f"{k} {m}") for m, k in _MARGIN_CASES]
           + [(pml_miners.AngularMiner(angle=a), f"angle {a}")
              for a in _ANGLES])
  # Angular's distances are those of x as given (not normalised), as PML's.
  for x, (table, masks), (miner, what) in zip(
      list(xs) + list(xs[:len(_ANGLES)]), tm + ang, cases):
    want = _pml(miner, x, Y)
    assert 0 < len(want[0]) < 390, what  # some kept, some dropped
    np.testing.assert_array_equal(np.asarray(table), _triplets(want), what)
    _same(masks, _pairs(want), what)


_RANGES = [(None, None), ((0.6, 1.3), (0.9, 1.5))]
_STRATEGY_CASES = [
    dict(pos_strategy=ps, neg_strategy=ns, allowed_pos_range=pr,
         allowed_neg_range=nr)
    for ps in pm.STRATEGIES for ns in pm.STRATEGIES for pr, nr in _RANGES
    if ps != ns or ps != "semihard"
    if not ({ps, ns} >= {"semihard", "all"})]


def test_batch_easy_hard_equals_pml_for_every_strategy_and_range():
  assert len(_STRATEGY_CASES) == 2 * 13  # 16 pairs but the 3 PML refuses
  x = pml_checks.batch(1)
  got = jax.jit(lambda x: [pm.batch_easy_hard_miner(x, Y, **kw)
                           for kw in _STRATEGY_CASES])(x)
  for kw, masks in zip(_STRATEGY_CASES, got):
    want = _pairs(_pml(pml_miners.BatchEasyHardMiner(**kw), x, Y))
    _same(masks, want, str(kw))
  for ps, ns in [("semihard", "semihard"), ("semihard", "all"),
                 ("all", "semihard")]:
    with pytest.raises(ValueError):
      pml_miners.BatchEasyHardMiner(pos_strategy=ps, neg_strategy=ns)
    with pytest.raises(ValueError, match="semihard"):
      pm.batch_easy_hard_miner(x, Y, pos_strategy=ps, neg_strategy=ns)


def test_hdc_equals_pml():
  fractions = [0.5, 0.25, 0.75, 1.0]
  xs = _batches(len(fractions))
  got = jax.jit(lambda xs: [pm.hdc_miner(x, Y4, filter_percentage=f)
                            for x, f in zip(xs, fractions)])(xs)
  for x, f, masks in zip(xs, fractions, got):
    want = _pairs(_pml(pml_miners.HDCMiner(filter_percentage=f), x, Y4))
    assert want[0].sum() == f * 48 and want[1].sum() == f * 192
    _same(masks, want, str(f))


def _bins64(d, mask, num_bins):
  """PML's bin loop in float64: the bin of each masked entry, -1 else."""
  v = d[mask]
  edges = torch.linspace(v.min(), v.max(), num_bins + 1,
                         dtype=torch.float64).numpy()
  out = np.full(d.shape, -1)
  for i in range(num_bins):
    last = i == num_bins - 1
    inside = mask & (edges[i] <= d) & ((d <= edges[i + 1]) if last
                                       else (d < edges[i + 1]))
    out[inside] = i
  return out


def test_uniform_histogram_deterministic_parts_equal_pml():
  x = pml_checks.batch(0)
  u = x / np.linalg.norm(x, axis=1, keepdims=True)
  d = np.sqrt(np.maximum(2 - 2 * u @ u.T, 0))
  same = Y[:, None] == Y[None, :]
  pos, neg = same & ~np.eye(16, dtype=bool), ~same
  cases = [(100, 10, 10), (7, 3, 2)]
  got = jax.jit(lambda x, d: [
      (pm.uniform_histogram_miner(x, Y, _KEY, num_bins=b, pos_per_bin=p,
                                  neg_per_bin=n),
       pm.histogram_bins(d, pos, b), pm.histogram_bins(d, neg, b))
      for b, p, n in cases])(x, d.astype(np.float32))
  for (num_bins, per_pos, per_neg), (w, *our_bins) in zip(cases, got):
    torch.manual_seed(0)
    want = _pml(pml_miners.UniformHistogramMiner(
        num_bins=num_bins, pos_per_bin=per_pos, neg_per_bin=per_neg), x, Y)
    w = np.asarray(w)
    for mask, per, a, o, b_ours in [(pos, per_pos, 0, 1, our_bins[0]),
                                    (neg, per_neg, 2, 3, our_bins[1])]:
      bins = _bins64(d, mask, num_bins)
      np.testing.assert_array_equal(np.asarray(b_ours)[mask], bins[mask])
      pml_bins = bins[want[a].numpy(), want[o].numpy()]
      ours = np.bincount(bins[mask], weights=w[mask], minlength=num_bins)
      # Each non-empty bin draws `per` pairs of its own, in both.
      np.testing.assert_array_equal(
          np.bincount(pml_bins, minlength=num_bins), ours)
      np.testing.assert_array_equal(
          ours, per * (np.bincount(bins[mask], minlength=num_bins) > 0))
    assert np.all(w[~(pos | neg)] == 0)


def test_uniform_histogram_draws_are_uniform_within_each_bin():
  x = pml_checks.batch(2)
  n_keys = 400
  draws = jax.jit(jax.vmap(lambda k: pm.uniform_histogram_miner(
      x, Y, k, num_bins=4, pos_per_bin=5, neg_per_bin=5)))
  counts = np.asarray(draws(jax.random.split(_KEY, n_keys))).sum(0)
  u = x / np.linalg.norm(x, axis=1, keepdims=True)
  d = np.sqrt(np.maximum(2 - 2 * u @ u.T, 0))
  same = Y[:, None] == Y[None, :]
  for mask in (same & ~np.eye(16, dtype=bool), ~same):
    bins = _bins64(d, mask, 4)
    for b in range(4):
      members = counts[bins == b]
      if members.size == 0:
        continue
      p = 1.0 / members.size
      mean = n_keys * 5 * p
      sigma = np.sqrt(n_keys * 5 * p * (1 - p))
      assert members.sum() == n_keys * 5
      assert np.all(np.abs(members - mean) <= 5 * sigma + 1e-9), (b, members)


def test_triplet_loss_on_mined_masks_equals_pml():
  # triplet_margin ("all", same margin): the pair projection adds only
  # zero-hinge triplets. batch_easy_hard: PML's convert_to_triplets of the
  # mined pairs is every triplet of the two masks.
  x = pml_checks.batch(4)
  bet = dict(pos_strategy="hard", neg_strategy="all")

  @jax.jit
  def ours(x):
    def loss(x, masks):
      return losses.triplet_margin_loss(x, Y, margin=0.2, pos_mask=masks[0],
                                        neg_mask=masks[1])
    return [jax.value_and_grad(loss)(x, masks) for masks in (
        pm.triplet_margin_miner(x, Y, margin=0.2),
        pm.batch_easy_hard_miner(x, Y, **bet))]
  got = ours(x.astype(np.float32))
  loss = pml_losses.TripletMarginLoss(margin=0.2)
  for miner, g in zip([pml_miners.TripletMarginMiner(margin=0.2),
                       pml_miners.BatchEasyHardMiner(**bet)], got):
    want = pml_checks.pml_vg(loss, x, Y, indices_tuple=_pml(miner, x, Y))
    assert want[0] > 0
    pml_checks.close(jax.tree.map(np.asarray, g), want)


def _new_miners(x, y, axis_name=None):
  """Every new miner, and contrastive on each one's masks."""
  out = []
  for name in ("angular", "batch_easy_hard", "hdc", "triplet_margin",
               "uniform_histogram"):
    pm_, nm = losses.get_miner(name).bind()(x, y, key=_KEY,
                                            axis_name=axis_name)
    out += [pm_, nm, losses.contrastive_loss(
        x, y, pos_mask=pm_, neg_mask=nm, axis_name=axis_name)]
  return out


def test_new_miners_on_8_devices_equal_one_device():
  x = pml_checks.batch(5).astype(np.float32)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  specs = [P("d"), P("d"), P()] * 5
  local = jax.jit(jax.shard_map(
      functools.partial(_new_miners, axis_name="d"), mesh=mesh,
      in_specs=(P("d"), P("d")), out_specs=specs))(x, Y)
  whole = jax.jit(_new_miners)(x, Y)
  for k, (got, want) in enumerate(zip(local, whole)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6,
                               err_msg=str(k))
  assert all(float(v) > 0 for v in whole[2::3])


def test_bad_inputs():
  x = pml_checks.batch(0)
  cases = [
      (lambda: pm.angular_miner(x, Y, angle=90), "angle"),
      (lambda: pm.hdc_miner(x, Y, filter_percentage=1.5),
       "filter_percentage"),
      (lambda: pm.triplet_margin_miner(x, Y, type_of_triplets="hardest"),
       "type_of_triplets"),
      (lambda: pm.batch_easy_hard_miner(x, Y, pos_strategy="medium"),
       "pos_strategy"),
      (lambda: pm.batch_easy_hard_miner(x, Y, pos_strategy="semihard",
                                        neg_strategy="semihard"), "both"),
      (lambda: pm.batch_easy_hard_miner(x, Y, allowed_neg_range=(1.0, 0.5)),
       "allowed_neg_range"),
      (lambda: pm.uniform_histogram_miner(x, Y, _KEY, num_bins=0),
       "num_bins"),
      (lambda: pm.triplet_margin_miner(x, Y[:3]), "labels"),
  ]
  for fn, match in cases:
    with pytest.raises(ValueError, match=match) as info:
      fn()
    assert "\n" not in str(info.value), match


def test_miners_with_reference_embeddings_equal_pmls_ref_emb():
  """Miners of both modules mine anchors x references (``ref``) as PML's
  miners do with ``ref_emb``; a pair loss on those masks and the same
  ``ref`` equals PML's on the mined tuples (value and gradients)."""
  x = pml_checks.batch(11)
  mem = pml_checks.batch(12)[:12]
  mem_y = np.arange(12) % 6
  ref = losses.Candidates(mem, mem_y)
  cases = [
      (losses.pair_margin_miner, pml_miners.PairMarginMiner(), {}),
      (pm.triplet_margin_miner, pml_miners.TripletMarginMiner(margin=0.3),
       dict(margin=0.3)),
      (pm.hdc_miner, pml_miners.HDCMiner(filter_percentage=0.5),
       dict(filter_percentage=0.5)),
  ]
  got = jax.jit(lambda x, ref: [fn(x, Y, ref=ref, **kw)
                                for fn, _, kw in cases])(x, ref)
  for (fn, theirs, _), masks in zip(cases, got):
    with torch.no_grad():
      out = theirs(torch.tensor(x), torch.tensor(Y), torch.tensor(mem),
                   torch.tensor(mem_y))
    idx = [v.numpy() for v in out]
    a1, p, a2, n = idx if len(idx) == 4 else (idx[0], idx[1], idx[0], idx[2])
    want = np.zeros((16, 12), bool), np.zeros((16, 12), bool)
    want[0][a1, p], want[1][a2, n] = True, True
    assert want[0].any() and want[1].any()
    _same(masks, want, fn.__name__)
  # The loss on the masks and the references equals PML's on the tuples.
  pos, neg = got[0]
  vg = jax.jit(jax.value_and_grad(lambda x, r: losses.contrastive_loss(
      x, Y, ref=losses.Candidates(r, mem_y), pos_mask=pos, neg_mask=neg),
                                  argnums=(0, 1)))
  value, grads = vg(jax.numpy.asarray(x, "float32"),
                    jax.numpy.asarray(mem, "float32"))
  tuples = tuple(torch.tensor(np.nonzero(m)[i]) for m in (pos, neg)
                 for i in (0, 1))
  pml_checks.close((value, grads), pml_checks.pml_vg(
      pml_losses.ContrastiveLoss(pos_margin=0.0, neg_margin=0.5), x, Y,
      mem, mem_y, indices_tuple=tuples))
  with pytest.raises(ValueError, match="takes no reference"):
    losses.get_miner("angular").bind()(x, Y, ref=ref)
