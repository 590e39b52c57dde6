"""The float64 references of the losses, written naively (one anchor at a
time), and the numpy helpers they share. One reference per loss: the tests
import it from here."""

import numpy as np


def l2n(x):
  """Float64 L2 normalisation; zero rows stay zero."""
  x = np.asarray(x, np.float64)
  n = np.sqrt((x * x).sum(-1, keepdims=True))
  return x / np.maximum(n, 1e-12)


def cos(a, b=None):
  """Float64 cosine-similarity matrix."""
  a = l2n(a)
  b = a if b is None else l2n(b)
  return a @ b.T


def logsumexp(v):
  """log(sum(exp(v))) of a 1-D float64 vector; -inf when empty."""
  v = np.asarray(v, np.float64)
  if v.size == 0:
    return -np.inf
  m = v.max()
  return m + np.log(np.exp(v - m).sum())


def softplus(x):
  return np.logaddexp(0.0, x)


def anchor_sets(s, labels, i, pos_mask=None, neg_mask=None):
  sp, sn = [], []
  for j in range(len(labels)):
    if labels[j] == labels[i] and j != i:
      if pos_mask is None or pos_mask[i, j]:
        sp.append(s[i, j])
    elif labels[j] != labels[i]:
      if neg_mask is None or neg_mask[i, j]:
        sn.append(s[i, j])
  return np.array(sp, np.float64), np.array(sn, np.float64)


def ref_circle_anchor(sp, sn, margin, gamma):
  alpha_p = np.maximum(1 + margin - sp, 0.0)
  alpha_n = np.maximum(sn + margin, 0.0)
  lse_p = logsumexp(-gamma * alpha_p * (sp - (1 - margin)))
  lse_n = logsumexp(gamma * alpha_n * (sn - margin))
  return softplus(lse_n + lse_p)


def ref_unified_anchor(sp, sn, margin, gamma):
  # The double sum of eq. (1), literally.
  terms = [gamma * (n - p + margin) for n in sn for p in sp]
  return softplus(logsumexp(terms))


def ref_pair_loss(anchor_fn, s, labels, pos_mask=None, neg_mask=None, **hyper):
  losses = []
  for i in range(len(labels)):
    sp, sn = anchor_sets(s, labels, i, pos_mask, neg_mask)
    if sp.size and sn.size:
      losses.append(anchor_fn(sp, sn, **hyper))
  return float(np.mean(losses)) if losses else 0.0


def ref_class_level(anchor_fn, x, labels, w, **hyper):
  s = cos(x, w)
  losses = []
  for i, y in enumerate(labels):
    sn = np.array([s[i, j] for j in range(w.shape[0]) if j != y])
    losses.append(anchor_fn(np.array([s[i, y]]), sn, **hyper))
  return float(np.mean(losses))
