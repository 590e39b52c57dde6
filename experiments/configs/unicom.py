"""Unicom fine-tuning (An et al., ICLR 2023) with ViT-B/16: ``unicom.py:DATASET``.

Paper: X. An, J. Deng, K. Yang, J. Li, Z. Feng, J. Guo, J. Yang, T. Liu,
"Unicom: Universal and Compact Representation Learning for Image Retrieval",
ICLR 2023; code: github.com/deepglint/unicom (``unicom/retrieval.py``,
``unicom/partial_fc.py`` and ``unicom/scripts/{sop,inshop}_vit_b_16.sh``).

Published R@1 (%), supervised fine-tuning of the LAION-pretrained ViT-B/16
(the README's "Result of Supervised Image Retrieval" table; its other
columns, ViT-B/32 / ViT-L/14 / ViT-L/14@336px, are SOP 87.1 / 89.9 / 91.2
and In-Shop 94.8 / 96.0 / 96.7; CUB and Cars have zero-shot numbers only,
so no recipe here):

=========  ======
dataset    R@1
=========  ======
sop        88.8
inshop     95.5
=========  ======

**The loss is the paper's**: ``subspace_arcface``
(:func:`circle_jax.losses.subspace_arcface_loss`): ArcFace with s = 32,
m = 0.25 through PartialFC (``sample_rate`` 1: every class), each step on a
random 512 of the 768 feature dimensions (the scripts' ``--num_feat 512
--output_dim 768``), with the code's straight-through margin gradient.

Weights: Unicom's own LAION-400M checkpoint (``FP16-ViT-B-16.pt`` of the
code's ``unicom.load('ViT-B/16')``) ends in a head this library's ViT does
not have (all patch tokens flattened, Linear, BatchNorm, Linear, BatchNorm),
so it cannot be loaded yet. The launch commands start from the nearest
loadable weights instead, OpenAI's CLIP ViT-B/16 (timm
``vit_base_patch16_clip_224.openai``, the same input normalisation),
exported once in any PyTorch environment::

  python -c "import timm, safetensors.torch as st; m = timm.create_model('vit_base_patch16_clip_224.openai', pretrained=True, num_classes=0); st.save_file(m.state_dict(), 'vit_base_patch16_clip_224.openai.safetensors')"

and passed as ``--config.model.pretrained``: this is the Unicom fine-tuning
recipe on CLIP weights, not a reproduction of the published number.

Launch (one run per dataset; the manual_dir holds the official files listed
in docs/data.md)::

  python -m experiments.main \\
      --config=experiments/configs/unicom.py:sop \\
      --workdir=/tmp/unicom_sop \\
      --config.dataset.manual_dir=/path/to/sop \\
      --config.model.pretrained=/path/to/vit_base_patch16_clip_224.openai.safetensors

  python -m experiments.main \\
      --config=experiments/configs/unicom.py:inshop \\
      --workdir=/tmp/unicom_inshop \\
      --config.dataset.manual_dir=/path/to/inshop \\
      --config.model.pretrained=/path/to/vit_base_patch16_clip_224.openai.safetensors

The code's recipe (the two scripts and ``retrieval.py``):

* ViT-B/16 at 224 pixels, a 768-d embedding (ours: the ViT's class token
  and a linear head to 768-d).
* AdamW, lr 1e-5, weight decay 0, the PartialFC class matrix at 10 x the
  rate (``--lr_pfc_weight 10``: ``optim.lr_multipliers.loss``).
* ``OneCycleLR`` with ``pct_start`` 0.1: warm-up over 10 % of the steps,
  then cosine annealing to lr / 2.5e5 (ours: a linear warm-up from 0, then
  cosine to the same end).
* Random batches (a shuffled ``DistributedSampler``, not P x K): SOP 64 on
  one GPU; In-Shop 16 per GPU on 4 GPUs, 64 in all.
* Epochs: SOP 64, In-Shop 128, of ``images // batch + 1`` steps each.
* Augmentation: SOP ``--transform origin_clip``, CLIP's eval transform for
  training too (resize the shorter side, centre crop; ours: the whole-area
  crop and a flip, the nearest our presets have); In-Shop timm's
  RandAugment, colour jitter and random erasing (not in our presets: ours is
  the random-resized crop and flip).
* Evaluation: the code keeps the first 512 dimensions of the normalised
  embedding and reports the best epoch on the test split; ours ranks on the
  whole 768-d embedding, and no model selection (``best_metric = ''``, the
  final step's test metrics).
"""

from __future__ import annotations

from circle_jax import config as config_lib
from experiments.configs import hyp_vit
from experiments.configs import recipes

DATASETS = ("sop", "inshop")
CONFIG_FILE = "unicom.py"
TIMM_MODEL = "vit_base_patch16_clip_224.openai"
FAMILY = "clip"
EMBEDDING_DIM = 768
LEARNING_RATE = 1e-5
PFC_LR_MULTIPLIER = 10.0
# The scripts' ArcFace and subspace (--margin_loss_s, _m2, --num_feat).
UNICOM_LOSS = {"scale": 32.0, "margin": 0.25, "num_features": 512}
# dataset -> (global batch, epochs).
BATCHES = {"sop": (64, 64), "inshop": (64, 128)}

PUBLISHED = {
    "sop": {"recall@1": 88.8},
    "inshop": {"recall@1": 95.5},
}


def steps(dataset: str) -> int:
  """The code's ``epochs * (images // batch + 1)``."""
  batch, epochs = BATCHES[dataset]
  return epochs * (recipes.train_images(dataset) // batch + 1)


def launch_command(dataset: str) -> str:
  """The one-line command that trains the recipe on ``dataset``."""
  return hyp_vit.launch_command(CONFIG_FILE, dataset, TIMM_MODEL)


def get_config(dataset: str = "sop"):
  """Unicom's fine-tuning recipe (module docstring) with ViT-B/16.

  Args:
    dataset: one of :data:`DATASETS`.

  Returns:
    The training config.
  """
  recipes.check_dataset(CONFIG_FILE, dataset, DATASETS)
  c = recipes.vit_base(dataset, model="vit_b16", family=FAMILY,
                       embedding_dim=EMBEDDING_DIM)
  c.dataset.preprocess.resize_size = 224
  if dataset == "sop":  # origin_clip: no random crop (module docstring)
    c.dataset.preprocess.scale = (1.0, 1.0)
  batch, _ = BATCHES[dataset]
  c.batch.sampler = "random"
  c.batch.size = batch
  c.optim.name = "adamw"
  c.optim.learning_rate = LEARNING_RATE
  c.optim.weight_decay = 0.0
  c.optim.lr_multipliers.loss = PFC_LR_MULTIPLIER
  c.num_train_steps = steps(dataset)
  c.optim.schedule = "cosine"
  c.optim.lr_warmup_steps = c.num_train_steps // 10
  c.optim.cosine_final_fraction = 1.0 / 2.5e5  # OneCycleLR: 1/25 * 1/1e4
  c.eval_every_steps = 0
  c.checkpoint_every_steps = max(c.num_train_steps // 10, 1)
  c.loss = config_lib.loss_config("subspace_arcface", **UNICOM_LOSS)
  return c
