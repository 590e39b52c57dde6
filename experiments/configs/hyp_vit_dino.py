"""Hyp-ViT's DINO variant ("Hyp-DINO", ViT-S/16): ``hyp_vit_dino.py:DATASET``.

Paper and code: as ``hyp_vit.py`` (Ermolov, Mirvakhabova, Khrulkov, Sebe,
Oseledets, "Hyperbolic Vision Transformers: Combining Improvements in Metric
Learning", CVPR 2022; github.com/htdt/hyp_metric), with the self-supervised
DINO ViT-S/16 (Caron et al., "Emerging Properties in Self-Supervised Vision
Transformers", ICCV 2021) as the backbone: the code's ``--model
dino_vits16 --lr 1e-5``, ImageNet mean and std. Everything else is
``hyp_vit.py``'s recipe, including the paper's loss: the hyperbolic
pairwise cross-entropy (``pairwise_ce`` on the Poincare ball, c = 0.1,
r = 2.3, temperature 0.2; see ``hyp_vit.py``).

Published R@1 (%), "Hyp-DINO" (128-d, hyperbolic), checked against the
paper's results as listed by Papers with Code
(paperswithcode.com/paper/hyperbolic-vision-transformers-combining):

=========  ======
dataset    R@1
=========  ======
cub200     80.9
cars196    89.2
sop        85.1
inshop     92.4
=========  ======

Where to put the weights: export timm's ``vit_small_patch16_224.dino`` (the
DINO ViT-S/16 the code loads from torch.hub as ``dino_vits16``)::

  python -c "import timm, safetensors.torch as st; m = timm.create_model('vit_small_patch16_224.dino', pretrained=True, num_classes=0); st.save_file(m.state_dict(), 'vit_small_patch16_224.dino.safetensors')"

Launch (one run per dataset)::

  python -m experiments.main \\
      --config=experiments/configs/hyp_vit_dino.py:cub200 \\
      --workdir=/tmp/hyp_vit_dino_cub200 \\
      --config.dataset.manual_dir=/path/to/cub200 \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.dino.safetensors

  python -m experiments.main \\
      --config=experiments/configs/hyp_vit_dino.py:cars196 \\
      --workdir=/tmp/hyp_vit_dino_cars196 \\
      --config.dataset.manual_dir=/path/to/cars196 \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.dino.safetensors

  python -m experiments.main \\
      --config=experiments/configs/hyp_vit_dino.py:sop \\
      --workdir=/tmp/hyp_vit_dino_sop \\
      --config.dataset.manual_dir=/path/to/sop \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.dino.safetensors

  python -m experiments.main \\
      --config=experiments/configs/hyp_vit_dino.py:inshop \\
      --workdir=/tmp/hyp_vit_dino_inshop \\
      --config.dataset.manual_dir=/path/to/inshop \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.dino.safetensors
"""

from __future__ import annotations

from experiments.configs import hyp_vit

DATASETS = hyp_vit.DATASETS
CONFIG_FILE = "hyp_vit_dino.py"
TIMM_MODEL = "vit_small_patch16_224.dino"
FAMILY = "dino"
LEARNING_RATE = 1e-5

PUBLISHED = {
    "cub200": {"recall@1": 80.9},
    "cars196": {"recall@1": 89.2},
    "sop": {"recall@1": 85.1},
    "inshop": {"recall@1": 92.4},
}


def get_config(dataset: str = "cub200"):
  """Hyp-ViT's recipe with the DINO ViT-S/16 and its hyperbolic loss.

  Args:
    dataset: one of :data:`DATASETS`.

  Returns:
    The training config.
  """
  return hyp_vit.hyp_vit_recipe(dataset, config_file=CONFIG_FILE,
                                family=FAMILY, learning_rate=LEARNING_RATE)
