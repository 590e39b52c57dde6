"""Float64 numpy helpers shared by the loss references in the tests."""

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
