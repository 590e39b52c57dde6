r"""Potential Field DML (Bhatnagar, Ahuja, CVPR 2025), a rule plus proxies.

Every embedding (and every proxy) is a charge whose field *decays* with
distance: same-class charges attract, other classes' repel, and the loss is
the total potential energy of the batch in the superposed field. The pair
part is a rule (:class:`PotentialField`, the ``"sum"`` statistic with its
own reduction), so it runs on every engine (dense, blockwise, ring); the
proxy part is the same rule between the samples and the ``[C, D]`` proxies
(one per class), dense (``O(B C)``, like the proxy losses).

No public code exists; the paper's text fixes the shape (decaying
attraction ``-1 / d^\alpha`` and repulsion ``+1 / d^\alpha``, proxies as
further charges, minimise the total energy) and leaves the details open.
What we chose, and why:

* ``d`` is the geometry's distance (cosine: ``\sqrt{2 - 2 \cos}`` of unit
  vectors, in ``[0, 2]``), as the pair losses here read distances.
* A softening ``\delta > 0``: ``\phi(d) = (d + \delta)^{-\alpha}`` instead
  of ``d^{-\alpha}``, so the energy is bounded (``1/d^\alpha`` is
  ``-\infty`` for coinciding positives: the loss would have no minimum and
  its gradient no bound); the field still decays (its force
  ``\alpha (d + \delta)^{-\alpha - 1}`` falls with ``d``).
* Each side is averaged over its pairs (the energy per positive and per
  negative pair) rather than summed, so the balance of attraction and
  repulsion does not move with the batch's P x K composition; the
  repulsion is weighted by ``\lambda_{rep}``.
* Proxies: one per class, charges of their class; each sample feels its
  class's proxy (attraction) and the others' (repulsion), the same
  potentials, weighted by ``\lambda_{proxy}``. Proxy-proxy energy is left
  out (it does not involve the data; a regulariser can add it).

The defaults (``\alpha = 1``, ``\delta = 0.5``, ``\lambda_{rep} = 1``,
``\lambda_{proxy} = 1``) are ours: the paper's values were not available to
us (no code, and the paper's text was not read in full here).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp

from circle_jax.losses import checks
from circle_jax.losses import engine
from circle_jax.losses import entries
from circle_jax.losses import ranges

Array = jax.Array


@engine.rule_dataclass()
class PotentialField(engine.PairSetMeans):
  """PFML's pair energies: per anchor, the sums and counts of
  ``-\\phi(d)`` over its positives and ``\\phi(d)`` over its negatives,
  ``\\phi(d) = (d + \\delta)^{-\\alpha}``, reduced to global per-pair means
  (the repulsion weighted by ``lambda_rep``). Its fields are the loss's
  defaults (module docstring).

  Attributes:
    alpha: ``\\alpha > 0``, the decay exponent of both potentials.
    delta: ``\\delta > 0``, the softening distance.
    lambda_rep: ``\\lambda_{rep} \\ge 0``, the weight of the repulsion.
  """

  alpha: float = 1.0
  delta: float = 0.5
  lambda_rep: float = 1.0

  pair_terms = True
  ranges = types.MappingProxyType({
      "alpha": ranges.POSITIVE_RANGE,
      "delta": ranges.POSITIVE_RANGE,
      "lambda_rep": ranges.NONNEGATIVE_RANGE})

  def prepare(self, s):
    return self.geometry.to_distance(s)

  def values(self, d):
    phi = (d + self.delta) ** (-self.alpha)
    return -phi, phi

  def side_weights(self):
    return 1.0, self.lambda_rep


def potential_field_loss(embeddings: Array, labels: Array, proxies: Array, *,
                         alpha: float = PotentialField.alpha,
                         delta: float = PotentialField.delta,
                         lambda_rep: float = PotentialField.lambda_rep,
                         lambda_proxy: float = 1.0,
                         **options) -> Array:
  r"""PFML: the potential energy of the batch and the proxies (Bhatnagar,
  Ahuja 2025).

  With ``\phi(d) = (d + \delta)^{-\alpha}`` on the geometry's distances
  ``d`` (cosine: Euclidean distances of the L2-normalised vectors), ``P``
  and ``N`` the positive and negative ordered pairs of the batch, ``p_c``
  the proxy of class ``c``:

  .. math::

    E(Z) = -\frac{1}{|P|} \sum_{(i,j) \in P} \phi(d_{ij})
        + \frac{\lambda_{rep}}{|N|} \sum_{(i,j) \in N} \phi(d_{ij}),
    \qquad
    L = E(\text{batch}) + \lambda_{proxy}\, E(\text{batch vs. proxies}),

  the second energy over the (sample, own proxy) pairs ``|B|`` and the
  (sample, other proxy) pairs ``|B| (C - 1)``. An empty side adds 0 (and
  zero gradient). The choices the paper leaves open (softening, per-pair
  means, one proxy per class, no proxy-proxy term) are the module
  docstring's.

  The batch part runs on every engine (``block_size``, ``collective``);
  ``ref`` replaces the batch as its candidates (the proxy part keeps the
  batch), ``pos_mask`` / ``neg_mask`` and ``reduction`` apply to it only.
  The proxies are the whole matrix on every device.

  Args:
    embeddings: ``[B, D]`` float32 or bfloat16.
    labels: ``[B]`` integer labels in ``[0, C)``, or ``[B, C]`` multi-hot
      (a sample's proxies are those of all its classes).
    proxies: ``[C, D]`` learnable proxies, one per class.
    alpha: ``\alpha > 0``, the potentials' decay exponent.
    delta: ``\delta > 0``, the softening distance.
    lambda_rep: ``\lambda_{rep} \ge 0``, the repulsion's weight.
    lambda_proxy: ``\lambda_{proxy} \ge 0``, the proxy energy's weight.
    **options: the pair losses' shared keywords, documented once at
      :func:`circle_jax.losses.engine.embedding_loss`.

  Returns:
    float32 scalar.

  References:
    Bhatnagar, Ahuja, "Potential Field Based Deep Metric Learning", CVPR
    2025 (arXiv:2405.18560); project page
    shubhangb97.github.io/potential_field_DML. No public code.
  """
  ranges.check_range(lambda_proxy, "lambda_proxy", ranges.NONNEGATIVE_RANGE)
  rule = engine.with_geometry(
      PotentialField(alpha=alpha, delta=delta, lambda_rep=lambda_rep),
      engine.resolve_geometry(options.get("geometry")))
  x = checks.check_embeddings(embeddings)
  y = checks.check_labels(labels, x.shape[0], multi_hot=True)
  proxies = checks.check_class_vectors(proxies, x.shape[1])
  pairs = engine.embedding_loss(rule, embeddings, labels, **options)
  g = rule.geometry
  s = g.tile(g.embed(x), g.embed(proxies))
  classes = proxies.shape[0]
  if y.ndim == 2:  # multi-hot: each of the sample's classes is positive
    pos = jnp.pad(y, ((0, 0), (0, max(classes - y.shape[1], 0))))[:, :classes]
  else:
    pos = y[:, None] == jnp.arange(classes, dtype=y.dtype)[None, :]
  per_anchor, valid = engine.dense_per_anchor(rule, s, pos, ~pos)
  to_proxies = engine.reduce_per_anchor(rule, per_anchor, valid,
                                        options.get("axis_name"))
  return pairs + lambda_proxy * to_proxies


REGISTRY = (
    entries.entry("potential_field", potential_field_loss, "pair",
        param_name="proxies", rule=PotentialField,
        init=entries.normal(1.0), param_init="normal, std 1 (ours)",
        paper="Bhatnagar, Ahuja, \"Potential Field Based Deep Metric "
              "Learning\", CVPR 2025 (no public code; details ours)",
        reduction="mean attraction over positive pairs + lambda_rep x "
                  "mean repulsion over negative pairs, for the batch and "
                  "(x lambda_proxy) for the samples against the proxies"),
)
