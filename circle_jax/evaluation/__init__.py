"""Retrieval and clustering evaluation on device.

* :func:`retrieval_metrics`: exact Recall@K, P@1, R-Precision and MAP@R by
  cosine similarity, chunked and sharded over devices.
* :func:`clustering_metrics`: k-means (k-means++ init) in JAX, then NMI/AMI.
* :func:`fewshot_accuracy` / :func:`fewshot_metrics`: episodic N-way K-shot
  classification (prototypes or 1-NN), mean accuracy and its 95% CI.
* :mod:`circle_jax.evaluation.omniglot_oneshot`: the official Omniglot
  20-way one-shot runs (Lake et al. 2015) of a trained workdir.
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
from circle_jax.evaluation.fewshot import (
    CLASSIFIERS,
    Episodes,
    FewShotResult,
    fewshot_accuracy,
    fewshot_metrics,
)
