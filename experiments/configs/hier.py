"""HIER on Proxy-Anchor with ViT-S/16 at 384-d: ``hier.py:DATASET``.

Paper: S. Kim, B. Jeong, S. Kwak, "HIER: Metric Learning Beyond Class Labels
via Hierarchical Regularization", CVPR 2023 (arXiv:2212.14258); code:
github.com/tjddus9597/HIER-CVPR23 (``hier/train.py``, ``hier/losses.py``,
``hier/utils.py`` and ``scripts/ViT/hier_*.sh``).

Published R@1 (%), "HIER" on Proxy-Anchor, ViT-S/16 (ImageNet-21k), 384-d
embeddings, from the results table of the official README (its
``misc/table.png``); the other Recall@K columns are not recorded here:

=========  ======
dataset    R@1
=========  ======
cub200     85.7
cars196    88.3
sop        86.1
inshop     92.8
=========  ======

**The loss**: Proxy-Anchor (``proxy_anchor``, margin 0.1, alpha 32, the
code's ``PALoss_Angle``) plus 0.5 x HIER (``config.more_losses.hier``,
:mod:`circle_jax.losses.hier`: 512 hierarchical proxies on the Poincare ball
c = 0.1 clipped at 2.3, margin 0.1, mutual top-20 neighbours, 50 triplets
per anchor; the scripts' ``--lambda2 0.5 --num_hproxies 512 --hyp_c 0.1
--clip_r 2.3 --topk 20 --mrg 0.1``). HIER is a term of ``more_losses``
because it adds to any loss with its own learnable parameters: they lie at
``params['loss']['more_losses']['hier']['proxies']``, so the path prefix
``loss/more_losses/hier`` gives them their own learning rate. With HIER among
the losses the head hands raw features (``LossEntry.raw_features``): HIER
maps them onto the ball, Proxy-Anchor takes their cosine.

Where to put the weights: as ``hyp_vit.py`` (the same timm model,
``vit_small_patch16_224.augreg_in21k_ft_in1k``, which the code's
``timm.create_model('vit_small_patch16_224', pretrained=True)`` loads).

Launch (one run per dataset)::

  python -m experiments.main \\
      --config=experiments/configs/hier.py:cub200 \\
      --workdir=/tmp/hier_cub200 \\
      --config.dataset.manual_dir=/path/to/cub200 \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors

  python -m experiments.main \\
      --config=experiments/configs/hier.py:cars196 \\
      --workdir=/tmp/hier_cars196 \\
      --config.dataset.manual_dir=/path/to/cars196 \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors

  python -m experiments.main \\
      --config=experiments/configs/hier.py:sop \\
      --workdir=/tmp/hier_sop \\
      --config.dataset.manual_dir=/path/to/sop \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors

  python -m experiments.main \\
      --config=experiments/configs/hier.py:inshop \\
      --workdir=/tmp/hier_inshop \\
      --config.dataset.manual_dir=/path/to/inshop \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k_ft_in1k.safetensors

The code's recipe (``scripts/ViT/hier_*.sh`` on 2 GPUs, ``train.py``):

* ViT-S/16, class token, patch embedding frozen, a linear layer to the
  embedding (the code puts an affine-free LayerNorm before it; ours has
  none), input mean = std = 0.5; random-resized crop 224 of scale (0.2, 1)
  and flip; eval resize 256, centre crop 224.
* Embedding: 384-d as the README's table. The scripts pass ``--emb 128``
  (512 for In-Shop), the table's other rows.
* Batches of 180 (90 per GPU x 2), 2 images per class (``--IPC 2``,
  ``UniqueClassSampler``): 90 classes x 2. An epoch is ``train images //
  180`` steps; 100 epochs on CUB and Cars, 150 on SOP and In-Shop.
* AdamW, lr 1e-5 (x 180 / 180), constant; weight decay 1e-2 (CUB, Cars) or
  1e-4 (SOP, In-Shop) on every group; epsilon 1e-4 (the code's with fp16;
  ours bfloat16); multipliers: the linear layer x1 (x100 on SOP and In-Shop,
  ``--fc_lr_scale 1e2``), Proxy-Anchor's proxies x1e4, HIER's x50; the
  backbone at lr 0 for the first 1 (CUB, Cars) or 5 (SOP, In-Shop) epochs;
  every gradient value clipped at 10 (``clip_gradients_value``).
* The code evaluates on the test split every epoch and reports its best;
  like ``hyp_vit.py`` we train on all train classes and report the last step
  (``validation_fraction = 0``, ``best_metric = ''``).
"""

from __future__ import annotations

from circle_jax import config as config_lib
from circle_jax import data as data_lib
from experiments.configs import hyp_vit
from experiments.configs import recipes

DATASETS = ("cub200", "cars196", "sop", "inshop")
CONFIG_FILE = "hier.py"
EMBEDDING_DIM = 384
BATCH, IMAGES_PER_CLASS = 180, 2
LEARNING_RATE = 1e-5
HIER_WEIGHT = 0.5
# The path prefix of HIER's proxies (config.more_losses key "hier").
HIER_PREFIX = "loss/more_losses/hier"
# dataset -> (epochs, warm-up epochs, weight decay, head multiplier).
SCRIPTS = {
    "cub200": (100, 1, 1e-2, 1.0),
    "cars196": (100, 1, 1e-2, 1.0),
    "sop": (150, 5, 1e-4, 100.0),
    "inshop": (150, 5, 1e-4, 100.0),
}

PUBLISHED = {
    "cub200": {"recall@1": 85.7},
    "cars196": {"recall@1": 88.3},
    "sop": {"recall@1": 86.1},
    "inshop": {"recall@1": 92.8},
}


def steps_per_epoch(dataset: str) -> int:
  """The code's epoch: ``train images // 180`` batches."""
  return data_lib.get_dataset_info(dataset).num_images["train"] // BATCH


def get_config(dataset: str = "cub200"):
  """HIER + Proxy-Anchor with ViT-S/16 at 384-d (module docstring).

  Args:
    dataset: one of :data:`DATASETS`.

  Returns:
    The training config.
  """
  recipes.check_dataset(CONFIG_FILE, dataset, DATASETS)
  c = hyp_vit.hyp_vit_recipe(dataset, config_file=CONFIG_FILE,
                             family=hyp_vit.FAMILY,
                             learning_rate=LEARNING_RATE)
  epochs, warmup, weight_decay, head = SCRIPTS[dataset]
  per_epoch = steps_per_epoch(dataset)
  c.model.embedding_dim = EMBEDDING_DIM
  c.dataset.preprocess.resize_size = 256
  c.batch.classes_per_batch = BATCH // IMAGES_PER_CLASS
  c.batch.images_per_class = IMAGES_PER_CLASS
  c.optim.weight_decay = weight_decay
  c.optim.eps = 1e-4
  c.optim.grad_clip_norm = 0.0
  c.optim.grad_clip_value = 10.0
  c.optim.freeze_backbone_steps = warmup * per_epoch
  c.optim.lr_multipliers.head = head
  c.optim.lr_multipliers.loss = 1e4
  c.optim.lr_multipliers[HIER_PREFIX] = 50.0
  c.num_train_steps = epochs * per_epoch
  c.checkpoint_every_steps = per_epoch * 10
  c.loss = config_lib.loss_config("proxy_anchor")
  c.more_losses.hier = config_lib.more_loss("hier", weight=HIER_WEIGHT)
  return c
