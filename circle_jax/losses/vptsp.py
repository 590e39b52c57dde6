r"""VPTSP-G's loss: Proxy-Anchor on proxies mixed with semantic proxies.

Ren et al. (ICLR 2024) keep a learned proxy :math:`w_c` per class (the code's
``proxies_bias``) and a semantic proxy :math:`h_c` per class, generated from
class prompts through the ViT and updated by a GRU
(:mod:`circle_jax.models.semantic_proxies`). The proxy of class :math:`c` in
the loss is their mix

.. math::

  q_c = \frac{\rho\, w_c + (1 - \rho)\, h_c}
             {\lVert \rho\, w_c + (1 - \rho)\, h_c \rVert_2},

with :math:`\rho` the code's ``proxy_bias_ratio`` (0.5 on CUB and Cars,
0.2 on SOP and In-Shop; :math:`w_c` is not normalised before the mix, as in
the code), and the loss is Proxy-Anchor (Kim et al.) of the embeddings
against every :math:`q_c` (the code's ``proxy_data_range='both_all'``):
:func:`circle_jax.losses.proxy_anchor_loss`, whose maths, reduction, masks,
``axis_name`` and empty-set behaviour it inherits.

Why a loss of its own and not a proxy source of ``proxy_anchor``: the second
proxy matrix :math:`H` is produced by the model in the same step (the class
prompts' pass), not a parameter of the loss, so the function takes it as an
argument beside the learned proxies and stays a pure function of arrays.

Difference from the official code: its ``Criterion.forward`` averages the
positive terms over all :math:`C` proxies (``pos_s.mean()``), where
Proxy-Anchor's paper (and this function) averages them over the proxies with
a positive in the batch, :math:`|P^+|`; the code's value is this one's
positive term times :math:`|P^+| / C` (a smaller positive weight when
:math:`C \gg B`). The test transcribes the code and checks that relation.

References:
  Ren, Chen, Wang, Hua, "Learning Semantic Proxies from Visual Prompts for
  Parameter-Efficient Fine-Tuning in Deep Metric Learning", ICLR 2024;
  code: github.com/Noahsark/ParameterEfficient-DML
  (``criteria/dml_proxy_peft.py``, ``architectures/peft_vit.py``).
  Kim, Kim, Cho, Kwak, "Proxy Anchor Loss for Deep Metric Learning", CVPR
  2020.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from circle_jax.losses import checks
from circle_jax.losses import entries
from circle_jax.losses import proxy_anchor as proxy_anchor_lib
from circle_jax.losses import ranges

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Vptsp:
  """VPTSP-G's defaults: the official CUB/Cars ``proxy_bias_ratio`` and
  Proxy-Anchor's margin and scale (the code's ``loss_oproxy_*``)."""

  proxy_bias_ratio: float = 0.5
  margin: float = proxy_anchor_lib.ProxyAnchor.margin
  alpha: float = proxy_anchor_lib.ProxyAnchor.alpha


def mixed_proxies(proxies: Array, semantic_proxies: Array, *,
                  proxy_bias_ratio: float = Vptsp.proxy_bias_ratio) -> Array:
  r"""The unit proxies :math:`q_c` of ``[C, D]`` learned ``proxies`` and
  ``semantic_proxies`` (see the module docstring), float32 ``[C, D]``."""
  proxies = checks.check_matrix(proxies, "proxies", "[num_classes, dim]")
  semantic_proxies = checks.check_matrix(
      semantic_proxies, "semantic_proxies", "[num_classes, dim]")
  if proxies.shape != semantic_proxies.shape:
    raise ValueError(f"`semantic_proxies` {semantic_proxies.shape} must have "
                     f"the shape of `proxies` {proxies.shape}.")
  ranges.check_range(proxy_bias_ratio, "proxy_bias_ratio",
                     ranges.UNIT_INTERVAL)
  rho = jnp.asarray(proxy_bias_ratio, jnp.float32)
  q = (rho * proxies.astype(jnp.float32)
       + (1.0 - rho) * semantic_proxies.astype(jnp.float32))
  return q / jnp.maximum(jnp.linalg.norm(q, axis=-1, keepdims=True), 1e-12)


def vptsp_proxy_anchor_loss(
    embeddings: Array, labels: Array, proxies: Array,
    semantic_proxies: Optional[Array] = None, *,
    proxy_bias_ratio: float = Vptsp.proxy_bias_ratio,
    margin: float = Vptsp.margin, alpha: float = Vptsp.alpha,
    axis_name=None) -> Array:
  r"""Proxy-Anchor against the mixed proxies :math:`q_c` of VPTSP-G.

  .. math::

    L = \frac{1}{|P^+|} \sum_{c \in P^+}
          \log\Big(1 + \sum_{x \in X_c^+} e^{-\alpha (s(x, q_c) - \delta)}\Big)
      + \frac{1}{C} \sum_{c=1}^{C}
          \log\Big(1 + \sum_{x \in X_c^-} e^{\alpha (s(x, q_c) + \delta)}\Big)

  with :math:`q_c` the normalised mix of the learned and semantic proxies
  (module docstring) and :math:`s` the cosine similarity.

  Args:
    embeddings: ``[B, D]`` float embeddings (normalised inside).
    labels: ``[B]`` integer labels in ``[0, C)``; others are ignored.
    proxies: ``[C, D]`` learned proxies :math:`w` (the code's
      ``proxies_bias``).
    semantic_proxies: ``[C, D]`` semantic proxies :math:`H` of this step
      (:meth:`circle_jax.models.semantic_proxies.SemanticProxyNet.mix`); the
      gradient flows into them. None: no semantic branch, plain
      Proxy-Anchor on ``proxies`` (the registry entry's call without the
      trainer's hook, :mod:`circle_jax.train.semantic`).
    proxy_bias_ratio: :math:`\rho \in [0, 1]`; 1 is plain Proxy-Anchor on
      ``proxies``.
    margin: :math:`\delta` (0.1).
    alpha: :math:`\alpha` (32).
    axis_name: optional mapped axis over which the batch is split (see
      :func:`circle_jax.losses.proxy_anchor_loss`; replicated proxies).

  Returns:
    A float32 scalar, the global-batch loss (a mean over proxies, as
    Proxy-Anchor).
  """
  q = proxies if semantic_proxies is None else mixed_proxies(
      proxies, semantic_proxies, proxy_bias_ratio=proxy_bias_ratio)
  return proxy_anchor_lib.proxy_anchor_loss(
      embeddings, labels, q, margin=margin, alpha=alpha, axis_name=axis_name)


def code_proxy_init(key, num_classes, embedding_dim, **hyper):
  """The code's learned proxies (``proxies_bias``): ``xavier_uniform_ / 8``
  of a ``[C, D]`` tensor."""
  return entries.glorot_uniform(key, num_classes, embedding_dim,
                                **hyper) / 8.0


REGISTRY = (
    entries.entry(
        "vptsp_proxy_anchor", vptsp_proxy_anchor_loss, "proxy",
        param_name="proxies", init=code_proxy_init,
        param_init="xavier uniform / 8 (the code's proxies_bias)",
        paper="Ren, Chen, Wang, Hua, \"Learning Semantic Proxies from "
              "Visual Prompts for Parameter-Efficient Fine-Tuning in Deep "
              "Metric Learning\", ICLR 2024",
        reduction="positive term / #proxies with positives + negative "
                  "term / #classes"),
)
