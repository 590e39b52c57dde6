"""HIER (circle_jax.losses.hier): a float64 torch transcription of the
official ``HIERLoss`` (its hyptorch maps and distance, ``compute_gHHC`` with
the Gumbel noise given), a loop-written numpy reference of the whole
regulariser (mutual neighbours, triplets, both levels), check_grads, the
8-device global batch, empty sets and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from jax.sharding import PartitionSpec as P

from circle_jax import config as config_lib
from circle_jax import config_facts
from circle_jax import losses
from circle_jax.losses import hier
from tests.grad_check import check_grads
from tests.losses import engine_checks

C, R = 0.1, 2.3


# ---------------------------------------------------------------------------
# The official code, transcribed (hier/losses.py, hier/hyptorch/pmath.py and
# nn.py of github.com/tjddus9597/HIER-CVPR23), float64, noise given.
# ---------------------------------------------------------------------------


def _t_artanh(x):
  x = x.clamp(-1 + 1e-5, 1 - 1e-5)
  return 0.5 * (torch.log(1 + x) - torch.log(1 - x))


class _TRiemannian(torch.autograd.Function):
  @staticmethod
  def forward(ctx, x):
    ctx.save_for_backward(x)
    return x

  @staticmethod
  def backward(ctx, g):
    (x,) = ctx.saved_tensors
    return g * (1 - C * x.pow(2).sum(-1, keepdim=True)).pow(2) / 4


def _t_to_poincare(x):
  """``ToPoincare(c, riemannian=True, clip_r)``: clip, expmap0, project."""
  norm = torch.norm(x, dim=-1, keepdim=True) + 1e-5
  x = x * torch.minimum(torch.ones_like(norm), R / norm)
  sc = C ** 0.5
  un = torch.clamp_min(x.norm(dim=-1, p=2, keepdim=True), 1e-5)
  z = torch.tanh(torch.clamp(sc * un, -15, 15)) * x / (sc * un)
  zn = torch.clamp_min(z.norm(dim=-1, keepdim=True, p=2), 1e-5)
  maxnorm = (1 - 1e-3) / sc
  z = torch.where(zn > maxnorm, z / zn * maxnorm, z)
  return _TRiemannian.apply(z)


def _t_dist_matrix(x, y):
  xy = x @ y.T
  x2 = x.pow(2).sum(-1, keepdim=True)
  y2 = y.pow(2).sum(-1, keepdim=True)
  num = (1 + 2 * C * xy + C * y2.T).unsqueeze(2) * (-x).unsqueeze(1)
  # _mobius_addition_batch(-x, y): x -> -x in every term.
  xy = -xy
  num = (1 + 2 * C * xy + C * y2.T).unsqueeze(2) * (-x).unsqueeze(1)
  num = num + (1 - C * x2).unsqueeze(2) * y
  denom = 1 + 2 * C * xy + C ** 2 * x2 * y2.T
  res = num / (denom.unsqueeze(2) + 1e-5)
  return 2 / C ** 0.5 * _t_artanh(C ** 0.5 * torch.norm(res, dim=-1))


def _t_gumbel_hard(logits, g):
  soft = torch.softmax(logits + g, dim=1)
  hard = torch.zeros_like(soft).scatter_(1, soft.argmax(1, keepdim=True), 1)
  return hard - soft.detach() + soft


def _t_gHHC(cp_dist, i, j, k, g, mrg=0.1, tau=0.1):
  m_ij = torch.maximum(cp_dist[i], cp_dist[j])
  p_ij = _t_gumbel_hard(-m_ij / tau, g[0])
  m_ijk = torch.maximum(cp_dist[k], m_ij)
  p_ijk = _t_gumbel_hard(-m_ijk / tau, g[1])
  at = lambda d, p: (d * p).sum(1)  # noqa: E731
  hc = (torch.relu(at(cp_dist[i], p_ij) - at(cp_dist[i], p_ijk) + mrg)
        + torch.relu(at(cp_dist[j], p_ij) - at(cp_dist[j], p_ijk) + mrg)
        + torch.relu(at(cp_dist[k], p_ijk) - at(cp_dist[k], p_ij) + mrg))
  return (hc * (p_ij.argmax(-1) != p_ijk.argmax(-1)).double()).mean()


def test_triplet_loss_matches_the_official_code_value_and_gradient():
  rng = np.random.default_rng(0)
  b, m, d, t = 6, 5, 4, 12
  feats = rng.normal(size=(b, d)) * 2.0
  raw = rng.normal(size=(m, d)) / np.sqrt(d) * R * 0.9
  i, j, k = (rng.integers(0, b, t) for _ in range(3))
  g = rng.gumbel(size=(2, t, m))
  # The official: the samples on the ball (its model's ToPoincare), the
  # proxies through to_hyperbolic, distances by hyptorch's dist_matrix.
  tz = torch.tensor(feats, requires_grad=True)
  tp = torch.tensor(raw, requires_grad=True)
  z_ball, p_ball = _t_to_poincare(tz), _t_to_poincare(tp)
  want = _t_gHHC(_t_dist_matrix(z_ball, p_ball), i, j, k,
                 torch.tensor(g))
  want.backward()

  ball = losses.Poincare(c=C, r=R)

  def ours(x, p):
    z = ball.embed(x)
    q = hier.riemannian_gradient(ball.embed(p), c=C)
    return hier.hier_triplet_loss(ball.distance(z, q), i, j, k,
                                  gumbel=jnp.asarray(g, jnp.float32))

  got, (gx, gp) = jax.jit(jax.value_and_grad(ours, (0, 1)))(
      jnp.asarray(feats, jnp.float32), jnp.asarray(raw, jnp.float32))
  assert want.item() > 0.05  # some triplets count
  np.testing.assert_allclose(float(got), want.item(), rtol=1e-4)
  # The samples' gradient differs by the code's RiemannianGradient on the
  # model's output, which we leave out (module docstring): divide it out.
  zb = z_ball.detach().numpy()
  scale = (1 - C * np.sum(zb * zb, -1, keepdims=True)) ** 2 / 4
  want_gx = tz.grad.numpy()
  np.testing.assert_allclose(np.asarray(gx) * scale, want_gx, atol=1e-4)
  np.testing.assert_allclose(np.asarray(gp), tp.grad.numpy(), atol=1e-4)


# ---------------------------------------------------------------------------
# The whole regulariser, loop-written (key=None: no noise; each anchor's
# first T positives and negatives, cyclically).
# ---------------------------------------------------------------------------


def _np_dist(x, y):
  out = np.zeros((len(x), len(y)))
  for a in range(len(x)):
    for b in range(len(y)):
      u = 2 * C * np.sum((x[a] - y[b]) ** 2) / (
          (1 - C * x[a] @ x[a]) * (1 - C * y[b] @ y[b]))
      out[a, b] = np.arccosh(1 + u) / np.sqrt(C)
  return out


def _np_embed(x):
  out = []
  for v in x:
    n = np.linalg.norm(v)
    v = v * min(1.0, R / n)
    n = np.linalg.norm(v)
    out.append(np.tanh(np.sqrt(C) * n) * v / (np.sqrt(C) * n))
  return np.array(out)


def _np_level(dist_pts, sim, topk, t, delta=0.1, tau=0.1, extra_pos=None):
  n = len(sim)
  top = [set(np.argsort(-sim[a], kind="stable")[:topk]) for a in range(n)]
  total, count = 0.0, 0
  for a in range(n):
    pos = [b for b in range(n) if b != a and b in top[a] and a in top[b]]
    neg = [b for b in range(n) if b != a and b not in pos]
    if len(pos) < 2 or not neg:
      continue
    for s in range(t):
      i, j, k = a, pos[s % len(pos)], neg[s % len(neg)]
      m_ij = np.maximum(dist_pts[i], dist_pts[j])
      m_ijk = np.maximum(m_ij, dist_pts[k])
      r_ij, r_ijk = np.argmin(m_ij), np.argmin(m_ijk)
      count += 1
      if r_ij == r_ijk:
        continue
      total += (max(dist_pts[i, r_ij] - dist_pts[i, r_ijk] + delta, 0)
                + max(dist_pts[j, r_ij] - dist_pts[j, r_ijk] + delta, 0)
                + max(dist_pts[k, r_ijk] - dist_pts[k, r_ij] + delta, 0))
  return total / max(count, 1)


def _np_hier(x, y, raw, topk, t):
  z, p = _np_embed(x), _np_embed(raw)
  dzz = _np_dist(z, z)
  sim = np.exp(-dzz) + (y[:, None] == y[None, :])
  data = _np_level(_np_dist(z, p), sim, topk, t)
  dpp = _np_dist(p, p)
  return data + _np_level(dpp, np.exp(-dpp), topk, t)


def _partials(f, x, entries, eps=1e-5):
  """Central differences of ``f`` at the given entries of ``x``."""
  x = np.asarray(x, np.float64)
  out = []
  for idx in entries:
    d = np.zeros_like(x)
    d[idx] = eps
    out.append((f(x + d) - f(x - d)) / (2 * eps))
  return np.array(out)


def _batch(b=8, d=4, m=6, seed=1):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(b, d)).astype(np.float32) * 2
  y = np.repeat(np.arange(b // 4), 4)  # each anchor has mutual neighbours
  raw = (rng.normal(size=(m, d)) / np.sqrt(d) * R * 0.9).astype(np.float32)
  return x, y, raw


def test_the_regulariser_matches_a_loop_reference_and_its_gradient():
  x, y, raw = _batch()
  x64, raw64 = x.astype(np.float64), raw.astype(np.float64)
  kw = dict(num_proxies=6, topk=4, triplets_per_anchor=3)
  fn = jax.jit(jax.value_and_grad(lambda x, p, tau, riem: losses.hier_loss(
      x, y, p, tau=tau, riemannian=riem, **kw), (0, 1)),
               static_argnums=(3,))
  got, _ = fn(x, raw, 0.1, True)
  want = _np_hier(x64, y, raw64, 4, 3)
  assert want > 0.01
  np.testing.assert_allclose(float(got), want, rtol=2e-4)
  # The gradient against central differences of the reference, at a small
  # temperature: there the straight-through softmax is saturated and adds
  # nothing, so the gradient is the hard choice's (the proxies' without the
  # Riemannian scale, which changes only the gradient).
  _, (gx, gp) = fn(x, raw, 1e-3, False)
  _, (_, gp_riem) = fn(x, raw, 1e-3, True)
  cells = [(0, 0), (1, 2), (2, 1), (3, 3), (5, 0), (7, 2)]
  np.testing.assert_allclose(
      np.asarray(gx)[tuple(zip(*cells))],
      _partials(lambda v: _np_hier(v, y, raw64, 4, 3), x64, cells), atol=2e-3)
  cells = [(0, 0), (1, 1), (2, 2), (4, 3), (5, 1)]
  np.testing.assert_allclose(
      np.asarray(gp)[tuple(zip(*cells))],
      _partials(lambda v: _np_hier(x64, y, v, 4, 3), raw64, cells), atol=2e-3)
  assert np.abs(np.asarray(gp)).max() > 0.01
  assert not np.allclose(np.asarray(gp), np.asarray(gp_riem))


def test_check_grads_of_the_triplet_loss():
  rng = np.random.default_rng(2)
  dist = jnp.asarray(rng.uniform(0.5, 3.0, (5, 4)))
  i, j, k = (jnp.asarray(rng.integers(0, 5, 6)) for _ in range(3))
  g = jnp.asarray(rng.gumbel(size=(2, 6, 4)))
  check_grads(
      lambda d: hier.hier_triplet_loss(d, i, j, k, gumbel=g),
      (dist,),
      order=1, modes=("rev",), eps=1e-3, atol=1e-2, rtol=1e-2)


def _autodiff_triplet_loss(dist, i, j, k, g, w, delta=0.1, tau=0.1):
  """The straight-through form, differentiated by jax: one-hot plus softmax
  minus its stopped value, ``<d, p>`` as sums over the proxies."""
  def choice(m, noise):
    z = -m / tau + noise
    soft = jax.nn.softmax(z, -1)
    hard = jax.nn.one_hot(jnp.argmax(z, -1), z.shape[-1])
    return hard + soft - jax.lax.stop_gradient(soft)

  d_i, d_j, d_k = dist[i], dist[j], dist[k]
  m_ij = jnp.maximum(d_i, d_j)
  p_ij = choice(m_ij, g[0])
  p_ijk = choice(jnp.maximum(d_k, m_ij), g[1])
  at = lambda d, p: jnp.sum(d * p, -1)  # noqa: E731
  per = (jax.nn.relu(at(d_i, p_ij) - at(d_i, p_ijk) + delta)
         + jax.nn.relu(at(d_j, p_ij) - at(d_j, p_ijk) + delta)
         + jax.nn.relu(at(d_k, p_ijk) - at(d_k, p_ij) + delta))
  differ = jnp.argmax(p_ij, -1) != jnp.argmax(p_ijk, -1)
  return jnp.sum(jnp.where(differ & (w > 0), w * per, 0.0)) / jnp.sum(w)


@pytest.mark.parametrize("noise", [True, False])
def test_written_out_gradient_equals_autodiff_of_the_straight_through_form(
    noise):
  """hier_triplet_loss's hand-written backward pass against jax's autodiff
  of the one-hot + softmax - stop(softmax) form, with ties in both maxima
  (equal rows, a negative equal to the anchor), repeated rows and zero
  weights."""
  rng = np.random.default_rng(5)
  n, m, t = 12, 9, 80
  dist = rng.uniform(0.5, 3.0, (n, m))
  dist[4] = dist[7]  # max(d_i, d_j) ties where (i, j) = (4, 7)
  dist = jnp.asarray(dist, jnp.float32)
  i, j, k = (rng.integers(0, n, t) for _ in range(3))
  i[:6], j[:6], k[6:9] = 4, 7, i[6:9]  # ties in m_ij and in max(d_k, m_ij)
  g = (rng.gumbel(size=(2, t, m)) if noise else np.zeros((2, t, m)))
  g = jnp.asarray(g, jnp.float32)
  w = rng.uniform(0.2, 2.0, t) * (rng.uniform(size=t) > 0.25)
  w = jnp.asarray(w, jnp.float32)
  i, j, k = (jnp.asarray(a) for a in (i, j, k))
  want, want_g = jax.value_and_grad(_autodiff_triplet_loss)(
      dist, i, j, k, g, w)
  got, got_g = jax.jit(jax.value_and_grad(
      lambda d: hier.hier_triplet_loss(d, i, j, k, weights=w,
                                       gumbel=g if noise else None)))(dist)
  assert float(want) > 0.05
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  assert np.abs(np.asarray(want_g)).max() > 0.01
  np.testing.assert_allclose(np.asarray(got_g), np.asarray(want_g),
                             rtol=1e-5, atol=1e-6)


def test_gumbel_noise_is_jax_gumbel_of_the_unpartitioned_stream():
  """Bitwise ``jax.random.gumbel`` with ``jax_threefry_partitionable`` off,
  for raw and typed keys, odd and even sizes, under vmap; and Gumbel
  distributed (mean Euler's gamma, variance pi^2 / 6, a KS test)."""
  keys = jax.random.split(jax.random.PRNGKey(7), 4)
  shapes = [(2, 3, 5), (7,), (2, 50, 64)]
  with jax.threefry_partitionable(False):
    want = [np.asarray(jax.jit(jax.vmap(
        lambda k, s=s: jax.random.gumbel(k, s)))(keys)) for s in shapes]
  for s, w in zip(shapes, want):
    got = jax.jit(jax.vmap(lambda k, s=s: hier.gumbel_noise(k, s)))(keys)
    np.testing.assert_array_equal(np.asarray(got), w)
  typed = jax.random.key(3)
  with jax.threefry_partitionable(False):
    want = np.asarray(jax.random.gumbel(typed, (9,)))
  np.testing.assert_array_equal(np.asarray(hier.gumbel_noise(typed, (9,))),
                                want)
  g = np.asarray(hier.gumbel_noise(jax.random.PRNGKey(0), (200_000,)),
                 np.float64)
  # Standard errors: 1.28 / sqrt(n) = 0.003 for the mean.
  assert abs(g.mean() - np.euler_gamma) < 0.015
  assert abs(g.var() - np.pi ** 2 / 6) < 0.05
  assert stats.kstest(g, "gumbel_r").pvalue > 1e-3


def test_triplet_draws_are_uniform_over_the_mask_members():
  """The positives and negatives of a triplet are drawn uniformly with
  replacement from the anchor's set, and never outside it."""
  mask = np.zeros(512, bool)
  mask[[0, 3, 4, 200, 511]] = True
  draws = np.asarray(jax.jit(hier.draw_members, static_argnums=2)(
      jax.random.PRNGKey(0), jnp.asarray(mask), 50_000))
  assert draws.dtype == np.int32 and set(draws) == {0, 3, 4, 200, 511}
  counts = np.bincount(draws, minlength=512)[mask]
  # 10,000 expected per member; binomial std 89: 5 sigma is 450.
  assert np.abs(counts - 10_000).max() < 450, counts
  # A single member, a full mask, and none (all N - 1; weight 0 upstream).
  one = np.zeros(7, bool)
  one[2] = True
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  got = jax.vmap(hier.draw_members, (0, 0, None))(
      keys, jnp.asarray(np.stack([one, np.ones(7, bool), np.zeros(7, bool)])),
      4000)
  assert set(np.asarray(got[0])) == {2}
  assert np.abs(np.bincount(np.asarray(got[1]), minlength=7) - 4000 / 7
                ).max() < 5 * np.sqrt(4000 / 7)
  assert set(np.asarray(got[2])) == {6}


@pytest.mark.slow  # CI, not the fast tier (CONTRIBUTING.md)
def test_global_batch_on_8_devices_equals_one_device():
  x, y, raw = _batch(b=16, seed=3)
  key = jax.random.PRNGKey(5)
  kw = dict(num_proxies=6, topk=4, triplets_per_anchor=3, key=key)

  def run(x, y, raw, axis_name=None):
    return jax.value_and_grad(lambda x, p: losses.hier_loss(
        x, y, p, axis_name=axis_name, **kw), (0, 1))(x, raw)

  v1, (gx1, gp1) = jax.jit(run)(x, y, raw)
  v8, (gx8, gp8) = jax.jit(jax.shard_map(
      lambda x, y, p: run(x, y, p, axis_name="d"), mesh=engine_checks.mesh(),
      in_specs=(P("d"), P("d"), P()),
      out_specs=(P(), (P("d"), P()))))(x, y, raw)
  assert float(v1) > 0
  np.testing.assert_allclose(float(v8), float(v1), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(gx8), np.asarray(gx1), atol=1e-6)
  np.testing.assert_allclose(np.asarray(gp8), np.asarray(gp1), atol=1e-6)


def test_empty_sets_give_zero_loss_and_gradient_and_masks_replace_them():
  x, y, raw = _batch()
  b = len(x)
  fn = jax.jit(jax.value_and_grad(lambda x, pos, neg: losses.hier_loss(
      x, y, raw, pos_mask=pos, neg_mask=neg, num_proxies=6, topk=4,
      triplets_per_anchor=3)))
  none = np.zeros((b, b), bool)
  # No positives (or no negatives): the samples' term is 0 with a zero
  # gradient; the proxies' term alone remains.
  v_none, gx = fn(x, none, ~none)
  np.testing.assert_array_equal(np.asarray(gx), 0.0)
  v_noneg, gx = fn(x, ~none, none)
  np.testing.assert_array_equal(np.asarray(gx), 0.0)
  # Masks equal to the mutual neighbours give the mined loss, as the loop
  # reference computes it.
  z = np.asarray(losses.Poincare(c=C, r=R).embed(x))
  sim = np.exp(-_np_dist(z, z)) + (y[:, None] == y[None, :])
  mutual = np.asarray(hier.mutual_neighbours(jnp.asarray(sim), 4))
  v, gx = fn(x, mutual, ~mutual)
  want = _np_hier(x.astype(np.float64), y, raw.astype(np.float64), 4, 3)
  np.testing.assert_allclose(float(v), want, rtol=2e-4)
  assert float(v_none) == float(v_noneg) < float(v)
  assert np.abs(np.asarray(gx)).max() > 0


def test_bad_input_and_registry_and_head():
  x, y, raw = _batch()
  with pytest.raises(ValueError, match="num_proxies"):
    losses.hier_loss(x, y, raw)  # 6 rows, 512 expected
  with pytest.raises(ValueError, match="topk"):
    losses.hier_loss(x, y, raw, num_proxies=6, topk=0)
  with pytest.raises(ValueError, match="tau"):
    losses.hier_loss(x, y, raw, num_proxies=6, tau=0.0)
  with pytest.raises(ValueError, match="proxies"):
    losses.hier_loss(x, y, raw[:, :3], num_proxies=6)
  entry = losses.get_loss("hier")
  p = entry.init_params(jax.random.PRNGKey(0), 10, 384)
  assert p.shape == (512, 384) and entry.needs_key and entry.raw_features
  # The code's init: N(0, 1) / sqrt(D) * r * 0.9, row norms about 0.9 r.
  assert np.mean(np.linalg.norm(np.asarray(p), axis=1)) == pytest.approx(
      0.9 * R, rel=0.02)
  # With HIER among a config's losses the head hands raw features.
  c = config_lib.base_config().unlock()
  c.loss = config_lib.loss_config("proxy_anchor")
  assert config_facts.head_normalizes(c)
  c.more_losses.hier = config_lib.more_loss("hier", weight=0.5)
  assert not config_facts.head_normalizes(c)
