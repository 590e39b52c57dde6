"""Tests of RS@k and SiMix (circle_jax/losses/recall_at_k.py): a loop-written
float64 reference, a float64 transcription of the official PyTorch loss
(yash0307/RecallatK_surrogate, ``src/losses.py`` and ``src/mixup.py``),
tiles, devices, masks, empty sets and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax import losses
from tests.losses.engine_checks import mesh

torch = pytest.importorskip("torch")

B, D = 12, 6
LABELS = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4], np.int32)  # 3: alone
K = (1, 2, 4, 8, 16)


def batch(seed=0, n=B):
  return np.random.default_rng(seed).normal(size=(n, D)).astype(np.float32)


def reference(x, y, tau1, tau2, k=K, pos_mask=None, neg_mask=None,
              counts_query=False):
  """The paper's RS@k loss written with loops over anchors, k and
  positives: float64 value and (torch autograd) gradient."""
  x = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
  z = x / x.norm(dim=1, keepdim=True)
  s = z @ z.T
  n = len(y)
  ok_p = np.ones((n, n), bool) if pos_mask is None else pos_mask
  ok_n = np.ones((n, n), bool) if neg_mask is None else neg_mask
  terms = []
  for i in range(n):
    pos = [j for j in range(n) if j != i and y[j] == y[i] and ok_p[i, j]]
    neg = [j for j in range(n) if y[j] != y[i] and ok_n[i, j]]
    if not pos:
      continue
    rs = 0.0
    for kk in (min(v, n) for v in k):
      count = 0.0
      for p in pos:
        others = [c for c in pos + neg if c != p] + (
            [i] if counts_query else [])
        rank = 1 + torch.sigmoid((s[i, others] - s[i, p]) / tau1).sum()
        count = count + torch.sigmoid((kk - rank) / tau2)
      rs = rs + torch.clamp(count, max=kk) / min(kk, len(pos))
    terms.append(1 - rs / len(k))
  loss = torch.stack(terms).mean() if terms else x.sum() * 0
  loss.backward()
  return loss.item(), x.grad.numpy()


def official_loss(preds, num_id, k_vals, tau1, bs=None):
  """A float64 transcription of ``RecallatK.forward`` (src/losses.py),
  summed over every query as ``train_one_epoch`` does (``.cuda()`` left
  out): the batch is ``num_id`` contiguous classes of equal size, and the
  rank of each positive counts every other sample, the query included."""
  n = preds.shape[0]
  per = n // num_id
  k_vals = [min(bs or n, k) for k in k_vals]
  norm = torch.tensor([min(k, per - 1) for k in k_vals], dtype=preds.dtype)
  kv = torch.tensor(k_vals, dtype=preds.dtype)
  loss = 0.0
  for q in range(n):
    group = q // per
    sim = preds[q] @ preds.T
    diff = sim[:, None] - sim.view(num_id, per)[group][None, :]
    sg = torch.sigmoid(diff / tau1)
    own = torch.ones_like(sg)
    for i in range(per):
      own[group * per + i, i] = 0.0
    rank = 1.0 + (sg * own).sum(0)  # [per]
    within = torch.sigmoid(kv[None, :] - rank[:, None])  # tau2 = 1
    keep = torch.ones(per, 1, dtype=preds.dtype)
    keep[q % per] = 0.0
    recall = torch.minimum((within * keep).sum(0), kv)
    loss = loss + (1.0 - (recall / norm).sum() / len(k_vals)) / n
  return loss


def test_value_and_gradient_equal_the_float64_reference_dense_and_tiled():
  x, labels = batch(), jnp.asarray(LABELS)
  rng = np.random.default_rng(5)
  pm, nm = rng.random((B, B)) < 0.7, rng.random((B, B)) < 0.6

  @functools.partial(jax.jit, static_argnums=(2,))
  def vg(x, hyper, block, masks):
    return jax.value_and_grad(lambda x: losses.recall_at_k_loss(
        x, labels, tau1=hyper[0], tau2=hyper[1], block_size=block,
        pos_mask=masks[0], neg_mask=masks[1]))(x)

  everything = (jnp.ones((B, B), bool),) * 2
  for tau1, tau2, masks in ((0.1, 1.0, None), (0.05, 0.5, (pm, nm))):
    want, want_grad = reference(x, LABELS, tau1, tau2, pos_mask=masks and pm,
                                neg_mask=masks and nm)
    assert 0 < want < 1
    args = (jnp.asarray(x), jnp.asarray([tau1, tau2], jnp.float32))
    given = everything if masks is None else tuple(map(jnp.asarray, masks))
    for block in (5, None):
      value, grad = vg(*args, block, given)
      np.testing.assert_allclose(float(value), want, rtol=2e-5)
      np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-3,
                                 atol=1e-4 * np.abs(want_grad).max())


def test_the_official_rank_and_what_the_paper_ranks():
  # Four classes of three, contiguous: the official layout. With
  # rank_counts_query the value and gradient are the official code's; the
  # paper's rank (our default) leaves the query out and differs.
  y = np.repeat(np.arange(4), 3)
  x = batch(seed=3)
  xt = torch.tensor(x.astype(np.float64), requires_grad=True)
  want = official_loss(xt / xt.norm(dim=1, keepdim=True), 4, K, 0.01)
  want.backward()
  f = jax.jit(jax.value_and_grad(lambda x, counts: losses.recall_at_k_loss(
      x, jnp.asarray(y), rank_counts_query=counts), argnums=0),
      static_argnums=1)
  value, grad = f(jnp.asarray(x), True)
  np.testing.assert_allclose(float(value), want.item(), rtol=2e-5)
  g = xt.grad.numpy()
  np.testing.assert_allclose(np.asarray(grad), g, rtol=2e-3,
                             atol=1e-4 * np.abs(g).max())
  assert np.isclose(reference(x, y, 0.01, 1.0, counts_query=True)[0],
                    want.item())
  paper = float(f(jnp.asarray(x), False)[0])
  np.testing.assert_allclose(paper, reference(x, y, 0.01, 1.0)[0], rtol=2e-5)
  assert not np.isclose(paper, want.item(), rtol=1e-3)


def official_pos_mixup(z, num_id, pairs, alphas):
  """``pos_mixup`` (src/mixup.py) for 4 samples per class: each class's 4
  real samples, then its 6 virtual ones, ``alpha`` given per pair."""
  out = []
  per = z.shape[0] // num_id
  for c in range(num_id):
    out += [z[c * per + i] for i in range(per)]
    for (a, b), alpha in zip(pairs[c], alphas[c]):
      out.append(alpha * z[a] + (1.0 - alpha) * z[b])
  return torch.stack(out)


def test_simix_is_the_official_mixup_and_loss():
  # Three classes of four, shuffled: SiMix mixes the 6 pairs of each class
  # (18 virtual samples, none invalid) and the loss with the official rank
  # is the official loss of the official mixed batch (10 per class), its
  # gradient reaching the real embeddings through the mixtures.
  rng = np.random.default_rng(7)
  perm = rng.permutation(12)
  y = np.repeat(np.arange(3), 4)[perm]
  x = batch(seed=8)
  key = jax.random.PRNGKey(3)
  (value, grad), (a, b, ok), alphas = jax.jit(lambda x, y: (
      jax.value_and_grad(lambda x: losses.recall_at_k_loss(
          x, y, simix=True, key=key, samples_per_class=4,
          rank_counts_query=True, block_size=7))(x),
      losses.simix_pairs(y, samples_per_class=4),
      jax.random.uniform(key, (18, 1))))(jnp.asarray(x), y)
  a, b, ok = map(np.asarray, (a, b, ok))
  assert np.all(ok) and len(a) == 18
  alphas = np.asarray(alphas).astype(np.float64)
  found = {c: [] for c in range(3)}
  weights = {c: [] for c in range(3)}
  # The official layout wants class c's samples at rows 4c .. 4c + 3.
  rows = np.concatenate([np.flatnonzero(y == c) for c in range(3)])
  where = np.argsort(rows)
  for ai, bi, al in zip(a, b, alphas[:, 0]):
    assert y[ai] == y[bi] and ai != bi
    found[y[ai]].append((where[ai], where[bi]))
    weights[y[ai]].append(al)
  assert all(len(set(map(frozenset, v))) == 6 for v in found.values())
  xt = torch.tensor(x.astype(np.float64), requires_grad=True)
  z = (xt / xt.norm(dim=1, keepdim=True))[torch.tensor(rows)]
  mixed = official_pos_mixup(z, 3, found, weights)
  want = official_loss(mixed, 3, K, 0.01, bs=12)
  want.backward()
  np.testing.assert_allclose(float(value), want.item(), rtol=2e-5)
  g = xt.grad.numpy()
  np.testing.assert_allclose(np.asarray(grad), g, rtol=2e-3,
                             atol=1e-4 * np.abs(g).max())


def test_simix_pairs_with_uneven_classes_and_its_batch():
  # Classes of 3, 1, 2 and 4 (m = 4): 3 + 0 + 1 + 6 = 10 pairs in 12 slots.
  y = np.array([5, 1, 5, 7, 9, 9, 5, 9, 9, 7], np.int32)
  x = jnp.asarray(batch(n=10))
  z, labels, valid, a, b, ok = map(np.asarray, jax.jit(lambda x, y: (
      losses.simix(jax.random.PRNGKey(0), x, y)
      + losses.simix_pairs(y, samples_per_class=4)))(x, y))
  assert len(a) == 15 and ok.sum() == 10
  pairs = {frozenset((i, j)) for i, j, o in zip(a, b, ok) if o}
  want = {frozenset((i, j)) for i in range(10) for j in range(i + 1, 10)
          if y[i] == y[j]}
  assert pairs == want
  assert z.shape == (25, D) and np.all(labels[10:][ok] == y[a][ok])
  norms = np.linalg.norm(z, axis=1)
  np.testing.assert_allclose(norms[:10], 1.0, rtol=1e-6)
  assert np.all(norms[10:][ok] <= 1.0 + 1e-6)  # not re-normalised
  assert valid.tolist() == [True] * 10 + ok.tolist()


def test_check_grads_of_both_forms():
  x, labels = jnp.asarray(batch(seed=3)), jnp.asarray(LABELS)
  # The embeddings' and tau1's gradients (tau1 through the custom_vjp).
  f = jax.jit(lambda x, t: losses.recall_at_k_loss(x, labels, tau1=t,
                                                   tau2=0.7, block_size=4))
  check_grads(f, (x, jnp.float32(0.5)), order=1, modes=("rev",), eps=1e-3,
              atol=2e-3, rtol=2e-3)


def test_eight_devices_equal_the_global_batch_and_the_ring_is_refused():
  assert jax.device_count() == 8
  n = 16
  labels = jnp.asarray(np.random.default_rng(0).integers(0, 5, n), jnp.int32)
  x = jnp.asarray(batch(seed=6, n=n))
  pm = jnp.asarray(np.random.default_rng(8).random((n, n)) < 0.8)
  loss = functools.partial(losses.recall_at_k_loss, tau1=0.1, block_size=3)

  def local(x, labels, pm, **kw):
    return jax.value_and_grad(lambda x: loss(
        x, labels, pos_mask=pm, **kw))(x)

  specs = dict(mesh=mesh(), in_specs=(P("d"),) * 3, out_specs=(P(), P("d")))
  want, got = jax.jit(lambda *a: (local(*a), jax.shard_map(
      functools.partial(local, axis_name="d"), **specs)(*a)))(x, labels, pm)
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=2e-5)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]),
                             rtol=1e-4, atol=1e-6)
  ring = jax.shard_map(functools.partial(local, axis_name="d",
                                         collective="ring"), **specs)
  with pytest.raises(ValueError, match="RS@k loss has no device-ring form"):
    jax.eval_shape(ring, x, labels, pm)


def test_empty_positive_sets_give_zero_loss_and_zero_gradient():
  x = jnp.asarray(batch())
  f = jax.jit(jax.value_and_grad(
      lambda x, y, neg: losses.recall_at_k_loss(x, y, neg_mask=neg)))
  value, grad = f(x, jnp.arange(B, dtype=jnp.int32), jnp.ones((B, B), bool))
  assert float(value) == 0.0 and np.all(np.asarray(grad) == 0.0)
  # Anchor 9 (label 3) has no positive and is no one's negative: no
  # gradient of its own.
  alone = np.zeros(B, bool)
  alone[9] = True
  neg = jnp.asarray(~alone[None, :] | alone[:, None])
  _, grad = f(x, jnp.asarray(LABELS), neg)
  assert np.all(np.asarray(grad)[9] == 0.0) and np.abs(grad).max() > 0


@pytest.mark.parametrize("kw,match", [
    ({"k": ()}, "`k` must be a non-empty tuple of positive integers"),
    ({"k": (1, 0)}, "`k` must be a non-empty tuple"),
    ({"tau1": 1e-4}, "`tau1` of RS@k"),
    ({"tau2": 0.0}, "`tau2` of RS@k"),
    ({"simix": True}, "SiMix .* pass a PRNG `key`"),
    ({"simix": True, "key": jax.random.PRNGKey(0), "samples_per_class": 1},
     "`samples_per_class` must be an integer >= 2"),
    ({"simix": True, "key": jax.random.PRNGKey(0),
      "pos_mask": np.ones((B, B), bool)}, r"drop \['pos_mask'\]"),
    ({"block_size": 0}, "`block_size` must be >= 1"),
])
def test_bad_input_is_one_line(kw, match):
  with pytest.raises(ValueError, match=match) as err:
    losses.recall_at_k_loss(jnp.asarray(batch()), jnp.asarray(LABELS), **kw)
  assert "\n" not in str(err.value)


def test_the_registry_and_the_config_take_simix_with_the_step_key():
  from circle_jax import config as config_lib
  entry = losses.get_loss("recall_at_k")
  assert entry.needs_key and entry.supports_axis_name and entry.supports_ref
  assert entry.defaults["k"] == K and entry.defaults["simix"] is False
  c = config_lib.loss_config("recall_at_k", simix=True)
  assert c.simix is True and c.tau1 == 0.01 and c.tau2 == 1.0
  x, labels = jnp.asarray(batch()), jnp.asarray(LABELS)
  key = jax.random.PRNGKey(1)
  got, want = jax.jit(lambda x: (
      entry.apply(x, labels, key=key, simix=True, block_size=4),
      losses.recall_at_k_loss(x, labels, simix=True, key=key)))(x)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_reductions_of_the_anchor_terms():
  """``reduction``: ``"none"`` gives ``1 - RS@k_i`` per anchor (0 without a
  positive: anchor 9 is alone), which equal the reference loss of each
  anchor alone; ``"sum"`` and ``"mean"`` reduce those terms, dense and
  tiled alike."""
  from circle_jax.losses import engine
  x = batch(4)
  terms = losses.recall_at_k_loss(jnp.asarray(x), jnp.asarray(LABELS),
                                  tau1=0.1, reduction="none")
  assert terms.shape == (B,) and float(terms[9]) == 0.0
  for i in (0, 3, 5):
    keep = np.zeros((B, B), bool)
    keep[i] = True  # only anchor i has positives left
    want, _ = reference(x, LABELS, 0.1, 1.0, pos_mask=keep)
    np.testing.assert_allclose(float(terms[i]), want, rtol=1e-5)
  total = losses.recall_at_k_loss(jnp.asarray(x), jnp.asarray(LABELS),
                                  tau1=0.1, block_size=4,
                                  reduction=engine.Reduction("sum"))
  np.testing.assert_allclose(float(total), float(jnp.sum(terms)), rtol=1e-5)
  mean = losses.recall_at_k_loss(jnp.asarray(x), jnp.asarray(LABELS),
                                 tau1=0.1, reduction="mean")
  plain = losses.recall_at_k_loss(jnp.asarray(x), jnp.asarray(LABELS),
                                  tau1=0.1)
  np.testing.assert_allclose(float(mean), float(plain), rtol=1e-6)


def _rs_loops(s, y, col_y, tau1, tau2, k=K, self_pairs=False):
  """The paper's RS@k loss from a float64 similarity table ``s`` [M, N]
  (anchors x candidate columns), with loops: positives are the columns of
  the anchor's label (not the anchor itself when ``self_pairs``), every other
  column a negative; each k capped at the number of columns."""
  terms = []
  for i in range(len(y)):
    cols = [j for j in range(len(col_y)) if not (self_pairs and j == i)]
    pos = [j for j in cols if col_y[j] == y[i]]
    if not pos:
      continue
    rs = 0.0
    for kk in (min(v, len(col_y)) for v in k):
      count = 0.0
      for p in pos:
        rank = 1 + sum(1 / (1 + np.exp(-(s[i, c] - s[i, p]) / tau1))
                       for c in cols if c != p)
        count += 1 / (1 + np.exp(-(kk - rank) / tau2))
      rs += min(count, kk) / min(kk, len(pos))
    terms.append(1 - rs / len(k))
  return float(np.mean(terms))


def test_references_and_the_poincare_ball():
  """A memory as the candidate columns (the cross-batch memory), and the
  Poincare ball's similarities (the geometry's) in the same formula."""
  x = batch(6).astype(np.float64)
  rng = np.random.default_rng(7)
  mem = rng.normal(size=(9, D))
  mem_y = np.array([0, 1, 2, 4, 4, 0, 1, 2, 5], np.int32)
  got = losses.recall_at_k_loss(
      jnp.asarray(x, jnp.float32), jnp.asarray(LABELS), tau1=0.1,
      ref=losses.Candidates(jnp.asarray(mem, jnp.float32), mem_y))
  unit = lambda a: a / np.linalg.norm(a, axis=1, keepdims=True)
  np.testing.assert_allclose(
      float(got), _rs_loops(unit(x) @ unit(mem).T, LABELS, mem_y, 0.1, 1.0),
      rtol=2e-5)
  ball = losses.engine.resolve_geometry("poincare")
  z = ball.embed(jnp.asarray(x, jnp.float32))
  s = np.asarray(ball.tile(z, z), np.float64)
  got = losses.recall_at_k_loss(jnp.asarray(x, jnp.float32),
                                jnp.asarray(LABELS), tau1=0.5,
                                geometry="poincare")
  np.testing.assert_allclose(
      float(got), _rs_loops(s, LABELS, LABELS, 0.5, 1.0, self_pairs=True),
      rtol=1e-4)
