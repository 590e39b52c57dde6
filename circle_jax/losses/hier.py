r"""HIER: hierarchical proxies on the Poincaré ball as a regulariser
(Kim, Jeong, Kwak, CVPR 2023).

HIER adds to any metric loss ``M`` learnable *hierarchical proxies*
``rho_1..rho_M`` (``M = 512``) on the Poincaré ball of curvature ``-c``
(``c = 0.1``, features clipped at norm ``r = 2.3``), trained to be the
ancestors of groups of samples and of other proxies. For a triplet
``(i, j, k)`` whose pair ``(i, j)`` is more related than ``(i, k)``, the
lowest common ancestor (LCA) of a set is the proxy nearest to its farthest
member,

.. math::

  \rho_{ij} = \arg\min_\rho \max(d(x_i, \rho), d(x_j, \rho)),\quad
  \rho_{ijk} = \arg\min_\rho \max(d(x_i, \rho), d(x_j, \rho), d(x_k, \rho)),

with ``d`` the Poincaré distance (:class:`circle_jax.losses.hyperbolic.
Poincare`), and the triplet's loss pulls ``i`` and ``j`` to their own LCA
more than to the triplet's, and ``k`` to the triplet's,

.. math::

  \ell_{ijk} = [d(x_i,\rho_{ij}) - d(x_i,\rho_{ijk}) + \delta]_+
             + [d(x_j,\rho_{ij}) - d(x_j,\rho_{ijk}) + \delta]_+
             + [d(x_k,\rho_{ijk}) - d(x_k,\rho_{ij}) + \delta]_+,

counted only where the two LCAs differ (``rho_ij != rho_ijk``), margin
``delta = 0.1``. The ``argmin`` is a hard Gumbel-softmax, straight-through:
the one-hot of ``argmax(-m / tau + g)`` in value (``m`` the max-distances
to every proxy, ``g`` Gumbel noise from the PRNG ``key``; ``tau = 0.1``)
with the gradient of ``softmax(-m / tau + g)``, so the distances to the
chosen proxy and the choice itself both receive gradient.

Triplets: ``j`` is a *mutual* top-``k`` neighbour of the anchor ``i``
(``k = 20``) under the similarity ``exp(-d(x_i, x_j)) + [y_i = y_j]`` (so
the same class ranks first, then the nearest samples), and ``k`` is any
sample that is not; each anchor with at least two mutual neighbours and one
non-neighbour draws ``T = 50`` positives and ``T`` negatives uniformly with
replacement. The same loss runs on the proxies themselves (anchors,
positives and negatives among the proxies, LCAs among the proxies, mutual
neighbours by ``exp(-d)`` alone): :func:`hier_loss` is the mean over the
samples' triplets plus the mean over the proxies' triplets. Added to
Proxy-Anchor with weight 0.5 (``config.more_losses``, the paper's
``lambda``).

The official code (github.com/tjddus9597/HIER-CVPR23, ``hier/losses.py``
``HIERLoss``) and ours:

* the embeddings reach the loss on the ball: the code's model ends in
  ``ToPoincare`` (clip at ``r``, exponential map at 0, projection); here
  :func:`hier_loss` maps the head's raw features itself (``embed_inputs``),
  as :meth:`circle_jax.losses.hyperbolic.Poincare.embed`, and the
  registry entry asks the trainer for unnormalised features
  (``LossEntry.raw_features``); the metric loss beside it (Proxy-Anchor)
  takes the cosine, which the map leaves unchanged;
* the proxies are stored in the tangent space and mapped the same way; the
  code's initialisation is ours: ``N(0, 1) / sqrt(D) * r * 0.9``
  (:func:`init_hier_proxies`);
* the code's ``RiemannianGradient`` scales the gradient of each point on
  the ball by ``(1 - c|z|^2)^2 / 4``; we apply it to the proxies
  (``riemannian``), not to the embeddings: the code applies it in the
  model, to the metric loss's gradient as well, so leaving it out of both
  keeps their relative weight;
* the Gumbel-softmax: the code calls ``F.gumbel_softmax(-m / tau, hard=True)``
  (its own temperature 1), the same as ours; torch's noise stream cannot be
  reproduced, so checks compare with given noise (``gumbel``) or none;
* the distance: hyptorch's ``dist_matrix`` has ``1e-5`` in a denominator
  and clamps ``artanh``'s argument at ``1 - 1e-5``; ours is the arcosh
  form of :mod:`circle_jax.losses.hyperbolic` (equal up to those guards);
* negatives: the code's candidates ``sim < 1`` include the anchor itself
  (its diagonal is set to -1); the paper's triplets are three samples, so
  we leave the anchor out (``self_negative=True`` restores the code's);
* an anchor without two mutual neighbours is skipped, as in the code; an
  empty batch of valid anchors gives 0 (the code raises).

References:
  Kim, Jeong, Kwak, "HIER: Metric Learning Beyond Class Labels via
  Hierarchical Regularization", CVPR 2023 (arXiv:2212.14258; code:
  github.com/tjddus9597/HIER-CVPR23). Jang, Gu, Poole, "Categorical
  Reparameterization with Gumbel-Softmax", ICLR 2017.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.extend import random as jax_random

from circle_jax import ops
from circle_jax.losses import checks
from circle_jax.losses import entries
from circle_jax.losses import hyperbolic
from circle_jax.losses import ranges
from circle_jax.losses.engine import reductions

Array = jax.Array



@dataclasses.dataclass(frozen=True)
class Hier:
  """HIER's hyperparameters at the official scripts' settings
  (``scripts/*/hier_*.sh``, ``hier/losses.py``): the margin ``delta``, the
  LCA temperature ``tau``, the neighbourhood ``topk``, the triplets drawn
  per anchor, the ball's ``c`` and clipping radius ``r``, the proxy count."""

  delta: float = 0.1
  tau: float = 0.1
  topk: int = 20
  triplets_per_anchor: int = 50
  c: float = hyperbolic.DEFAULT_C
  r: float = hyperbolic.DEFAULT_R
  num_proxies: int = 512

_RANGES = {"delta": ranges.HyperRange(0.0, 1e3),
           "tau": ranges.HyperRange(0.0, 1e3, False)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _riemannian(z, c):
  return z


def _riemannian_fwd(z, c):
  return z, z


def _riemannian_bwd(c, z, ct):
  scale = jnp.square(1.0 - c * jnp.sum(z * z, -1, keepdims=True)) / 4.0
  return (ct * scale,)


_riemannian.defvjp(_riemannian_fwd, _riemannian_bwd)


def riemannian_gradient(z: Array, *, c: float) -> Array:
  """``z`` in value; its cotangent scaled by ``(1 - c|z|^2)^2 / 4``, the
  inverse metric of the ball at ``z`` (hyptorch's ``RiemannianGradient``).

  Args:
    z: ``[N, D]`` points on the ball of curvature ``-c``.
    c: the curvature magnitude.

  Returns:
    ``z``, ``[N, D]``.
  """
  return _riemannian(z, float(c))


def _max_partial(x: Array, y: Array) -> Array:
  """``d max(x, y) / dx`` as ``jnp.maximum`` differentiates: 1 where
  ``x > y``, 0 where ``x < y``, 1/2 at a tie."""
  return jnp.where(x == y, 0.5, (x > y).astype(jnp.float32))


def _lca_logits(dist, anchors, positives, negatives, gumbel, tau):
  """The triplets' rows of ``dist``, the max-distance of ``(i, j)`` and the
  logits of the two LCA choices, each ``[T, M]``."""
  d_i, d_j, d_k = dist[anchors], dist[positives], dist[negatives]
  m_ij = jnp.maximum(d_i, d_j)
  m_ijk = jnp.maximum(d_k, m_ij)
  return (d_i, d_j, d_k, m_ij), (-m_ij / tau + gumbel[0],
                                 -m_ijk / tau + gumbel[1])


def _at(x: Array, idx: Array) -> Array:
  return jnp.take_along_axis(x, idx[:, None], axis=-1)[:, 0]


@jax.custom_vjp
def _triplet_sum(dist, anchors, positives, negatives, gumbel, coef, delta,
                 tau):
  r"""``sum_t coef_t [rho_ij != rho_ijk] l_t``, with the gradient of the
  straight-through hard Gumbel-softmax written out.

  The LCA choice ``p = onehot(argmax z) + softmax(z) - sg(softmax(z))``
  (logits ``z``) is the one-hot in value, so ``<d, p> = d[argmax z]``, and
  its gradient is the one-hot's plus the softmax's. With ``e_1, e_2, e_3``
  the hinges' indicators times ``coef``, the cotangent of ``p_ij`` is
  ``v = e_1 d_i + e_2 d_j - e_3 d_k`` and that of ``p_ijk`` is ``-v``;
  through the softmax ``s`` it reaches the logits as ``s (v - <v, s>)``,
  and the rows of ``dist`` through ``-max(...) / tau`` (``jnp.maximum``'s
  partials). Written by hand, the backward pass builds no ``[T, M]``
  one-hot and no products ``d * p``: the regulariser's value and gradient
  at the omniglot recipe's size (25,600 proxy triplets over 512 proxies)
  take about 0.7 of the time of autodiff through the straight-through form
  (``python -m experiments.bench.hier``, figures in its docstring).
  tests/losses/test_hier.py checks the two agree, ties included.
  """
  return _triplet_sum_fwd(dist, anchors, positives, negatives, gumbel, coef,
                          delta, tau)[0]


def _triplet_sum_fwd(dist, anchors, positives, negatives, gumbel, coef,
                     delta, tau):
  (d_i, d_j, d_k, _), (z_ij, z_ijk) = _lca_logits(
      dist, anchors, positives, negatives, gumbel, tau)
  c_ij, c_ijk = jnp.argmax(z_ij, -1), jnp.argmax(z_ijk, -1)
  hinges = (_at(d_i, c_ij) - _at(d_i, c_ijk) + delta,
            _at(d_j, c_ij) - _at(d_j, c_ijk) + delta,
            _at(d_k, c_ijk) - _at(d_k, c_ij) + delta)
  coef = jnp.where(c_ij != c_ijk, coef, 0.0)
  total = jnp.sum(coef * sum(jax.nn.relu(h) for h in hinges))
  return total, (dist, anchors, positives, negatives, gumbel, coef, tau,
                 c_ij, c_ijk, hinges)


def _triplet_sum_bwd(res, ct):
  (dist, anchors, positives, negatives, gumbel, coef, tau, c_ij, c_ijk,
   h) = res
  (d_i, d_j, d_k, m_ij), (z_ij, z_ijk) = _lca_logits(
      dist, anchors, positives, negatives, gumbel, tau)
  e_i, e_j, e_k = (coef * ct * (hinge > 0) for hinge in h)
  v = e_i[:, None] * d_i + e_j[:, None] * d_j - e_k[:, None] * d_k

  def through_softmax(z, cot):
    s = jax.nn.softmax(z, axis=-1)
    return s * (cot - jnp.sum(cot * s, -1, keepdims=True))

  g_ijk = through_softmax(z_ijk, -v) / -tau  # of max(d_k, m_ij)
  g_ij = through_softmax(z_ij, v) / -tau + g_ijk * _max_partial(m_ij, d_k)
  grad = (jnp.zeros_like(dist)
          .at[anchors].add(g_ij * _max_partial(d_i, d_j))
          .at[positives].add(g_ij * _max_partial(d_j, d_i))
          .at[negatives].add(g_ijk * _max_partial(d_k, m_ij)))
  # The one-hots' part: d_i, d_j at rho_ij minus at rho_ijk; d_k reversed.
  rows = jnp.concatenate([anchors, positives, negatives])
  e = jnp.concatenate([e_i, e_j, e_k])
  grad = grad.at[rows, jnp.concatenate([c_ij, c_ij, c_ijk])].add(e)
  grad = grad.at[rows, jnp.concatenate([c_ijk, c_ijk, c_ij])].add(-e)
  return grad, None, None, None, None, None, None, None


_triplet_sum.defvjp(_triplet_sum_fwd, _triplet_sum_bwd)


def hier_triplet_loss(dist: Array, anchors: Array, positives: Array,
                      negatives: Array, *, gumbel: Optional[Array] = None,
                      weights: Optional[Array] = None,
                      delta: float = Hier.delta,
                      tau: float = Hier.tau) -> Array:
  r"""HIER's triplet loss on given triplets (the code's ``compute_gHHC``).

  ``L = sum_t w_t [rho_ij != rho_ijk] l_t / sum_t w_t`` with ``l_t`` the
  triplet's three hinges (module docstring); 0 (zero gradient) without a
  weighted triplet.

  Args:
    dist: ``[N, M]`` distances of the points (samples or proxies) to the
      proxies.
    anchors: ``[T]`` integer rows of ``dist``: ``i``.
    positives: ``[T]``: ``j``, related to ``i``.
    negatives: ``[T]``: ``k``.
    gumbel: optional ``[2, T, M]`` Gumbel noise of the two LCA choices
      (``rho_ij``, ``rho_ijk``); ``None``: the plain ``argmin``.
    weights: optional ``[T]`` non-negative weights (0 drops a triplet);
      ``None``: all 1.
    delta: the margin.
    tau: the Gumbel-softmax temperature.

  Returns:
    float32 scalar, the weighted mean over the triplets.
  """
  dist = checks.check_matrix(dist, "dist", "[points, proxies] distances")
  t = jnp.shape(anchors)[0]
  for name, idx in (("anchors", anchors), ("positives", positives),
                    ("negatives", negatives)):
    checks.check_shape(idx, (t,), f"`{name}` must have shape ({t},)")
  if gumbel is not None:
    checks.check_shape(gumbel, (2, t, dist.shape[1]),
                       f"`gumbel` must have shape (2, {t}, {dist.shape[1]})")
  gumbel = (jnp.zeros((2, 1, 1), jnp.float32) if gumbel is None
            else jnp.asarray(gumbel, jnp.float32))
  w = (jnp.ones((t,), jnp.float32) if weights is None
       else jnp.asarray(weights, jnp.float32))
  w = jax.lax.stop_gradient(w)
  coef = jnp.where(w > 0, w, 0.0)
  # Inside shard_map the proxies' distances are invariant and the weights
  # vary (each device its own anchors): cast as autodiff would.
  dist = ops.vary_as(dist, anchors, positives, negatives, gumbel, coef)
  total = _triplet_sum(dist, anchors, positives, negatives, gumbel, coef,
                       jnp.asarray(delta, jnp.float32),
                       jnp.asarray(tau, jnp.float32))
  return total / jnp.maximum(jnp.sum(w), 1e-12) * (jnp.sum(w) > 0)


def mutual_neighbours(similarity: Array, topk: int) -> Array:
  """``[N, N]`` bool: ``a`` and ``b`` are each in the other's ``topk`` most
  similar (each row's top-``topk`` includes itself, as the code's
  ``torch.topk``); the diagonal is False.

  Args:
    similarity: ``[N, N]`` (no gradient is taken).
    topk: the neighbourhood size, at most ``N``.
  """
  n = similarity.shape[0]
  _, idx = jax.lax.top_k(jax.lax.stop_gradient(similarity), min(topk, n))
  nn = jnp.zeros((n, n), bool).at[jnp.arange(n)[:, None], idx].set(True)
  return nn & nn.T & ~jnp.eye(n, dtype=bool)


def _sample_triplets(key, pos: Array, neg: Array, rows: Array, t: int,
                     num_proxies: int):
  """Per anchor (global row ``rows[a]``): ``t`` positives and negatives
  drawn uniformly with replacement from its masks, and ``[2, t, M]`` Gumbel
  noise, from ``fold_in(key, row)`` (so independent of the device count);
  ``key`` None: the first ``t`` members cyclically and no noise."""
  def one(p, n, row):
    if key is None:
      def cyc(mask):
        order = jnp.argsort(~mask, stable=True)
        return order[jnp.arange(t) % jnp.maximum(jnp.sum(mask), 1)]
      return cyc(p), cyc(n), jnp.zeros((2, t, num_proxies), jnp.float32)
    k_p, k_n, k_g = jax.random.split(jax.random.fold_in(key, row), 3)
    return (draw_members(k_p, p, t), draw_members(k_n, n, t),
            gumbel_noise(k_g, (2, t, num_proxies)))
  return jax.vmap(one)(pos, neg, rows)


def gumbel_noise(key: Array, shape) -> Array:
  """Standard Gumbel noise, ``-log(-log(u))``, two 32-bit words per hash.

  The same values as ``jax.random.gumbel(key, shape)`` with
  ``jax_threefry_partitionable`` off (a test checks them bitwise): Threefry
  in counter mode over ``0 .. n - 1`` (``jax.extend.random.threefry_2x32``,
  which turns each pair of counters into two words), the words' top 23 bits
  as ``u`` in ``[0, 1)``, floored at the smallest normal float. JAX's
  default, partitionable, stream hashes one counter pair per word so that a
  sharded array's shards draw independently: twice the arithmetic, which
  for HIER's 26 M draws a step (two LCA choices over 512 proxies for
  25,600 proxy triplets) was 0.34 s of a 0.5 s regulariser on a 2-core CPU.
  HIER's noise is drawn per anchor and never sharded, so it needs no
  partitionable stream.

  Args:
    key: PRNG key (a raw ``uint32[2]`` key or a typed threefry key).
    shape: the output shape.

  Returns:
    float32 array of ``shape``.
  """
  n = math.prod(shape)
  words = jax_random.threefry_2x32(jax.random.key_data(key),
                                   jnp.arange(n, dtype=jnp.uint32))
  one = jnp.uint32(0x3F800000)  # the bits of 1.0: mantissa bits -> [1, 2)
  u = jax.lax.bitcast_convert_type((words >> 9) | one, jnp.float32) - 1.0
  u = jnp.maximum(u, jnp.finfo(jnp.float32).tiny)
  return -jnp.log(-jnp.log(u)).reshape(shape)


def draw_members(key: Array, mask: Array, num: int) -> Array:
  """``num`` indices drawn uniformly with replacement from the True entries
  of ``mask``.

  Each draw is a uniform integer ``u`` below the member count, mapped to the
  position of the ``u``-th member through the mask's cumulative sum: O(N)
  for the mask and O(log N) a draw, where ``jax.random.categorical`` on
  masked logits draws an N-wide Gumbel vector per draw (HIER's proxies: 50
  draws from 512-wide masks for each of 512 anchors, about a third of a
  step's time on a CPU).

  Args:
    key: PRNG key.
    mask: ``[N]`` bool.
    num: the number of draws.

  Returns:
    ``[num]`` int32 indices into ``mask``; with no member, all ``N - 1``
    (callers give such draws zero weight).
  """
  count = jnp.cumsum(mask.astype(jnp.int32))
  u = jax.random.randint(key, (num,), 0, jnp.maximum(count[-1], 1))
  idx = jnp.searchsorted(count, u, side="right")
  return jnp.minimum(idx, mask.shape[0] - 1).astype(jnp.int32)


def _level_loss(key, dist_pts, pos, neg, rows, *, t, delta, tau, use_noise,
                own=True):
  """The triplet loss of the anchors ``rows`` (indices into ``pos``'s
  columns and ``dist_pts``' rows) that this device ``own`` s, ``(sum,
  count)`` of the weighted terms."""
  a = pos.shape[0]
  m = dist_pts.shape[1]
  j, k, g = _sample_triplets(key, pos, neg, rows, t, m)
  valid = (jnp.sum(pos, -1) >= 2) & (jnp.sum(neg, -1) >= 1) & own
  anchors = jnp.repeat(rows, t)
  w = jnp.repeat(valid, t).astype(jnp.float32)
  g = jnp.transpose(g, (1, 0, 2, 3)).reshape(2, a * t, m)
  mean = hier_triplet_loss(dist_pts, anchors, j.reshape(-1), k.reshape(-1),
                           gumbel=g if use_noise else None, weights=w,
                           delta=delta, tau=tau)
  count = jnp.sum(w)
  return mean * count, count


def hier_loss(embeddings: Array, labels: Array, proxies: Array, *,
              key: Optional[Array] = None, delta: float = Hier.delta,
              tau: float = Hier.tau, topk: int = Hier.topk,
              triplets_per_anchor: int = Hier.triplets_per_anchor,
              c: float = Hier.c, r: float = Hier.r,
              num_proxies: int = Hier.num_proxies, embed_inputs: bool = True,
              riemannian: bool = True, self_negative: bool = False,
              pos_mask: Optional[Array] = None,
              neg_mask: Optional[Array] = None, axis_name=None) -> Array:
  r"""HIER's regulariser (module docstring): the samples' triplet loss plus
  the proxies' triplet loss.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16: the head's raw features
      (``embed_inputs``) or points on the ball.
    labels: ``[B]`` integer labels (same class ranks first among the
      neighbours).
    proxies: ``[M, D]`` hierarchical proxies (tangent vectors at 0, mapped
      onto the ball as the features).
    key: PRNG key of the triplet sampling and the Gumbel noise; ``None``:
      no noise and the first ``triplets_per_anchor`` members of each set
      (deterministic; for tests).
    delta: the margin ``delta``.
    tau: the temperature of the LCA choice.
    topk: the neighbourhood of the mutual neighbours (clipped to the batch
      and to ``M``).
    triplets_per_anchor: ``T``, positives and negatives drawn per anchor.
    c: the curvature magnitude of the ball.
    r: the clipping radius of the features and proxies.
    num_proxies: ``M``, checked against ``proxies`` (the initialiser's
      row count).
    embed_inputs: map ``embeddings`` onto the ball (clip, exponential map);
      ``False``: they are already on it.
    riemannian: scale the proxies' gradient by the ball's inverse metric.
    self_negative: the code's negatives, which include the anchor itself.
    pos_mask: optional ``[B, B_global]`` bool, replacing the mutual
      neighbours as the positives of each (local) anchor.
    neg_mask: optional ``[B, B_global]`` bool, replacing the
      non-neighbours as the negatives.
    axis_name: optional mapped axis: the samples' triplets run over the
      global batch (each device its own anchors, the value and gradients
      those of the global batch; the draws are the same for any device
      count).

  Returns:
    float32 scalar: mean over the samples' weighted triplets plus mean over
    the proxies' (each 0 where no anchor has its sets).
  """
  embeddings = checks.check_embeddings(embeddings)
  b, dim = embeddings.shape
  labels = checks.check_labels(labels, b)
  proxies = checks.check_class_vectors(proxies, dim)
  if proxies.shape[0] != num_proxies:
    raise ValueError(f"`proxies` must have `num_proxies` = {num_proxies} "
                     f"rows; got {proxies.shape[0]}.")
  for name in ("topk", "triplets_per_anchor"):
    value = {"topk": topk, "triplets_per_anchor": triplets_per_anchor}[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"`{name}` must be a positive int; got {value!r}.")
  ranges.check_ranges({"delta": delta, "tau": tau}, _RANGES, "hier_loss")
  ball = hyperbolic.Poincare(c=c, r=r)
  z = embeddings.astype(jnp.float32)
  z = ball.embed(z) if embed_inputs else z
  p = ball.embed(proxies.astype(jnp.float32))
  if riemannian:
    p = riemannian_gradient(p, c=c)
  z_all = ops.gather_global(z, axis_name)
  y_all = ops.gather_global(labels, axis_name)
  n = z_all.shape[0]
  offset = reductions.local_row_offset(b, axis_name)
  rows = jnp.arange(b) + offset
  key_x, key_p = (None, None) if key is None else jax.random.split(key)
  eye = jnp.arange(n)[None, :] == rows[:, None]

  # The samples: mutual neighbours of the global batch, local anchors.
  sim = jnp.exp(-ball.distance(z_all, z_all)) + (
      y_all[:, None] == y_all[None, :])
  mutual = jax.lax.dynamic_slice_in_dim(mutual_neighbours(sim, topk),
                                        offset, b)
  pos = mutual if pos_mask is None else checks.check_mask(
      pos_mask, (b, n), "pos_mask") & ~eye
  neg = ~mutual if neg_mask is None else checks.check_mask(
      neg_mask, (b, n), "neg_mask")
  neg = neg if self_negative else neg & ~eye
  d_x = ball.distance(z_all, p)
  s, cnt = _level_loss(key_x, d_x, pos, neg, rows, t=triplets_per_anchor,
                       delta=delta, tau=tau, use_noise=key is not None)
  s = ops.maybe_global_sum(s, axis_name)
  cnt = jax.lax.stop_gradient(ops.maybe_global_sum(cnt, axis_name))
  data = s / jnp.maximum(cnt, 1.0)

  # The proxies: every proxy an anchor; with ``axis_name`` each device
  # counts every n-th (the sums combined as the samples').
  d_p = ball.distance(p, p)
  mutual_p = mutual_neighbours(jnp.exp(-d_p), topk)
  neg_p = ~mutual_p
  if not self_negative:
    neg_p = neg_p & ~jnp.eye(num_proxies, dtype=bool)
  every = jnp.arange(num_proxies)
  own = True if axis_name is None else (
      every % jax.lax.psum(1, axis_name) == jax.lax.axis_index(axis_name))
  s_p, cnt_p = _level_loss(key_p, d_p, mutual_p, neg_p, every,
                           t=triplets_per_anchor, delta=delta, tau=tau,
                           use_noise=key is not None, own=own)
  s_p = ops.maybe_global_sum(s_p, axis_name)
  cnt_p = jax.lax.stop_gradient(ops.maybe_global_sum(cnt_p, axis_name))
  return data + s_p / jnp.maximum(cnt_p, 1.0)


def init_hier_proxies(key, num_classes, embedding_dim, *, num_proxies,
                      r, **hyper):
  """The code's ``N(0, 1) / sqrt(D) * r * 0.9`` of ``[M, D]`` proxies
  (``num_classes`` unused: the proxies are not classes)."""
  del num_classes, hyper
  return (jax.random.normal(key, (num_proxies, embedding_dim), jnp.float32)
          / math.sqrt(embedding_dim) * r * 0.9)


REGISTRY = (
    entries.entry(
        "hier", hier_loss, "proxy", param_name="proxies",
        init=init_hier_proxies, needs_key=True, raw_features=True,
        param_init="`num_proxies` x D, N(0, 1) / sqrt(D) * r * 0.9",
        paper='Kim, Jeong & Kwak, "HIER: Metric Learning Beyond Class '
              'Labels via Hierarchical Regularization", CVPR 2023',
        reduction="mean over the samples' triplets + mean over the "
                  "proxies' triplets"),
)
