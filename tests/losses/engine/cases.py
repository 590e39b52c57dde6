"""Shared cases of the engine tests: a labelled batch, a rule of every
kind, each rule's public embedding form, and their block and masks; the
batches and cases of the pair baselines, the contrastive family and the
ranking losses, which several test files share."""


import functools

import jax.numpy as jnp
import numpy as np

import circle_jax.losses as losses
from circle_jax.losses import engine
from circle_jax.losses.circle import Circle, Unified
from circle_jax.losses.multi_similarity import MultiSimilarity
from circle_jax.losses.contrastive import Contrastive
from circle_jax.losses.ranked_list import RankedList
from circle_jax.losses.triplet import BatchHard
from tests.losses import engine_checks
from tests.losses.reference import fastap_ref, loss_ref, smooth_ap_ref

# Label 9 is a singleton (no positives); 16 samples, 8 devices x 2.
LABELS = np.array([0, 1, 2, 0, 1, 2, 3, 3, 0, 1, 2, 3, 9, 0, 1, 2], np.int32)
B = len(LABELS)

RULES = {
    "circle": Circle(),
    "circle_m": Circle(margin=0.25, gamma=32.0),
    "unified": Unified(gamma=16.0),
    "ms": MultiSimilarity(),
    "ms_no_mining": MultiSimilarity(mining=False, beta=20.0),
    "rll": RankedList(),
    "rll_t_pos": RankedList(t_pos=3.0, t_neg=4.0, imbalance=0.3),
    "contrastive": Contrastive(pos_margin=0.3, neg_margin=1.2),
    "triplet_batch_hard": BatchHard(margin=0.3),
}

# The public embedding form of each rule (all take block_size).
PUBLIC = {
    "circle": (losses.circle_loss, {}),
    "circle_m": (losses.circle_loss, dict(margin=0.25, gamma=32.0)),
    "unified": (losses.unified_loss, dict(gamma=16.0)),
    "ms": (losses.multi_similarity_loss, {}),
    "ms_no_mining": (losses.multi_similarity_loss,
                     dict(mining=False, beta=20.0)),
    "rll": (losses.ranked_list_loss, {}),
    "rll_t_pos": (losses.ranked_list_loss,
                  dict(t_pos=3.0, t_neg=4.0, imbalance=0.3)),
    "contrastive": (losses.contrastive_loss,
                    dict(pos_margin=0.3, neg_margin=1.2)),
    "triplet_batch_hard": (losses.triplet_margin_loss,
                           dict(margin=0.3, mining="batch_hard")),
}


def embeddings(seed=0, dim=6):
  rng = np.random.default_rng(seed)
  centres = rng.normal(size=(10, dim))
  return (centres[LABELS] + 0.9 * rng.normal(size=(B, dim))).astype(np.float32)


def block():
  x = embeddings()
  _, _, s, pos, neg = engine.pair_block(jnp.asarray(x), jnp.asarray(LABELS))
  return s, pos, neg


def miner_masks():
  rng = np.random.default_rng(3)
  return (jnp.asarray(rng.random((B, B)) < 0.7),
          jnp.asarray(rng.random((B, B)) < 0.7))


# ----------------------------------------------------------------------------
# Derived dL/dS == autodiff of the dense engine.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# Dense == blockwise through the public losses.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# global_sum.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# A third engine from the tile-level pieces.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# Each default once.
# ----------------------------------------------------------------------------


# ----------------------------------------------------------------------------
# The pair baselines' batch (contrastive, triplet, lifted, N-pair, margin).
# ----------------------------------------------------------------------------

PAIR_LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 3, 4, 5, 2, 6, 3])


def pair_batch(seed=0, b=16, d=5):
  x = np.random.default_rng(seed).normal(size=(b, d)).astype(np.float32)
  return x, PAIR_LABELS[:b]


# ----------------------------------------------------------------------------
# The contrastive family (SupCon, NT-Xent, Hyp-ViT's pairwise cross-entropy,
# the pairwise sigmoid), in both geometries (cosine and the Poincaré ball).
# ----------------------------------------------------------------------------

# 16 samples, 2 per device; label 9 has no positive, label 0 has 4 views.
FAMILY_LABELS = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 4, 9, 0],
                         np.int32)
FAMILY_B = len(FAMILY_LABELS)


def family_batch(seed=0, d=5):
  return np.random.default_rng(seed).normal(
      size=(FAMILY_B, d)).astype(np.float32)


FAMILY_FNS = {"supcon": losses.supcon_loss, "nt_xent": losses.nt_xent_loss,
              "pairwise_ce": losses.pairwise_ce_loss,
              "pairwise_sigmoid": losses.pairwise_sigmoid_loss}
POINCARE = dict(geometry="poincare", c=0.5, r=2.0)
FAMILY_CASES = {
    "supcon": dict(tau=0.5),
    "supcon_poincare": dict(tau=0.5, **POINCARE),
    "nt_xent": dict(tau=0.5),
    "nt_xent_poincare": dict(tau=0.5, **POINCARE),
    "pairwise_ce": dict(tau=0.5),            # Poincaré by default
    "pairwise_ce_cosine": dict(tau=0.5, geometry="cosine"),
    "pairwise_sigmoid": dict(t=4.0, b=-1.0),
    "pairwise_sigmoid_poincare": dict(t=1.0, b=-2.0, **POINCARE),
}


def family_case(case):
  """``(loss name, loss, hyperparameters)`` of a ``FAMILY_CASES`` key."""
  name = next(n for n in sorted(FAMILY_FNS, key=len, reverse=True)
              if case.startswith(n))
  return name, FAMILY_FNS[name], FAMILY_CASES[case]


def geometry_kw(kw):
  """The test cases' ``geometry`` / ``c`` / ``r`` as the loss's ``geometry``
  option (a Poincare object, or a name)."""
  kw = dict(kw)
  c, r = kw.pop("c", None), kw.pop("r", None)
  if kw.get("geometry") == "poincare" and (c, r) != (None, None):
    kw["geometry"] = losses.Poincare(c=0.1 if c is None else c,
                                     r=2.3 if r is None else r)
  return kw


def family_vg(fn, x, labels, **kw):
  """:func:`engine_checks.vg` with the cases' geometry keywords."""
  return engine_checks.vg(fn, x, labels, **geometry_kw(kw))


def family_sharded_vg(fn, x, labels, *masks, **kw):
  """:func:`engine_checks.sharded_vg` with the cases' geometry keywords."""
  return engine_checks.sharded_vg(fn, x, labels, *masks, **geometry_kw(kw))


def check_family_float64_reference(case):
  """The value and gradient of a ``FAMILY_CASES`` case equal the naive
  float64 reference (central differences for the gradient)."""
  name, fn, hyper = family_case(case)
  x = family_batch()
  value, grad = family_vg(fn, x, jnp.asarray(FAMILY_LABELS), **hyper)
  want = loss_ref(name, x, FAMILY_LABELS, hyper)
  assert want > 0
  np.testing.assert_allclose(float(value), want, rtol=2e-5)
  want_grad = engine_checks.grad_ref(
      lambda v: loss_ref(name, v, FAMILY_LABELS, hyper), x)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-3,
                             atol=2e-4 * np.abs(want_grad).max())


# ----------------------------------------------------------------------------
# The ranking losses (Smooth-AP, FastAP) on the tiled ranking engine.
# ----------------------------------------------------------------------------

RANKING_D = 8
RANKING_LABELS = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4],
                          np.int32)  # 3: alone
RANKING_B = len(RANKING_LABELS)


def ranking_batch(seed=0, n=RANKING_B):
  return np.random.default_rng(seed).normal(
      size=(n, RANKING_D)).astype(np.float32)


RANKING_LOSS = {"smooth_ap": (losses.smooth_ap_loss, smooth_ap_ref, "tau"),
                "fastap": (losses.fastap_loss, fastap_ref, "L")}
RANKING_CASES = {"smooth_ap": {"tau": 0.1}, "smooth_ap_default": {"tau": 0.01},
                 "fastap": {"L": 10}, "fastap_coarse": {"L": 3}}


def ranking_case(case):
  """``(loss, its float64 reference, hyperparameters)`` of a case."""
  name = "smooth_ap" if case.startswith("smooth_ap") else "fastap"
  fn, ref, key = RANKING_LOSS[name]
  hyper = RANKING_CASES[case]
  return fn, functools.partial(ref, **{key: hyper[key]}), hyper


def ranking_vg(fn, x, labels, **kw):
  return engine_checks.vg(fn, jnp.asarray(x), labels, **kw)


# The ranking losses' engines agree to this gradient tolerance.
ranking_close = functools.partial(engine_checks.close, grad_atol=1e-4)


def check_ranking_float64_reference(case):
  """The value and gradient of a ``RANKING_CASES`` case (on tiles of 5)
  equal the float64 reference (central differences for the gradient)."""
  fn, ref, hyper = ranking_case(case)
  x = ranking_batch()
  value, grad = ranking_vg(fn, x, jnp.asarray(RANKING_LABELS), block_size=5, **hyper)
  want = ref(x, RANKING_LABELS)
  assert 0 < want < 1
  np.testing.assert_allclose(float(value), want, rtol=2e-5)
  want_grad = engine_checks.grad_ref(lambda v: ref(v, RANKING_LABELS), x)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-3,
                             atol=2e-4 * np.abs(want_grad).max())
