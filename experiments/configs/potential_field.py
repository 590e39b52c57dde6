"""Potential Field DML (Bhatnagar, Ahuja, CVPR 2025) with ViT-S/16:
``potential_field.py:DATASET``.

Paper: S. Bhatnagar, N. Ahuja, "Potential Field Based Deep Metric
Learning", CVPR 2025 (arXiv:2405.18560); project page
shubhangb97.github.io/potential_field_DML. No public code.

Published R@1 (%), ViT-S at 384-d (the authors' project page; the other
Recall@K columns are not recorded here):

=========  ======
dataset    R@1
=========  ======
cub200     87.8
cars196    91.5
sop        88.2
=========  ======

**The loss is ours, from the paper's description**: ``potential_field``
(:func:`circle_jax.losses.potential_field_loss`): decaying attraction and
repulsion potentials between the samples and between the samples and one
proxy per class; the softening, the per-pair means and the defaults
(``alpha`` 1, ``delta`` 0.5) are our choices (the module docstring says
why), so this recipe is not expected to give the published numbers as is.

**The recipe is ours too** (no code to read): Hyp-ViT's ViT-S/16 recipe
(``hyp_vit.py``: ImageNet-21k ViT-S/16, class token, AdamW 3e-5, weight
decay 0.01, gradient norm clipped at 3, its batches, epochs and crops, no
model selection), the common setting of the ViT-S rows PFML compares with,
with a 384-d embedding and the proxies at 100 x the learning rate (the
proxy losses' convention, Proxy-Anchor's). Weights: export timm's
``vit_small_patch16_224.augreg_in21k_ft_in1k`` once, in any PyTorch
environment::

  python -c "import timm, safetensors.torch as st; m = timm.create_model('vit_small_patch16_224.augreg_in21k_ft_in1k', pretrained=True, num_classes=0); st.save_file(m.state_dict(), 'vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors')"

Launch (one run per dataset; the manual_dir holds the official files listed
in docs/data.md)::

  python -m experiments.main \\
      --config=experiments/configs/potential_field.py:cub200 \\
      --workdir=/tmp/potential_field_cub200 \\
      --config.dataset.manual_dir=/path/to/cub200 \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors

  python -m experiments.main \\
      --config=experiments/configs/potential_field.py:cars196 \\
      --workdir=/tmp/potential_field_cars196 \\
      --config.dataset.manual_dir=/path/to/cars196 \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors

  python -m experiments.main \\
      --config=experiments/configs/potential_field.py:sop \\
      --workdir=/tmp/potential_field_sop \\
      --config.dataset.manual_dir=/path/to/sop \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors
"""

from __future__ import annotations

from circle_jax import config as config_lib
from experiments.configs import hyp_vit
from experiments.configs import recipes

DATASETS = ("cub200", "cars196", "sop")
CONFIG_FILE = "potential_field.py"
TIMM_MODEL = hyp_vit.TIMM_MODEL
EMBEDDING_DIM = 384
PROXY_LR_MULTIPLIER = 100.0

PUBLISHED = {
    "cub200": {"recall@1": 87.8},
    "cars196": {"recall@1": 91.5},
    "sop": {"recall@1": 88.2},
}


def get_config(dataset: str = "cub200"):
  """The recipe of the module docstring on ``dataset`` (one of
  :data:`DATASETS`); the launch command is
  ``hyp_vit.launch_command(CONFIG_FILE, dataset, TIMM_MODEL)``."""
  recipes.check_dataset(CONFIG_FILE, dataset, DATASETS)
  c = hyp_vit.hyp_vit_recipe(dataset, config_file=CONFIG_FILE,
                             family=hyp_vit.FAMILY,
                             learning_rate=hyp_vit.LEARNING_RATE)
  c.model.embedding_dim = EMBEDDING_DIM
  c.optim.lr_multipliers.loss = PROXY_LR_MULTIPLIER
  c.loss = config_lib.loss_config("potential_field")
  return c
