"""Tests of the baseline pair losses against naive float64 references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from jax.test_util import check_grads

from circle_jax import ops
from circle_jax import losses
from circle_jax.losses import miners
from tests.losses import reference as ref

# Slow (many compiled cases): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


def _jit(fn):
  """``fn`` compiled as one program (keyword arguments closed over): far
  cheaper than op-by-op eager execution on the shared CI cores."""
  def call(*args, **kwargs):
    return jax.jit(lambda *a: fn(*a, **kwargs))(*args)
  return call


# ----------------------------------------------------------------------------
# Data and float64 references (naive loops, one anchor at a time).
# ----------------------------------------------------------------------------

LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 3, 4, 5, 2, 6, 3])  # 16


def _batch(seed=0, b=16, d=5):
  x = np.random.default_rng(seed).normal(size=(b, d)).astype(np.float32)
  return x, LABELS[:b]


def _dist64(x):
  u = ref.l2n(x)
  return np.sqrt(np.maximum(((u[:, None, :] - u[None, :, :]) ** 2).sum(-1),
                            0.0))


def _pairs(y, i, pos_mask=None, neg_mask=None):
  b = len(y)
  pos = [j for j in range(b) if y[j] == y[i] and j != i
         and (pos_mask is None or pos_mask[i, j])]
  neg = [j for j in range(b) if y[j] != y[i]
         and (neg_mask is None or neg_mask[i, j])]
  return pos, neg


def _mean_nonzero(values):
  values = [v for v in values if v > 0]
  return float(np.mean(values)) if values else 0.0


def contrastive_ref(x, y, pos_margin, neg_margin, pos_mask=None,
                    neg_mask=None):
  d = _dist64(x)
  pos_terms, neg_terms = [], []
  for i in range(len(y)):
    pos, neg = _pairs(y, i, pos_mask, neg_mask)
    pos_terms += [max(0.0, d[i, j] - pos_margin) for j in pos]
    neg_terms += [max(0.0, neg_margin - d[i, j]) for j in neg]
  return _mean_nonzero(pos_terms) + _mean_nonzero(neg_terms)


def triplet_ref(x, y, margin, mining, pos_mask=None, neg_mask=None):
  d = _dist64(x)
  terms = []
  for a in range(len(y)):
    pos, neg = _pairs(y, a, pos_mask, neg_mask)
    if mining == "all":
      terms += [max(0.0, d[a, p] - d[a, n] + margin) for p in pos for n in neg]
    elif mining == "batch_hard":
      if pos and neg:
        terms.append(max(0.0, max(d[a, p] for p in pos)
                         - min(d[a, n] for n in neg) + margin))
    else:  # semi_hard, TF-Addons rule
      if not neg:
        continue
      for p in pos:
        farther = [d[a, n] for n in neg if d[a, n] > d[a, p]]
        d_n = min(farther) if farther else max(d[a, n] for n in neg)
        terms.append(max(0.0, d[a, p] - d_n + margin))
  if mining == "all":
    return _mean_nonzero(terms)
  return float(np.mean(terms)) if terms else 0.0


def lifted_ref_paper(x, y, margin):
  """The paper's unordered-pair form (eq. 4), no masks."""
  d = _dist64(x)
  b = len(y)
  total, count = 0.0, 0
  for i in range(b):
    for j in range(i + 1, b):
      if y[i] != y[j]:
        continue
      s = sum(np.exp(margin - d[i, k]) for k in range(b) if y[k] != y[i])
      s += sum(np.exp(margin - d[j, l]) for l in range(b) if y[l] != y[j])
      jij = np.log(s) + d[i, j] if s > 0 else -np.inf
      total += max(0.0, jij) ** 2
      count += 1
  return total / (2 * count) if count else 0.0


def lifted_ref_ordered(x, y, margin, pos_mask=None, neg_mask=None):
  d = _dist64(x)
  total, count = 0.0, 0
  for i in range(len(y)):
    pos, neg_i = _pairs(y, i, pos_mask, neg_mask)
    for j in pos:
      _, neg_j = _pairs(y, j, pos_mask, neg_mask)
      terms = [margin - d[i, k] for k in neg_i] + [margin - d[j, l]
                                                   for l in neg_j]
      if terms:
        total += max(0.0, ref.logsumexp(terms) + d[i, j]) ** 2
      count += 1
  return 0.5 * total / count if count else 0.0


def n_pair_ref(x, y, l2_reg, pos_mask=None, neg_mask=None):
  f = np.asarray(x, np.float64)
  s = f @ f.T
  terms = []
  for a in range(len(y)):
    pos, neg = _pairs(y, a, pos_mask, neg_mask)
    if not neg:
      continue
    for p in pos:
      terms.append(np.log1p(sum(np.exp(s[a, n] - s[a, p]) for n in neg)))
  tuplet = float(np.mean(terms)) if terms else 0.0
  return tuplet + l2_reg * float(np.mean((f * f).sum(1)))


def margin_ref(x, y, beta, margin, nu, weights=None, pos_mask=None,
               neg_mask=None):
  d = _dist64(x)
  b = len(y)
  beta = np.broadcast_to(np.asarray(beta, np.float64), (int(y.max()) + 1,))
  total, count = 0.0, 0.0
  for a in range(b):
    pos, neg = _pairs(y, a, pos_mask, neg_mask)
    ba = beta[y[a]]
    for p in pos:
      w = 1.0 if weights is None else weights[a, p]
      lp = max(0.0, d[a, p] - ba + margin)
      total += w * (lp + nu * ba)
      count += w * (lp > 0)
    for n in neg:
      w = 1.0 if weights is None else weights[a, n]
      ln = max(0.0, ba - d[a, n] + margin)
      total += w * ln
      count += w * (ln > 0)
  return total / max(count, 1.0)


# ----------------------------------------------------------------------------
# Hand-computed tiny cases.
# ----------------------------------------------------------------------------

# Three points on the unit circle: a and p at 0 and 60 degrees (same class),
# n at 90 degrees. Distances: d(a,p)=1, d(a,n)=sqrt(2), d(p,n)=2 sin(15deg).
_TINY_X = np.array([[1.0, 0.0], [0.5, np.sqrt(3) / 2], [0.0, 1.0]],
                   np.float32)
_TINY_Y = np.array([0, 0, 1])
_S2 = np.sqrt(2.0)
_DPN = 2 * np.sin(np.pi / 12)


@pytest.fixture(scope="module")
def tiny():
  """Every hand-computed case, in one compiled program."""
  @jax.jit
  def run(x, y):
    return {
        "contrastive": losses.contrastive_loss(x, y, pos_margin=0.5,
                                               neg_margin=1.0),
        **{f"triplet_{m}": losses.triplet_margin_loss(x, y, margin=1.0,
                                                      mining=m)
           for m in ("all", "batch_hard", "semi_hard")},
        "lifted": losses.lifted_structure_loss(x, y, margin=1.0),
        "margin": losses.margin_loss(x, y, jnp.array([0.9, 1.3]), margin=0.2,
                                     nu=0.5),
    }
  return {k: float(v) for k, v in run(_TINY_X, _TINY_Y).items()}


def test_contrastive_hand_computed(tiny):
  # positives: (a,p),(p,a): 1-0.5 = 0.5 each. negatives (a,n),(n,a): sqrt2 > 1
  # -> 0; (p,n),(n,p): 1 - d_pn. Means over non-zero terms.
  np.testing.assert_allclose(tiny["contrastive"], 0.5 + (1 - _DPN), rtol=1e-5)


def test_triplet_hand_computed(tiny):
  # anchor a: [1 - sqrt2 + 1]_+ ; anchor p: [1 - d_pn + 1]_+ ; n: no positive.
  # Semi-hard: for anchor p, n is closer than a (d_pn < 1): no negative is
  # farther, so the farthest negative (n itself) is used; same value here.
  want = ((2 - _S2) + (2 - _DPN)) / 2
  for mining in ("all", "batch_hard", "semi_hard"):
    np.testing.assert_allclose(tiny[f"triplet_{mining}"], want, rtol=1e-5)


def test_lifted_hand_computed(tiny):
  # One unordered positive pair (a, p): N_a = {n}, N_p = {n}.
  j = np.log(np.exp(1.0 - _S2) + np.exp(1.0 - _DPN)) + 1.0
  np.testing.assert_allclose(tiny["lifted"], j**2 / 2, rtol=1e-5)


def test_margin_hand_computed(tiny):
  # positives (a,p),(p,a), beta_0=0.9: [1 - 0.9 + 0.2] = 0.3 each, reg 0.45.
  # negatives: (a,n) beta 0.9: [0.9 - sqrt2 + .2]_+ = 0; (p,n): 1.1 - d_pn;
  # (n,a) beta 1.3: 1.5 - sqrt2; (n,p): 1.5 - d_pn.
  terms = [0.3, 0.3, 1.1 - _DPN, 1.5 - _S2, 1.5 - _DPN]
  want = (sum(terms) + 2 * 0.5 * 0.9) / len(terms)
  np.testing.assert_allclose(tiny["margin"], want, rtol=1e-5)


# ----------------------------------------------------------------------------
# Against the float64 references, with and without miner masks.
# ----------------------------------------------------------------------------

_X, _Y = _batch(1)
_RNG = np.random.default_rng(2)
_PM, _NM = _RNG.random((16, 16)) < 0.6, _RNG.random((16, 16)) < 0.6
_BETA = np.linspace(0.8, 1.4, 7).astype(np.float32)
_DW_KEY = jax.random.PRNGKey(3)

# name -> (loss(x, y, **kw) under jit, float64 reference(x, y)).
_CASES = {
    "contrastive": (
        functools.partial(losses.contrastive_loss, pos_margin=0.6,
                          neg_margin=1.2),
        lambda x, y: contrastive_ref(x, y, 0.6, 1.2)),
    "contrastive_masked": (
        functools.partial(losses.contrastive_loss, pos_margin=0.6,
                          neg_margin=1.2, pos_mask=_PM, neg_mask=_NM),
        lambda x, y: contrastive_ref(x, y, 0.6, 1.2, _PM, _NM)),
    **{f"triplet_{m}{suffix}": (
        functools.partial(losses.triplet_margin_loss, margin=0.3, mining=m,
                          **masks),
        functools.partial(triplet_ref, margin=0.3, mining=m, **masks))
       for m in ("all", "batch_hard", "semi_hard")
       for suffix, masks in (("", {}),
                             ("_masked", {"pos_mask": _PM,
                                          "neg_mask": _NM}))},
    "lifted": (functools.partial(losses.lifted_structure_loss, margin=1.0),
               lambda x, y: lifted_ref_paper(x, y, 1.0)),
    "lifted_masked": (
        functools.partial(losses.lifted_structure_loss, margin=0.7,
                          pos_mask=_PM, neg_mask=_NM),
        lambda x, y: lifted_ref_ordered(x, y, 0.7, _PM, _NM)),
    "n_pair": (functools.partial(losses.n_pair_loss, l2_reg=0.1),
               lambda x, y: n_pair_ref(x, y, 0.1)),
    "n_pair_masked": (
        functools.partial(losses.n_pair_loss, l2_reg=0.1, pos_mask=_PM,
                          neg_mask=_NM),
        lambda x, y: n_pair_ref(x, y, 0.1, _PM, _NM)),
    "margin": (
        lambda x, y: losses.margin_loss(x, y, _BETA, margin=0.2, nu=0.1),
        lambda x, y: margin_ref(x, y, _BETA, 0.2, 0.1)),
    "margin_scalar_beta": (
        lambda x, y: losses.margin_loss(x, y, 1.1, margin=0.2, nu=0.1),
        lambda x, y: margin_ref(x, y, 1.1, 0.2, 0.1)),
    "margin_masked": (
        lambda x, y: losses.margin_loss(x, y, _BETA, pos_mask=_PM,
                                        neg_mask=_NM),
        lambda x, y: margin_ref(x, y, _BETA, 0.2, 0.0, pos_mask=_PM,
                                neg_mask=_NM)),
}


@pytest.fixture(scope="module")
def case_values():
  """Every case of ``_CASES`` plus the sampler's weights: one program."""
  @jax.jit
  def run(x, y):
    out = {name: fn(x, y) for name, (fn, _) in _CASES.items()}
    out["dw_weights"] = miners.distance_weighted_miner(x, y, _DW_KEY)
    out["margin_dw"] = losses.margin_loss(x, y, _BETA, key=_DW_KEY, nu=0.05)
    out["margin_dw_weights"] = losses.margin_loss(
        x, y, _BETA, nu=0.05, pair_weights=out["dw_weights"])
    return out
  return jax.tree.map(np.asarray, run(_X, _Y))


@pytest.mark.parametrize("name", sorted(_CASES))
def test_matches_float64_reference(case_values, name):
  want = _CASES[name][1](_X, _Y)
  assert want > 0
  np.testing.assert_allclose(float(case_values[name]), want, rtol=2e-5)


def test_margin_with_key_equals_weighted_form_of_the_sampler(case_values):
  w = case_values["dw_weights"]
  assert w.max() >= 1 and np.all(w == np.round(w))
  np.testing.assert_allclose(
      float(case_values["margin_dw"]),
      margin_ref(_X, _Y, _BETA, 0.2, 0.05, weights=w), rtol=2e-5)
  np.testing.assert_allclose(float(case_values["margin_dw_weights"]),
                             float(case_values["margin_dw"]), rtol=1e-6)
  with pytest.raises(ValueError, match="not both"):
    losses.margin_loss(_X, _Y, _BETA, key=_DW_KEY, pair_weights=w)


def test_n_pair_with_pair_layout_masks_is_sohn():
  # N pairs of N classes laid out [anchors; positives]: Sohn's eq. 6, where
  # anchor i's negatives are the other classes' positives.
  n, d = 5, 4
  rng = np.random.default_rng(9)
  f_a = rng.normal(size=(n, d))
  f_p = rng.normal(size=(n, d))
  x = np.concatenate([f_a, f_p]).astype(np.float32)
  y = np.concatenate([np.arange(n), np.arange(n)])
  pm = np.zeros((2 * n, 2 * n), bool)
  nm = np.zeros((2 * n, 2 * n), bool)
  for i in range(n):
    pm[i, n + i] = True
    nm[i, n:] = True
  sohn = np.mean([np.log1p(sum(np.exp(f_a[i] @ f_p[j] - f_a[i] @ f_p[i])
                               for j in range(n) if j != i))
                  for i in range(n)])
  got = _jit(losses.n_pair_loss)(x, y, l2_reg=0.0, pos_mask=pm, neg_mask=nm)
  np.testing.assert_allclose(float(got), sohn, rtol=1e-5)


# ----------------------------------------------------------------------------
# Matrix forms, gradients, numerics.
# ----------------------------------------------------------------------------


def test_matrix_forms_equal_wrappers():
  @jax.jit
  def run(x, y):
    dist = ops.euclidean_from_cosine(ops.cosine_similarity(x, x))
    beta = jnp.full((7,), 1.2)
    reg = 0.02 * jnp.mean(jnp.sum(x * x, 1))
    return {
        "contrastive": (losses.contrastive_loss_from_distance(dist, y),
                        losses.contrastive_loss(x, y)),
        "triplet": (losses.triplet_margin_loss_from_distance(
            dist, y, mining="semi_hard"),
                    losses.triplet_margin_loss(x, y, mining="semi_hard")),
        "lifted": (losses.lifted_structure_loss_from_distance(dist, y),
                   losses.lifted_structure_loss(x, y)),
        "n_pair": (losses.n_pair_loss_from_similarity(
            jnp.matmul(x, x.T, precision="highest"), y) + reg,
                   losses.n_pair_loss(x, y)),
        "margin": (losses.margin_loss_from_distance(dist, y, beta),
                   losses.margin_loss(x, y, beta)),
    }
  for name, (matrix_form, wrapper) in run(*_batch(12)).items():
    np.testing.assert_allclose(float(matrix_form), float(wrapper), rtol=1e-5,
                               err_msg=name)


def test_general_pair_weighting_of_contrastive_is_the_hinge_indicator():
  # dL/dD_ij = +1/#active positives on active positive pairs, -1/#active
  # negatives on active negative pairs, 0 elsewhere.
  x, y = _batch(14)
  d = _dist64(x).astype(np.float32)
  w_pos, w_neg = jax.jit(lambda d, y: losses.pair_weights(
      losses.contrastive_loss_from_distance, d, y, pos_margin=0.5,
      neg_margin=1.0))(d, y)
  same = y[:, None] == y[None, :]
  pos, neg = same & ~np.eye(16, dtype=bool), ~same
  act_p, act_n = pos & (d > 0.5), neg & (d < 1.0)
  assert act_p.any() and act_n.any() and (neg & ~act_n).any()
  np.testing.assert_allclose(np.asarray(w_pos), act_p / act_p.sum(),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(w_neg), act_n / act_n.sum(),
                             rtol=1e-6)


def _wrappers(beta_classes=7):
  """Every pair-loss variant as ``f(x, y, pos_mask, neg_mask)``."""
  beta = jnp.full((beta_classes,), 1.0)
  return {
      "contrastive": functools.partial(losses.contrastive_loss,
                                       pos_margin=0.3, neg_margin=1.2),
      "triplet_all": functools.partial(losses.triplet_margin_loss,
                                       margin=0.5),
      "triplet_batch_hard": functools.partial(
          losses.triplet_margin_loss, margin=0.5, mining="batch_hard"),
      "triplet_semi_hard": functools.partial(
          losses.triplet_margin_loss, margin=0.5, mining="semi_hard"),
      "lifted": losses.lifted_structure_loss,
      "n_pair": functools.partial(losses.n_pair_loss, l2_reg=0.0),
      "margin": lambda x, y, **kw: losses.margin_loss(x, y, beta, **kw),
      "margin_dw": lambda x, y, **kw: losses.margin_loss(
          x, y, beta, key=jax.random.PRNGKey(0), **kw),
  }


_WRAPPER_NAMES = sorted(_wrappers())
_NEEDS_BOTH = ("triplet_all", "triplet_batch_hard", "triplet_semi_hard",
               "lifted", "n_pair")


@jax.jit
def _all_values_and_jacobians(x, y, pos_mask, neg_mask):
  fns = _wrappers()
  f = lambda x: jnp.stack([fns[k](x, y, pos_mask=pos_mask, neg_mask=neg_mask)
                           for k in _WRAPPER_NAMES])
  return f(x), jax.jacrev(f)(x)


# One compiled program (bf16 [6, 5] inputs) serves every case below.
_X6 = jnp.asarray(_batch(16, b=6)[0]).astype(jnp.bfloat16)
_ALL_PAIRS = jnp.ones((6, 6), bool)


def test_no_pairs_every_loss_zero_with_zero_grad():
  v, g = _all_values_and_jacobians(_X6, jnp.array([0, 0, 0, 1, 1, 2]),
                                   ~_ALL_PAIRS, ~_ALL_PAIRS)
  assert v.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(v), 0.0)
  np.testing.assert_array_equal(np.asarray(g, np.float32), 0.0)


@pytest.mark.parametrize("case", ["one_class", "all_distinct"])
def test_empty_positive_or_negative_sets(case):
  y = (jnp.zeros(6, jnp.int32) if case == "one_class"
       else jnp.arange(6, dtype=jnp.int32))
  v, g = _all_values_and_jacobians(_X6, y, _ALL_PAIRS, _ALL_PAIRS)
  g = np.asarray(g, np.float32)
  assert np.all(np.isfinite(g))
  for k, name in enumerate(_WRAPPER_NAMES):
    if name in _NEEDS_BOTH:  # every term needs a positive and a negative
      assert float(v[k]) == 0.0, name
      np.testing.assert_array_equal(g[k], 0.0, err_msg=name)
  # Losses with separate positive and negative terms keep the present side.
  xn, yn = np.asarray(_X6, np.float32), np.asarray(y)
  np.testing.assert_allclose(float(v[_WRAPPER_NAMES.index("contrastive")]),
                             contrastive_ref(xn, yn, 0.3, 1.2), rtol=1e-5)
  np.testing.assert_allclose(float(v[_WRAPPER_NAMES.index("margin")]),
                             margin_ref(xn, yn, 1.0, 0.2, 0.0), rtol=1e-5)


def test_bf16_zero_vector_and_duplicates_are_finite():
  # A zero embedding and duplicated rows (d = 0 between distinct samples).
  x = _X6.at[0].set(0.0).at[2].set(_X6[1])
  v, g = _all_values_and_jacobians(x, jnp.array([0, 0, 0, 1, 1, 2]),
                                   _ALL_PAIRS, _ALL_PAIRS)
  assert np.all(np.isfinite(np.asarray(v)))
  assert np.all(np.asarray(v)[[_WRAPPER_NAMES.index(k) for k in _NEEDS_BOTH]]
                > 0)
  assert np.all(np.isfinite(np.asarray(g, np.float32)))


def test_check_grads():
  # One numerical-gradient check of a weighted sum of the smooth-enough
  # losses (distinct weights, so an error in any one of them shows).
  x, y = _batch(15, b=8, d=3)
  fns = _wrappers()
  names = ["contrastive", "triplet_all", "lifted", "margin"]

  @jax.jit
  def f(x):
    total = sum((k + 1.0) * fns[n](x, jnp.asarray(y))
                for k, n in enumerate(names))
    return total + losses.n_pair_loss(x, jnp.asarray(y), l2_reg=0.1)
  check_grads(f, (jnp.asarray(x),), order=1, modes=["rev"], eps=1e-3,
              atol=2e-2, rtol=2e-2)


def test_far_apart_classes_large_margins_are_finite():
  # Antipodal classes, huge raw norms: exp(margin - d) and exp(s) stay in
  # range thanks to the max-shifted log-sum-exps.
  x = jnp.array([[1.0, 0.0], [1.0, 1e-3], [-1.0, 0.0], [-1.0, 1e-3]]) * 1e3
  y = jnp.array([0, 0, 1, 1])
  f = lambda x: (losses.lifted_structure_loss(x, y, margin=50.0)
                 + losses.n_pair_loss(x, y))
  v, g = jax.jit(jax.value_and_grad(f))(x)
  assert np.isfinite(float(v)) and float(v) > 0
  assert np.all(np.isfinite(np.asarray(g)))


def test_jit_and_vmap_equal_eager():
  _, y = _batch(17)
  xs = np.stack([_batch(17)[0], _batch(18)[0]])
  f = lambda x: losses.triplet_margin_loss(x, jnp.asarray(y), mining="all")
  eager = float(f(xs[0]))
  np.testing.assert_allclose(float(jax.jit(f)(xs[0])), eager, rtol=1e-6)
  got = np.asarray(jax.jit(jax.vmap(f))(xs))
  np.testing.assert_allclose(got[0], eager, rtol=1e-6)
  np.testing.assert_allclose(got[1], triplet_ref(xs[1], y, 0.2, "all"),
                             rtol=2e-5)


def test_triplet_tensors_are_never_materialised():
  # "all" and "semi_hard" reduce over [B, B, B] triplet tables; value and
  # gradient must not keep one (a [256]^3 float32 tensor is 64 MiB; the
  # chunked evaluation keeps about 10 MiB).
  b = 256
  x = jnp.zeros((b, 8), jnp.float32)
  y = jnp.arange(b) % 16
  cube = b**3 * 4
  for mining in ("all", "semi_hard"):
    f = jax.value_and_grad(
        lambda x: losses.triplet_margin_loss(x, y, mining=mining))
    mem = jax.jit(f).lower(x).compile().memory_analysis()
    assert mem is not None and mem.temp_size_in_bytes < cube / 4, mining


def test_bad_inputs_raise_clear_errors():
  x, y = _batch(19, b=4)
  with pytest.raises(ValueError, match="mining"):
    losses.triplet_margin_loss(x, y, mining="hardest")
  with pytest.raises(ValueError, match="margin"):
    losses.triplet_margin_loss(x, y, margin=-1.0)
  with pytest.raises(ValueError, match="embeddings"):
    losses.contrastive_loss(x[0], y)
  with pytest.raises(TypeError, match="labels"):
    losses.lifted_structure_loss(x, y.astype(np.float32))
  with pytest.raises(ValueError, match="pos_mask"):
    losses.n_pair_loss(x, y, pos_mask=np.ones((4, 3), bool))
  with pytest.raises(ValueError, match="beta"):
    losses.margin_loss(x, y, np.ones((2, 2), np.float32))
  with pytest.raises(TypeError, match="beta"):
    losses.margin_loss(x, y, np.ones((4,), np.int32))
  with pytest.raises(ValueError, match="pair_weights"):
    losses.margin_loss(x, y, 1.2, pair_weights=np.ones((4, 5)))
  with pytest.raises(ValueError, match="square"):
    losses.contrastive_loss_from_distance(np.ones((4, 3)), y)


# ----------------------------------------------------------------------------
# Global batch across 8 devices: values and gradients equal one device.
# ----------------------------------------------------------------------------


_DISTRIBUTED = {
    "contrastive": functools.partial(losses.contrastive_loss, pos_margin=0.3,
                                     neg_margin=1.2),
    "triplet_all": functools.partial(losses.triplet_margin_loss, margin=0.5),
    "triplet_batch_hard": functools.partial(
        losses.triplet_margin_loss, margin=0.5, mining="batch_hard"),
    "triplet_semi_hard": functools.partial(
        losses.triplet_margin_loss, margin=0.5, mining="semi_hard"),
    "lifted": losses.lifted_structure_loss,
    "n_pair": losses.n_pair_loss,
    "margin_dw": lambda x, y, axis_name=None: losses.margin_loss(
        x, y, jnp.linspace(0.8, 1.4, 7), nu=0.1, key=jax.random.PRNGKey(5),
        axis_name=axis_name),
}
_NAMES = sorted(_DISTRIBUTED)


def _all_losses(x, y, axis_name=None):
  """Every loss variant at once (one compilation per mode): ``[n_losses]``."""
  return jnp.stack([_DISTRIBUTED[k](x, y, axis_name=axis_name)
                    for k in _NAMES])


def _values_and_jacobians(f):
  return lambda x, y: (f(x, y), jax.jacrev(f)(x, y))


@pytest.fixture(scope="module")
def single_device_reference():
  x, y = (jnp.asarray(a) for a in _batch(20))
  values, jac = jax.jit(_values_and_jacobians(_all_losses))(x, y)
  assert np.all(np.asarray(values) > 0)
  return x, y, values, jac


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_global_batch_equals_single_device(single_device_reference, mode):
  x, y, ref_v, ref_g = single_device_reference
  local = _values_and_jacobians(functools.partial(_all_losses, axis_name="d"))
  n = jax.device_count()
  if mode == "shard_map":
    mesh = Mesh(np.array(jax.devices()), ("d",))
    v, g = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P("d"), P("d")),
        out_specs=(P(), P(None, "d"))))(x, y)
  else:
    v, g = jax.pmap(local, axis_name="d")(x.reshape(n, -1, x.shape[1]),
                                          y.reshape(n, -1))
    v, g = v[0], jnp.moveaxis(g, 0, 1).reshape(ref_g.shape)
  for k, name in enumerate(_NAMES):
    np.testing.assert_allclose(float(v[k]), float(ref_v[k]), rtol=1e-5,
                               err_msg=name)
    np.testing.assert_allclose(np.asarray(g[k]), np.asarray(ref_g[k]),
                               atol=1e-5, err_msg=name)


def test_miner_masks_on_devices_match_single_device_blocks():
  x, y = (jnp.asarray(a) for a in _batch(21))
  mesh = Mesh(np.array(jax.devices()), ("d",))

  def mined_loss(x, y, axis_name=None):
    pm, nm = miners.semi_hard_miner(x, y, margin=0.5, axis_name=axis_name)
    return losses.contrastive_loss(x, y, pos_mask=pm, neg_mask=nm,
                                   axis_name=axis_name)

  got = jax.jit(jax.shard_map(lambda x, y: mined_loss(x, y, "d"), mesh=mesh,
                              in_specs=(P("d"), P("d")), out_specs=P()))(x, y)
  want = jax.jit(mined_loss)(x, y)
  assert float(want) > 0
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


@pytest.mark.parametrize("d_ap, chosen", [(0.5, 2), (0.9, 2), (0.3, 4)])
def test_semi_hard_tie_picks_the_lowest_column(d_ap, chosen):
  # Anchor 0, positive 1, negatives 2 and 3 at the same distance 0.7 and
  # negative 4 at 0.4. d_ap = 0.5: the closest farther negative is the tie
  # 2/3; d_ap = 0.9: none is farther, the farthest is the tie 2/3; d_ap =
  # 0.3: negative 4. Ties go to the lowest column; the gradient shows which.
  d = np.full((5, 5), 1.0, np.float32)
  d[0, 1] = d[1, 0] = d_ap
  d[0, 2] = d[0, 3] = 0.7
  d[0, 4] = 0.4
  labels = jnp.array([0, 0, 1, 1, 2])
  pos_mask = np.zeros((5, 5), bool)
  pos_mask[0, 1] = True  # only anchor 0's positive pair counts
  g = jax.grad(lambda d: losses.triplet_margin_loss_from_distance(
      d, labels, margin=1.0, mining="semi_hard", pos_mask=pos_mask))(
          jnp.asarray(d))
  row = np.asarray(g)[0]
  assert row[1] > 0 and row[chosen] < 0
  assert np.count_nonzero(row[2:]) == 1
