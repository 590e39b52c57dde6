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


def anchor_sets(s, labels, i, pos_mask=None, neg_mask=None, col_y=None):
  """Anchor i's positive and negative similarities; with reference columns
  (labels ``col_y``, ``s`` of shape [B, M]) no column is the anchor itself."""
  cols = labels if col_y is None else col_y
  sp, sn = [], []
  for j in range(len(cols)):
    if cols[j] == labels[i] and (col_y is not None or j != i):
      if pos_mask is None or pos_mask[i, j]:
        sp.append(s[i, j])
    elif cols[j] != labels[i]:
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


def ref_pair_loss(anchor_fn, s, labels, pos_mask=None, neg_mask=None, *,
                  col_y=None, **hyper):
  losses = []
  for i in range(len(labels)):
    sp, sn = anchor_sets(s, labels, i, pos_mask, neg_mask, col_y)
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
  return _sets(y, i, y, True, pos_mask, neg_mask)


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


def _sets(y, i, col_y, batch, pos_mask, neg_mask):
  """Anchor ``i``'s positive and negative columns (no self pair when the
  columns are the batch): :func:`ranking_sets`' positives, and its other
  candidates."""
  pos, cand = ranking_sets(y, col_y, i, pos_mask, neg_mask, self_pairs=batch)
  return pos, [k for k in cand if col_y[k] != y[i]]


def lifted_ref_ordered(x, y, margin, pos_mask=None, neg_mask=None, *,
                       cols=None, col_y=None):
  """Eq. 4 over ordered positive pairs; with reference columns ``cols``
  (labels ``col_y``) the column is no anchor: no column term."""
  a = l2n(x)
  c = a if cols is None else l2n(cols)
  col_y = y if col_y is None else col_y

  def dist(u, v):
    return float(np.sqrt(np.sum((u - v) ** 2)))

  total, count = 0.0, 0
  for i in range(len(y)):
    pos, neg_i = _sets(y, i, col_y, cols is None, pos_mask, neg_mask)
    for j in pos:
      terms = [margin - dist(a[i], c[k]) for k in neg_i]
      if cols is None:  # the column is an anchor too: its negatives
        _, neg_j = _sets(y, j, y, True, pos_mask, neg_mask)
        terms += [margin - dist(a[j], a[k]) for k in neg_j]
      if terms:
        total += max(0.0, logsumexp(terms) + dist(a[i], c[j])) ** 2
      count += 1
  return 0.5 * total / count if count else 0.0


def n_pair_ref(x, y, l2_reg, pos_mask=None, neg_mask=None, *, cols=None,
               col_y=None):
  """Sohn's tuplet term per positive pair, mean, plus the L2 penalty of the
  anchors; ``cols`` / ``col_y``: reference columns instead of the batch."""
  f = np.asarray(x, np.float64)
  c = f if cols is None else np.asarray(cols, np.float64)
  col_y = y if col_y is None else col_y
  terms = []
  for a in range(len(y)):
    pos, neg = _sets(y, a, col_y, cols is None, pos_mask, neg_mask)
    if not neg:
      continue
    for p in pos:
      terms.append(np.log1p(sum(np.exp(f[a] @ c[n] - f[a] @ c[p])
                                for n in neg)))
  tuplet = sum(terms) / len(terms) if terms else 0.0
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


def mined_sets(s, labels, i, epsilon, mining=True, pos_mask=None,
               neg_mask=None, col_y=None):
  """Indices of anchor i's (mined) positives and negatives; with reference
  columns (labels ``col_y``) no column is the anchor itself."""
  cols = labels if col_y is None else col_y
  n = len(cols)
  pos = [j for j in range(n) if cols[j] == labels[i]
         and (col_y is not None or j != i)
         and (pos_mask is None or pos_mask[i, j])]
  neg = [j for j in range(n) if cols[j] != labels[i]
         and (neg_mask is None or neg_mask[i, j])]
  if mining:
    if not pos or not neg:
      return [], []
    min_pos = min(s[i, j] for j in pos)
    max_neg = max(s[i, j] for j in neg)
    neg, pos = ([j for j in neg if s[i, j] + epsilon > min_pos],
                [j for j in pos if s[i, j] - epsilon < max_neg])
  return pos, neg


def ref_ms(s, labels, alpha=2.0, beta=50.0, base=0.5, epsilon=0.1,
           mining=True, pos_mask=None, neg_mask=None, col_y=None):
  total = 0.0
  for i in range(len(labels)):
    pos, neg = mined_sets(s, labels, i, epsilon, mining, pos_mask, neg_mask,
                          col_y)
    if not pos or not neg:
      continue
    sp, sn = s[i, pos], s[i, neg]
    total += np.log(1 + np.sum(np.exp(-alpha * (sp - base)))) / alpha
    total += np.log(1 + np.sum(np.exp(beta * (sn - base)))) / beta
  return total / len(labels)


def ref_ms_weights(s, labels, alpha=2.0, beta=50.0, base=0.5, epsilon=0.1,
                   mining=True):
  """The paper's closed-form w+_ij, w-_ij, literally (no 1/B)."""
  n = len(labels)
  w_pos, w_neg = np.zeros((n, n)), np.zeros((n, n))
  for i in range(n):
    pos, neg = mined_sets(s, labels, i, epsilon, mining)
    if not pos or not neg:
      continue
    for j in pos:
      w_pos[i, j] = 1.0 / (np.exp(alpha * (s[i, j] - base)) +
                           sum(np.exp(alpha * (s[i, j] - s[i, k]))
                               for k in pos))
    for j in neg:
      w_neg[i, j] = 1.0 / (np.exp(-beta * (s[i, j] - base)) +
                           sum(np.exp(beta * (s[i, k] - s[i, j]))
                               for k in neg))
  return w_pos, w_neg


def rll_reference(dist, labels, *, alpha, margin, t_neg, t_pos, imbalance,
                  pos_mask=None, neg_mask=None):
  """Float64 RLL value and dL/dd (normalised weights held constant)."""
  dist = np.asarray(dist, np.float64)
  labels = np.asarray(labels)
  b = len(labels)
  total = 0.0
  grad = np.zeros_like(dist)
  for i in range(b):
    pos_j, pos_h, neg_j, neg_h = [], [], [], []
    for j in range(b):
      if labels[j] == labels[i]:
        if j == i or (pos_mask is not None and not pos_mask[i, j]):
          continue
        if dist[i, j] > alpha - margin:
          pos_j.append(j)
          pos_h.append(dist[i, j] - (alpha - margin))
      else:
        if neg_mask is not None and not neg_mask[i, j]:
          continue
        if dist[i, j] < alpha:
          neg_j.append(j)
          neg_h.append(alpha - dist[i, j])
    total += ((1 - imbalance) * _weighted_mean(pos_h, t_pos)
              + imbalance * _weighted_mean(neg_h, t_neg))
    for js, hs, t, sign, lam in ((pos_j, pos_h, t_pos, 1.0, 1 - imbalance),
                                 (neg_j, neg_h, t_neg, -1.0, imbalance)):
      if js:
        h = np.array(hs)
        w = np.exp(t * h - np.max(t * h))
        grad[i, js] += sign * lam * (w / w.sum()) / b
  return total / b, grad


def pa_reference(sim, labels, *, margin, alpha):
  """Float64 Proxy-Anchor value and dL/ds (the paper's eq. 4 gradient)."""
  sim = np.asarray(sim, np.float64)
  b, c = sim.shape
  pos_terms, neg_total = [], 0.0
  grad = np.zeros_like(sim)
  with_pos = sum(1 for p in range(c) if _members(labels, p, c)[0])
  for p in range(c):
    pos, neg = _members(labels, p, c)
    if pos:
      z = -alpha * (sim[pos, p] - margin)
      pos_terms.append(np.logaddexp(0.0, logsumexp(z)))
      grad[pos, p] = (-alpha * np.exp(z - np.logaddexp(0.0, logsumexp(z)))
                      / with_pos)
    if neg:
      z = alpha * (sim[neg, p] + margin)
      neg_total += np.logaddexp(0.0, logsumexp(z))
      grad[neg, p] = alpha * np.exp(z - np.logaddexp(0.0, logsumexp(z))) / c
  return sum(pos_terms) / max(len(pos_terms), 1) + neg_total / c, grad


def rpal_reference(dist, labels, *, alpha, margin, t_neg):
  """Float64 RPAL value and dL/dd (normalised weights held constant)."""
  dist = np.asarray(dist, np.float64)
  b, c = dist.shape
  grad = np.zeros_like(dist)
  with_pos = [p for p in range(c) if _members(labels, p, c)[0]]
  pos_total, neg_total = 0.0, 0.0
  for p in range(c):
    pos, neg = _members(labels, p, c)
    hard_pos = [i for i in pos if dist[i, p] > alpha - margin]
    hard_neg = [i for i in neg if dist[i, p] < alpha]
    if hard_pos:
      pos_total += np.mean(dist[hard_pos, p] - (alpha - margin))
      grad[hard_pos, p] = 1.0 / (len(hard_pos) * len(with_pos))
    if hard_neg:
      h = alpha - dist[hard_neg, p]
      w = np.exp(t_neg * h - np.max(t_neg * h))
      neg_total += np.sum(w * h) / np.sum(w)
      grad[hard_neg, p] = -(w / w.sum()) / c
  return pos_total / max(len(with_pos), 1) + neg_total / c, grad


def softmax_ref(x, y, w, bias=None):
  logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  if bias is not None:
    logits = logits + bias
  return _mean_ce(logits, y)


def cosface_ref(x, y, w, margin, scale):
  c = cos(x, w)
  logits = []
  for i in range(len(y)):
    l = scale * c[i].copy()
    l[y[i]] = scale * (c[i, y[i]] - margin)
    logits.append(l)
  return _mean_ce(logits, y)


def arcface_ref(x, y, w, margin, scale, easy_margin=False):
  c = np.clip(cos(x, w), -1, 1)
  logits = []
  for i in range(len(y)):
    l = scale * c[i].copy()
    cy = c[i, y[i]]
    theta = np.arccos(cy)
    if easy_margin:
      target = np.cos(theta + margin) if cy > 0 else cy
    elif theta + margin <= np.pi:
      target = np.cos(theta + margin)
    else:
      target = cy - margin * np.sin(margin)
    l[y[i]] = scale * target
    logits.append(l)
  return _mean_ce(logits, y)


def proxy_nca_ref(x, y, proxies, scale, include_positive):
  xn, pn = l2n(x), l2n(proxies)
  out = []
  for i in range(len(y)):
    d = scale * ((xn[i] - pn) ** 2).sum(1)  # squared distances, directly
    others = [-d[c] for c in range(len(pn))
              if include_positive or c != y[i]]
    out.append(d[y[i]] + logsumexp(others) if others else 0.0)
  return float(np.mean(out))


def soft_triple_reg_ref(centers, k):
  w = l2n(centers)
  c = len(w) // k
  total = 0.0
  for cls in range(c):
    for t in range(k):
      for s in range(t + 1, k):
        total += np.sqrt(2 + 1e-5 - 2 * w[cls * k + t] @ w[cls * k + s])
  return total / (c * k * (k - 1))


def soft_triple_ref(x, y, centers, k, la, gamma, margin, tau):
  xn, w = l2n(x), l2n(centers)
  c = len(w) // k
  out = []
  for i in range(len(y)):
    s_class = np.zeros(c)
    for cls in range(c):
      sims = np.array([xn[i] @ w[cls * k + t] for t in range(k)])
      a = np.exp(sims / gamma - (sims / gamma).max())
      s_class[cls] = (a / a.sum()) @ sims
    logits = la * s_class
    logits[y[i]] -= la * margin
    out.append(logsumexp(logits) - logits[y[i]])
  reg = soft_triple_reg_ref(centers, k) if (tau > 0 and k > 1) else 0.0
  return float(np.mean(out)) + tau * reg


def _mean_ce(all_logits, y):
  return float(np.mean([logsumexp(l) - l[t]
                        for l, t in zip(all_logits, y)]))


def _members(labels, p, num_classes):
  pos = [b for b in range(len(labels)) if labels[b] == p]
  neg = [b for b in range(len(labels))
         if 0 <= labels[b] < num_classes and labels[b] != p]
  return pos, neg


def _weighted_mean(hinges, t):
  """sum_j w_j h_j / sum_j w_j with w_j = exp(t h_j); 0 for an empty list."""
  if not hinges:
    return 0.0
  h = np.array(hinges, np.float64)
  w = np.exp(t * h - np.max(t * h))
  return float(np.sum(w * h) / np.sum(w))


# The `reduction` option: per-element terms written as loops, and the
# reducers on them (PML's semantics, circle_jax.losses.engine.reductions).

def reduce_ref(sets, labels, kind, low=None, high=None, weights=None,
               divisor=1.0):
  """``kind`` of the terms ``sets = ((terms, elements), ...)`` (``[M]``
  anchor or ``[M, N]`` pair terms, a term in its anchor's row): each set
  reduced on its own, the results added; ``"none"``: the terms, 0 outside
  the elements."""
  if kind == "none":
    return sum(np.where(e, t, 0.0) for t, e in sets)
  total = 0.0
  for t, e in sets:
    t = np.where(e, np.asarray(t, np.float64), 0.0)
    keep = np.asarray(e, bool)
    if kind == "avg_non_zero":
      keep = keep & (t > 0)
    elif kind == "threshold":
      keep = keep & (t > (-np.inf if low is None else low))
      keep = keep & (t < (np.inf if high is None else high))
    elif kind == "class_weighted":
      w = np.asarray(weights)[np.asarray(labels)]
      t = t * w.reshape((-1,) + (1,) * (t.ndim - 1))
    if kind == "sum":
      total += t.sum()
    elif kind == "divisor":
      total += t.sum() / divisor if divisor else 0.0
    else:
      total += t[keep].sum() / keep.sum() if keep.any() else 0.0
  return total


def pair_masks_ref(y):
  """``(pos, neg)`` ``[B, B]`` bool of a batch's own pairs (no self pair)."""
  y = np.asarray(y)
  same = y[:, None] == y[None, :]
  return same & ~np.eye(len(y), dtype=bool), ~same


def n_pair_terms_ref(x, y):
  """Sohn's tuplet term of each positive pair (0 for an anchor without a
  negative), on inner products: the ``[B, B]`` positive set."""
  f = np.asarray(x, np.float64)
  pos, neg = pair_masks_ref(y)
  t = np.zeros(pos.shape)
  for a, p in zip(*np.nonzero(pos)):
    if neg[a].any():
      t[a, p] = np.log1p(np.exp(f[a] @ f[neg[a]].T - f[a] @ f[p]).sum())
  return ((t, pos),)


def tcm_terms_ref(x, y, lambda_plus=1.0, lambda_minus=1.0, margin_plus=0.9,
                  margin_minus=0.5):
  """TCM's pair terms: ``lambda_+ (m_+ - s)`` of the positives with ``s <=
  m_+``, ``lambda_- (s - m_-)`` of the negatives with ``s >= m_-`` (0 for
  the others)."""
  s = cos(x)
  pos, neg = pair_masks_ref(y)
  t_p = np.where(s <= margin_plus, lambda_plus * (margin_plus - s), 0.0)
  t_n = np.where(s >= margin_minus, lambda_minus * (s - margin_minus), 0.0)
  return ((t_p, pos), (t_n, neg))


def nt_xent_terms_ref(x, y, tau):
  """NT-Xent's term of each positive pair ``(i, p)``: ``LSE_{k != i}
  s_ik / tau - s_ip / tau`` (cosine)."""
  s = cos(x) / tau
  pos, _ = pair_masks_ref(y)
  t = np.zeros(pos.shape)
  for i, p in zip(*np.nonzero(pos)):
    t[i, p] = logsumexp(np.delete(s[i], i)) - s[i, p]
  return ((t, pos),)


def margin_terms_ref(x, y, beta, margin, nu):
  """The margin loss's pair terms (all pairs, weight 1): ``[d - beta_a +
  m]_+ + nu beta_a`` of the positives, ``[beta_a - d + m]_+`` of the
  negatives, ``beta_a`` the anchor's class's."""
  d = dist64(x)
  pos, neg = pair_masks_ref(y)
  b = np.asarray(beta, np.float64)[np.asarray(y)][:, None]
  return ((np.maximum(d - b + margin, 0.0) + nu * b, pos),
          (np.maximum(b - d + margin, 0.0), neg))


def per_anchor_ref(loss_ref, x, y, **kw):
  """``[B]`` per-anchor terms of a reference that averages over its anchors
  with a positive: each anchor's is the loss with only its row's pairs
  (miner masks that keep row ``i``)."""
  terms = np.zeros(len(y))
  for i in range(len(y)):
    row = np.zeros((len(y), len(y)), bool)
    row[i] = True
    terms[i] = loss_ref(x, y, pos_mask=row, neg_mask=row, **kw)
  return terms
