"""Analyses of trained or untrained losses and embeddings.

* :mod:`circle_jax.analysis.pair_plane`: one similarity pair ``(s_n, s_p)``
  fed to the losses (values, gradients, traced decision boundaries);
* :mod:`circle_jax.analysis.pairs`: statistics of a split's positive and
  negative pair similarities (histograms, overlap, hardest pairs).
"""
