"""Pair-similarity and proxy losses for deep metric learning.

Every loss is a pure function of embeddings (or of a similarity/distance
matrix) and integer labels: jit- and vmap-able, float32 compute, a float32
scalar out. Pair-based losses take ``axis_name`` to see the global batch
across devices. See :mod:`circle_jax.losses.checks` for the shared conventions,
:mod:`circle_jax.losses.engine` for how the pair losses' rules are run
(dense, blockwise, device ring) and the keywords they share, and
:mod:`circle_jax.ops` for the public numerical building blocks.
"""

from circle_jax.losses.engine import (
    Candidates,
)

from circle_jax.losses.circle import (
    circle_loss,
    circle_loss_from_similarity,
    circle_loss_class_level,
    unified_loss,
    unified_loss_from_similarity,
    unified_loss_class_level,
)
from circle_jax.losses.multi_similarity import (
    multi_similarity_loss,
    multi_similarity_loss_from_similarity,
    multi_similarity_weights,
)
from circle_jax.losses.gpw import (
    pair_weights,
)
from circle_jax.losses.ranked_list import (
    ranked_list_loss,
    ranked_list_loss_from_distance,
    ranked_list_loss_from_similarity,
)
from circle_jax.losses.proxy_anchor import (
    proxy_anchor_loss,
    proxy_anchor_loss_from_similarity,
    ranked_proxy_anchor_loss,
    ranked_proxy_anchor_loss_from_distance,
)
from circle_jax.losses.checks import (
    validate_labels,
)
from circle_jax.losses.contrastive import (
    contrastive_loss,
    contrastive_loss_from_distance,
)
from circle_jax.losses.supcon import (
    supcon_loss,
)
from circle_jax.losses.nt_xent import (
    nt_xent_loss,
)
from circle_jax.losses.pairwise_ce import (
    pairwise_ce_loss,
)
from circle_jax.losses.pairwise_sigmoid import (
    pairwise_sigmoid_loss,
)
from circle_jax.losses.smooth_ap import (
    smooth_ap_loss,
)
from circle_jax.losses.fastap import (
    fastap_loss,
)
from circle_jax.losses.recall_at_k import (
    recall_at_k_loss,
    simix,
    simix_pairs,
)
from circle_jax.losses.hyperbolic import (
    Poincare,
)
from circle_jax.losses.triplet import (
    triplet_margin_loss,
    triplet_margin_loss_from_distance,
)
from circle_jax.losses.lifted_structure import (
    lifted_structure_loss,
    lifted_structure_loss_from_distance,
)
from circle_jax.losses.n_pair import (
    n_pair_loss,
    n_pair_loss_from_similarity,
)
from circle_jax.losses.margin import (
    margin_loss,
    margin_loss_from_distance,
)
from circle_jax.losses.proxy_baselines import (
    proxy_nca_loss,
    soft_triple_loss,
)
from circle_jax.losses.classification import (
    normface_loss,
    cosface_loss,
    arcface_loss,
    subcenter_arcface_loss,
    subcenter_arcface_outliers,
    softmax_loss,
    subspace_arcface_loss,
    subspace_indices,
)
from circle_jax.losses.class_shard import (
    pad_rows,
)
from circle_jax.losses.miners import (
    multi_similarity_miner,
    batch_hard_miner,
    semi_hard_miner,
    pair_margin_miner,
    distance_weighted_miner,
)
from circle_jax.losses.registry import (
    LOSSES,
    HyperRange,
    LossEntry,
    get_loss,
    hyper_ranges,
    loss_table_markdown,
    validate_hyper,
)
from circle_jax.losses.nca import nca_loss
from circle_jax.losses.angular import angular_loss
from circle_jax.losses.generalized_lifted_structure import (
    generalized_lifted_structure_loss,
)
from circle_jax.losses.intra_pair_variance import intra_pair_variance_loss
from circle_jax.losses.engine import SNR, Lp
from circle_jax.losses.snr_contrastive import snr_contrastive_loss
from circle_jax.losses.tuplet_margin import tuplet_margin_loss
from circle_jax.losses.large_margin import (
    large_margin_softmax_loss,
    sphereface_loss,
)
from circle_jax.losses.p2s_grad import (
    p2s_grad_loss,
)
from circle_jax.losses.vicreg import (
    vicreg_loss,
    vicreg_loss_of_views,
)
from circle_jax.losses.tcm import (
    threshold_consistent_margin_loss,
)
from circle_jax.losses.pnp import (
    pnp_loss,
)
from circle_jax.losses.manifold import (
    manifold_loss,
)
from circle_jax.losses.instance import instance_loss
from circle_jax.losses.histogram import histogram_loss
from circle_jax.losses.dynamic_soft_margin import (
    dynamic_soft_margin_loss,
    dynamic_soft_margin_step,
)
from circle_jax.losses import regularizers
from circle_jax.losses.regularizers import (
    center_invariant_regularizer,
    lp_regularizer,
    regular_face_regularizer,
    sparse_centers_regularizer,
    zero_mean_regularizer,
)
from circle_jax.losses import combine
from circle_jax.losses.combine import (
    Term,
    multiple_losses,
    self_supervised_loss,
)
from circle_jax.losses.miner_registry import (
    MINERS,
    get_miner,
)
from circle_jax.losses.pml_miners import (
    angular_miner,
    batch_easy_hard_miner,
    hdc_miner,
    triplet_margin_miner,
    uniform_histogram_miner,
)
from circle_jax.losses.potential_field import (
    PotentialField,
    potential_field_loss,
)
from circle_jax.losses.hier import (
    hier_loss,
    hier_triplet_loss,
)
