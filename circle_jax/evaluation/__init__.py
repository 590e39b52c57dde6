"""Retrieval and clustering evaluation on device.

* :func:`retrieval_metrics`: exact Recall@K, P@1, R-Precision and MAP@R by
  cosine similarity, chunked and sharded over devices.
* :func:`clustering_metrics`: k-means (k-means++ init) in JAX, then NMI/AMI.
"""

from circle_jax.evaluation.retrieval import (
    DEFAULT_KS,
    default_ks,
    retrieval_metrics,
)
from circle_jax.evaluation.clustering import (
    KMeansResult,
    clustering_metrics,
    kmeans,
    mutual_information_scores,
)
