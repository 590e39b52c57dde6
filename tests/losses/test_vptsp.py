"""Tests of VPTSP-G's loss (losses/vptsp.py) with its GRU mix
(models/semantic_proxies.py): against a float64 torch transcription of the
official code, a naive float64 Proxy-Anchor, check_grads, 8 devices, empty
sets and bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from tests.grad_check import check_grads

from circle_jax.losses import vptsp
from circle_jax.models import semantic_proxies as sp
from tests.losses import reference as ref

C, E, K = 5, 4, 2
LABELS = np.array([3, 3, 0, 0, 4, 4])  # runs of K samples, classes 3, 0, 4


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  return dict(
      x=rng.normal(size=(6, E)), feats=_unit(rng.normal(size=(6, E))),
      memory=_unit(rng.normal(size=(C, E))),
      bias=rng.normal(size=(C, E)) / 8,
      w={g: tuple(rng.normal(size=s) * 0.5 for s in ((E, E), (E, E), (E,)))
         for g in "rzn"})


def _official(torch, x, feats, memory, bias, w, labels, rho, scale_pos):
  """The official code in float64: ``Simple_GRUCell`` ('gru_relu'),
  ``_semantic_mix_with_container`` ('gru'), ``_proxies_generator``'s
  ``p_all`` and ``Criterion.forward`` (``both_all``, anchor mode), with the
  positive mean optionally rescaled by ``scale_pos``."""
  f = torch.nn.functional
  u = torch.unique_consecutive(labels)
  p = feats.view(len(u), K, -1)
  h = memory[u]
  for i in range(K):
    xi = p[:, i, :]
    z = torch.sigmoid(xi @ w["z"][0] + h @ w["z"][1] + w["z"][2])
    r = torch.sigmoid(xi @ w["r"][0] + h @ w["r"][1] + w["r"][2])
    n = f.relu(xi @ w["n"][0] + r * (h @ w["n"][1]) + w["n"][2])
    h = (1 - z) * n + z * h
  container = memory.clone()
  container[u] = h
  container = f.normalize(container, dim=-1)
  p_all = f.normalize(bias * rho + container * (1 - rho), dim=1)
  batch = f.normalize(x, dim=1)
  sims = batch.mm(p_all.T)
  same = torch.arange(C).unsqueeze(1) == labels.unsqueeze(1).T

  def masked_lse(s, mask):
    s = s.masked_fill(~mask.T, torch.finfo(s.dtype).min)
    s = torch.cat([s, torch.zeros(1, C, dtype=s.dtype)], dim=0)
    out = torch.logsumexp(s, dim=0, keepdim=True)
    return out.masked_fill(~torch.any(mask.T, dim=0, keepdim=True), 0)

  pos = masked_lse(-32 * (sims - 0.1), same)
  neg = masked_lse(32 * (sims + 0.1), ~same)
  return pos.mean() * scale_pos + neg.mean()


def _ours(x, feats, memory, bias, w, labels, rho=0.5, **kw):
  h, _ = sp.gru_mix(feats, labels, memory, w, k=K)
  return vptsp.vptsp_proxy_anchor_loss(x, labels, bias, h,
                                       proxy_bias_ratio=rho, **kw)


def test_matches_a_float64_transcription_of_the_official_code():
  """Value and gradient (embeddings, learned proxies, proxy features, GRU
  weights). The code averages the positive terms over all C proxies; ours
  (Proxy-Anchor's paper) over the 3 with positives: the code's positive
  term scaled by C / |P+| is ours."""
  torch = pytest.importorskip("torch")
  a = _inputs()
  t = jax.tree.map(lambda v: torch.tensor(v, requires_grad=True), a)
  labels = torch.tensor(LABELS)
  f32 = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), a)
  value_and_grad = jax.jit(jax.value_and_grad(
      lambda p, rho: _ours(p["x"], p["feats"], p["memory"], p["bias"],
                           p["w"], jnp.asarray(LABELS), rho)))
  for rho in (0.5, 0.2):
    for tensor in jax.tree.leaves(t):
      tensor.grad = None
    loss = _official(torch, t["x"], t["feats"], t["memory"], t["bias"],
                     t["w"], labels, rho, C / 3)
    loss.backward()
    v, g = value_and_grad(f32, rho)
    np.testing.assert_allclose(float(v), loss.item(), rtol=2e-5)
    for name in ("x", "feats", "bias", "w"):
      for ours, theirs in zip(jax.tree.leaves(g[name]),
                              jax.tree.leaves(t[name])):
        np.testing.assert_allclose(np.asarray(ours), theirs.grad.numpy(),
                                   atol=2e-5, err_msg=name)
    assert np.all(np.asarray(g["memory"]) == 0)  # carried, not trained
  unscaled = _official(torch, *[t[k] for k in ("x", "feats", "memory", "bias",
                                               "w")], labels, 0.5, 1.0)
  assert abs(unscaled.item() - float(value_and_grad(f32, 0.5)[0])) > 1e-3


def test_naive_float64_reference_check_grads_and_rho_one_is_proxy_anchor():
  a = _inputs(1)
  rho = 0.3
  h, classes = jax.jit(sp.gru_mix, static_argnames="k")(
      a["feats"], jnp.asarray(LABELS), a["memory"], a["w"], k=K)
  assert list(np.asarray(classes)) == [3, 0, 4]
  # Rows of classes outside the batch keep their (unit) memory.
  np.testing.assert_allclose(np.asarray(h)[[1, 2]], a["memory"][[1, 2]],
                             atol=1e-6)
  h = np.asarray(h, np.float64)
  q = np.stack([_unit(rho * a["bias"][c] + (1 - rho) * h[c])
                for c in range(C)])
  want, _ = ref.pa_reference(ref.cos(a["x"], q), LABELS, margin=0.1,
                             alpha=32.0)
  loss = jax.jit(lambda x, b, s, rho, alpha: vptsp.vptsp_proxy_anchor_loss(
      x, LABELS, b, s, proxy_bias_ratio=rho, alpha=alpha))
  args = [jnp.asarray(a[k], jnp.float32) for k in ("x", "bias")] + [
      jnp.asarray(h, jnp.float32)]
  np.testing.assert_allclose(float(loss(*args, rho, 32.0)), want, rtol=1e-5)
  q1 = _unit(a["bias"])  # rho = 1: plain Proxy-Anchor on the proxies
  want1, _ = ref.pa_reference(ref.cos(a["x"], q1), LABELS, margin=0.1,
                              alpha=32.0)
  np.testing.assert_allclose(float(loss(*args, 1.0, 32.0)), want1, rtol=1e-5)
  # No semantic proxies (the registry entry called without the trainer's
  # hook): plain Proxy-Anchor on the proxies, as rho = 1.
  np.testing.assert_allclose(float(vptsp.vptsp_proxy_anchor_loss(
      args[0], LABELS, args[1])), want1, rtol=1e-5)
  check_grads(lambda x, b, s: loss(x, b, s, rho, 4.0), args, order=1,
              modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-3)


def test_global_batch_on_8_devices_and_empty_sets():
  """``axis_name``: the sharded batch gives the single-device value and
  embedding gradient; no valid label gives zero loss and gradient."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(16, E)), jnp.float32)
  labels = jnp.asarray(np.repeat([0, 1, 2, 3, 4, 0, 1, 2], 2), jnp.int32)
  bias = jnp.asarray(rng.normal(size=(C, E)), jnp.float32)
  h = jnp.asarray(_unit(rng.normal(size=(C, E))), jnp.float32)

  def f(x, labels, bias, h, axis_name=None):
    return jax.value_and_grad(vptsp.vptsp_proxy_anchor_loss, argnums=(0, 3))(
        x, labels, bias, h, axis_name=axis_name)

  single = jax.jit(f)
  want_v, (want_gx, want_gh) = single(x, labels, bias, h)
  mesh = Mesh(np.array(jax.devices()), ("d",))
  v, (gx, gh) = jax.jit(jax.shard_map(
      lambda *args: f(*args, axis_name="d"), mesh=mesh,
      in_specs=(P("d"), P("d"), P(), P()),
      out_specs=(P(), (P("d"), P()))))(x, labels, bias, h)
  np.testing.assert_allclose(float(v), float(want_v), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(gx), np.asarray(want_gx), atol=1e-5)
  np.testing.assert_allclose(np.asarray(gh), np.asarray(want_gh), atol=1e-5)
  v, (gx, gh) = single(x, jnp.full((16,), -1, jnp.int32), bias, h)
  assert float(v) == 0.0
  assert not np.any(np.asarray(gx)) and not np.any(np.asarray(gh))


def test_bad_inputs_are_one_line():
  a = _inputs()
  with pytest.raises(ValueError, match="`semantic_proxies` .* must have the "
                     "shape of `proxies`"):
    vptsp.vptsp_proxy_anchor_loss(a["x"], LABELS, a["bias"], a["bias"][:3])
  with pytest.raises(ValueError, match="proxy_bias_ratio"):
    vptsp.vptsp_proxy_anchor_loss(a["x"], LABELS, a["bias"], a["bias"],
                                  proxy_bias_ratio=1.5)
  with pytest.raises(ValueError, match="multiple of k = 4"):
    sp.gru_mix(a["feats"], LABELS, a["memory"], a["w"], k=4)
