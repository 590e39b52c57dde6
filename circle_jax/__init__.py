"""circle_jax: deep metric learning in JAX/Flax.

Subpackages:
  ops         shared numerics: l2_normalize, cosine similarity, masked
              reductions, global_sum / gather_global across devices.
  losses      pure, jit/vmap-able pair-similarity and proxy losses.
  evaluation  Recall@K, P@1, R-Precision, MAP@R, NMI/AMI on device.
  data        tfds builders, P x K samplers and grain input pipelines.
  models      Flax backbones and embedding heads.
  train       TrainState, optimisers, checkpointing and the training loop.
"""

__version__ = "0.1.0"
