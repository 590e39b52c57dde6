"""Hyp-ViT (Ermolov et al., CVPR 2022) with ViT-S/16: ``hyp_vit.py:DATASET``.

Paper: A. Ermolov, L. Mirvakhabova, V. Khrulkov, N. Sebe, I. Oseledets,
"Hyperbolic Vision Transformers: Combining Improvements in Metric Learning",
CVPR 2022 (arXiv:2203.10833); code: github.com/htdt/hyp_metric (``train.py``,
``model.py`` and the per-dataset commands of its README). The DINO variant is
``hyp_vit_dino.py``.

Published R@1 (%), "Hyp-ViT" (ViT-S/16 pretrained on ImageNet-21k, 128-d,
hyperbolic): checked against the paper's results as listed by Papers with
Code (paperswithcode.com/paper/hyperbolic-vision-transformers-combining);
the other Recall@K columns are not recorded here:

=========  ======
dataset    R@1
=========  ======
cub200     85.6
cars196    86.5
sop        85.9
inshop     92.5
=========  ======

**The loss is the paper's**: Hyp-ViT's pairwise cross-entropy
(``pairwise_ce``, :mod:`circle_jax.losses.pairwise_ce`) on the Poincare ball
of curvature c = 0.1 with feature clipping at radius 2.3, temperature 0.2
(the code's ``--hyp_c``, ``--clip_r``, ``--t``; ``config.loss.c``, ``.r``,
``.tau``). The code sums the cross-entropies over the ordered pairs of
sample slots where ours takes their mean (the loss's docstring): a constant
factor, which AdamW's update ignores up to its epsilon. The head's linear
layer hands its raw output to the ball (no L2 normalisation); evaluation
ranks by cosine on the normalised features, which the clipping makes agree
with the Poincare distance for every clipped feature (docs/losses.md,
"Geometry").

Where to put the weights: export timm's ``vit_small_patch16_224.augreg_in21k_ft_in1k``
(the ImageNet-21k ViT-S/16 the code's ``timm.create_model(
'vit_small_patch16_224', pretrained=True)`` loads) once, in any PyTorch
environment::

  python -c "import timm, safetensors.torch as st; m = timm.create_model('vit_small_patch16_224.augreg_in21k_ft_in1k', pretrained=True, num_classes=0); st.save_file(m.state_dict(), 'vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors')"

and pass the file as ``--config.model.pretrained`` (read without torch).

Launch (one run per dataset; the manual_dir holds the official files listed
in docs/data.md)::

  python -m experiments.main \\
      --config=experiments/configs/hyp_vit.py:cub200 \\
      --workdir=/tmp/hyp_vit_cub200 \\
      --config.dataset.manual_dir=/path/to/cub200 \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors

  python -m experiments.main \\
      --config=experiments/configs/hyp_vit.py:cars196 \\
      --workdir=/tmp/hyp_vit_cars196 \\
      --config.dataset.manual_dir=/path/to/cars196 \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors

  python -m experiments.main \\
      --config=experiments/configs/hyp_vit.py:sop \\
      --workdir=/tmp/hyp_vit_sop \\
      --config.dataset.manual_dir=/path/to/sop \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors

  python -m experiments.main \\
      --config=experiments/configs/hyp_vit.py:inshop \\
      --workdir=/tmp/hyp_vit_inshop \\
      --config.dataset.manual_dir=/path/to/inshop \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors

The code's recipe (``train.py`` defaults and README commands):

* ViT-S/16 (``vit_s16``), class-token feature, a linear layer to 128-d
  (the code initialises it orthogonally; ours Kaiming fan-out), patch
  embedding frozen (``--freeze 0``; ours: no gradient, see
  ``ViT.frozen_patch_embed``); input mean = std = 0.5 (``inception``
  preset; ImageNet's for DINO).
* AdamW, lr 3e-5 (DINO 1e-5), PyTorch's default weight decay 0.01, constant
  rate, gradient norm clipped at 3; mixed precision (apex O2; ours
  bfloat16 compute).
* Batches of 900 images with ``num_samples`` per class: CUB 100 x 9, Cars
  98 x 9 (``--bs 882``, which runs on a device count dividing 882: 1, 2, 3,
  6, 7, 9, ...), SOP and In-Shop 450 x 2.
* Epochs (each class once per epoch, so ``train classes // classes per
  batch`` steps): CUB 50 (50 steps), Cars 300 (300), SOP 200 (25 x 200 =
  5,000), In-Shop 400 (8 x 400 = 3,200); evaluated once, at the end.
* Train: random-resized crop 224 of scale (0.2, 1), horizontal flip (the
  code's crop is bicubic, ours bilinear). Eval: resize 256 (CUB) or 224
  (others), centre crop 224.
* No validation hold-out and no model selection (the code evaluates the last
  epoch only): ``validation_fraction = 0``, ``best_metric = ''``; the
  result is the final step's test metrics.
"""

from __future__ import annotations

from circle_jax import config as config_lib
from circle_jax import data as data_lib
from experiments.configs import recipes

DATASETS = ("cub200", "cars196", "sop", "inshop")
CONFIG_FILE = "hyp_vit.py"
TIMM_MODEL = "vit_small_patch16_224.augreg_in21k_ft_in1k"
FAMILY = "augreg"
LEARNING_RATE = 3e-5

# The paper's loss settings (train.py: --t, --hyp_c, --clip_r).
HYP_LOSS = {"tau": 0.2, "geometry": "poincare", "c": 0.1, "r": 2.3}
EMBEDDING_DIM = 128
# dataset -> (classes per batch, images per class, epochs, eval resize).
BATCHES = {
    "cub200": (100, 9, 50, 256),
    "cars196": (98, 9, 300, 224),
    "sop": (450, 2, 200, 224),
    "inshop": (450, 2, 400, 224),
}

PUBLISHED = {
    "cub200": {"recall@1": 85.6},
    "cars196": {"recall@1": 86.5},
    "sop": {"recall@1": 85.9},
    "inshop": {"recall@1": 92.5},
}


def pretrained_path(timm_model: str = TIMM_MODEL) -> str:
  """The placeholder of the exported weights in the launch commands."""
  return f"/path/to/{timm_model}.safetensors"


def launch_command(config_file: str, dataset: str,
                   timm_model: str = TIMM_MODEL) -> str:
  """The one-line command that trains ``config_file`` on ``dataset``."""
  stem = config_file[:-3]
  return (f"python -m experiments.main "
          f"--config=experiments/configs/{config_file}:{dataset} "
          f"--workdir=/tmp/{stem}_{dataset} "
          f"--config.dataset.manual_dir={recipes.MANUAL_DIRS[dataset]} "
          f"--config.model.pretrained={pretrained_path(timm_model)}")


def steps(dataset: str) -> int:
  """The code's epochs in steps: ``train classes // classes per batch`` per
  epoch."""
  classes, _, epochs, _ = BATCHES[dataset]
  train_classes = data_lib.get_dataset_info(dataset).num_train_classes
  return train_classes // classes * epochs


def hyp_vit_recipe(dataset: str, *, config_file: str, family: str,
                   learning_rate: float):
  """The Hyp-ViT code's recipe (module docstring) for a ViT-S/16 family."""
  recipes.check_dataset(config_file, dataset, DATASETS)
  c = recipes.vit_base(dataset, model="vit_s16", family=family,
                       embedding_dim=EMBEDDING_DIM)
  c.model.kwargs.frozen_patch_embed = True
  classes, per_class, _, resize = BATCHES[dataset]
  c.dataset.preprocess.resize_size = resize
  c.dataset.preprocess.scale = (0.2, 1.0)
  c.batch.sampler = "pk"
  c.batch.classes_per_batch = classes
  c.batch.images_per_class = per_class
  c.optim.name = "adamw"
  c.optim.learning_rate = learning_rate
  c.optim.weight_decay = 0.01
  c.optim.schedule = "constant"
  c.optim.grad_clip_norm = 3.0
  c.num_train_steps = steps(dataset)
  c.eval_every_steps = 0
  c.checkpoint_every_steps = max(c.num_train_steps // 10, 1)
  c.loss = config_lib.loss_config("pairwise_ce", **HYP_LOSS)
  return c


def get_config(dataset: str = "cub200"):
  """Hyp-ViT's recipe with ViT-S/16 (ImageNet-21k) and its hyperbolic loss.

  Args:
    dataset: one of :data:`DATASETS`.

  Returns:
    The training config.
  """
  return hyp_vit_recipe(dataset, config_file=CONFIG_FILE, family=FAMILY,
                        learning_rate=LEARNING_RATE)
