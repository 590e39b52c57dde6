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


def dist64(x):
  u = l2n(x)
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
  d = dist64(x)
  pos_terms, neg_terms = [], []
  for i in range(len(y)):
    pos, neg = _pairs(y, i, pos_mask, neg_mask)
    pos_terms += [max(0.0, d[i, j] - pos_margin) for j in pos]
    neg_terms += [max(0.0, neg_margin - d[i, j]) for j in neg]
  return _mean_nonzero(pos_terms) + _mean_nonzero(neg_terms)


def triplet_ref(x, y, margin, mining, pos_mask=None, neg_mask=None):
  d = dist64(x)
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
  d = dist64(x)
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
  d = dist64(x)
  total, count = 0.0, 0
  for i in range(len(y)):
    pos, neg_i = _pairs(y, i, pos_mask, neg_mask)
    for j in pos:
      _, neg_j = _pairs(y, j, pos_mask, neg_mask)
      terms = [margin - d[i, k] for k in neg_i] + [margin - d[j, l]
                                                   for l in neg_j]
      if terms:
        total += max(0.0, logsumexp(terms) + d[i, j]) ** 2
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
  d = dist64(x)
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


def poincare_ref(x, c, r):
  """Clip, exponential map at 0 and hyptorch's projection, float64."""
  x = np.asarray(x, np.float64)
  n = np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-5)
  x = x * np.minimum(1.0, r / n)
  n = np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-5)
  z = np.tanh(np.sqrt(c) * n) * x / (np.sqrt(c) * n)
  n = np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-5)
  top = (1 - 1e-3) / np.sqrt(c)
  return np.where(n > top, z / n * top, z)


def mobius_distance_ref(a, b, c):
  """Hyp-ViT's form: 2/sqrt(c) artanh(sqrt(c) |(-a) (+)_c b|), float64."""
  x = -np.asarray(a, np.float64)[:, None, :]
  y = np.asarray(b, np.float64)[None, :, :]
  xy, x2, y2 = (x * y).sum(-1), (x * x).sum(-1), (y * y).sum(-1)
  num = (1 + 2 * c * xy + c * y2)[..., None] * x + (1 - c * x2)[..., None] * y
  add = num / (1 + 2 * c * xy + c * c * x2 * y2)[..., None]
  return 2 / np.sqrt(c) * np.arctanh(np.sqrt(c) * np.linalg.norm(add, axis=-1))


def similarity_ref(x, cols=None, geometry="cosine", c=0.1, r=2.3):
  cols = x if cols is None else cols
  if geometry == "cosine":
    return cos(x, cols)
  return -mobius_distance_ref(poincare_ref(x, c, r), poincare_ref(cols, c, r),
                              c)


def masks_ref(y, col_y=None, pos_mask=None, neg_mask=None):
  """Same / other label, no self pair (when the columns are the batch)."""
  col_y = y if col_y is None else col_y
  same = y[:, None] == col_y[None, :]
  usable = np.ones_like(same)
  if col_y is y:
    np.fill_diagonal(usable, False)
  pos, neg = same & usable, ~same & usable
  if pos_mask is not None:
    pos, neg = pos & pos_mask, neg & neg_mask
  return pos, neg


def supcon_ref(s, pos, neg, tau, pair_mean=False):
  total, count = 0.0, 0
  for i in range(len(s)):
    p, a = np.flatnonzero(pos[i]), np.flatnonzero(pos[i] | neg[i])
    if not len(p):
      continue
    terms = [logsumexp(s[i, a] / tau) - s[i, j] / tau for j in p]
    total += sum(terms) if pair_mean else np.mean(terms)
    count += len(p) if pair_mean else 1
  return total / max(count, 1)


def sigmoid_ref(s, pos, neg, t, b):
  total = 0.0
  for i in range(len(s)):
    total += sum(softplus(-(t * s[i, j] + b)) for j in np.flatnonzero(pos[i]))
    total += sum(softplus(t * s[i, j] + b) for j in np.flatnonzero(neg[i]))
  return total / len(s)


def loss_ref(name, x, y, hyper, cols=None, col_y=None, pos_mask=None,
             neg_mask=None):
  geo = {k: hyper[k] for k in ("geometry", "c", "r") if k in hyper}
  if name == "pairwise_ce":
    geo.setdefault("geometry", "poincare")
  s = similarity_ref(x, cols, **geo)
  pos, neg = masks_ref(y, col_y, pos_mask, neg_mask)
  if name == "pairwise_sigmoid":
    return sigmoid_ref(s, pos, neg, hyper.get("t", 10.0), hyper.get("b", -10.0))
  tau = hyper.get("tau", 0.2 if name == "pairwise_ce" else 0.1)
  return supcon_ref(s, pos, neg, tau, pair_mean=name != "supcon")


def unit64(x):
  x = np.asarray(x, np.float64)
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def ranking_sets(y, col_y, i, pos_mask, neg_mask, self_pairs):
  """Anchor ``i``'s positives and candidates (lists of column indices)."""
  pos, cand = [], []
  for k in range(len(col_y)):
    if self_pairs and k == i:
      continue
    if col_y[k] == y[i] and (pos_mask is None or pos_mask[i, k]):
      pos.append(k)
      cand.append(k)
    elif col_y[k] != y[i] and (neg_mask is None or neg_mask[i, k]):
      cand.append(k)
  return pos, cand


def smooth_ap_ref(x, y, tau, pos_mask=None, neg_mask=None, cols=None,
                  col_y=None):
  """Brown et al.'s Smooth-AP, every (i, j, k) by hand, float64."""
  rows = unit64(x)
  self_pairs = cols is None
  cols, col_y = (rows, y) if self_pairs else (unit64(cols), col_y)
  s = rows @ cols.T
  sig = lambda v: 0.5 * (1.0 + np.tanh(0.5 * v))  # no overflow
  total, count = 0.0, 0
  for i in range(len(y)):
    pos, cand = ranking_sets(y, col_y, i, pos_mask, neg_mask, self_pairs)
    if not pos:
      continue
    ap = 0.0
    for j in pos:
      num = 1.0 + sum(sig((s[i, k] - s[i, j]) / tau) for k in pos if k != j)
      den = 1.0 + sum(sig((s[i, k] - s[i, j]) / tau) for k in cand if k != j)
      ap += num / den
    total += 1.0 - ap / len(pos)
    count += 1
  return total / max(count, 1)


def fastap_ref(x, y, L, pos_mask=None, neg_mask=None, cols=None, col_y=None):
  """Cakir et al.'s FastAP: triangular histograms by hand, float64."""
  rows = unit64(x)
  self_pairs = cols is None
  cols, col_y = (rows, y) if self_pairs else (unit64(cols), col_y)
  d = np.clip(2.0 - 2.0 * rows @ cols.T, 0.0, 4.0)
  delta = 4.0 / L
  total, count = 0.0, 0
  for i in range(len(y)):
    pos, cand = ranking_sets(y, col_y, i, pos_mask, neg_mask, self_pairs)
    if not pos:
      continue
    h_pos, h_all = np.zeros(L + 1), np.zeros(L + 1)
    for l in range(L + 1):
      for k in cand:
        pulse = max(0.0, 1.0 - abs(d[i, k] - l * delta) / delta)
        h_all[l] += pulse
        h_pos[l] += pulse if k in pos else 0.0
    ap, cum_pos, cum_all = 0.0, 0.0, 0.0
    for l in range(L + 1):
      cum_pos += h_pos[l]
      cum_all += h_all[l]
      if cum_all > 0:
        ap += h_pos[l] * cum_pos / cum_all
    total += 1.0 - ap / len(pos)
    count += 1
  return total / max(count, 1)
