"""VPTSP-G (Ren et al., ICLR 2024), ViT-S/16, 384-d: ``vptsp_g.py:DATASET``.

Paper: L. Ren, C. Chen, L. Wang, K. Hua, "Learning Semantic Proxies from
Visual Prompts for Parameter-Efficient Fine-Tuning in Deep Metric Learning",
ICLR 2024 (arXiv:2402.02340); code: github.com/Noahsark/ParameterEfficient-DML
(``config/*_small.yaml``, ``params.py``, ``main.py``,
``architectures/peft_vit.py``, ``criteria/dml_proxy_peft.py``).

Published R@1 (%), VPTSP-G with ViT-S/16 (ImageNet-21k) at 384-d, from the
official code's README ("Proposed Results in Table 2"):

=========  ======
dataset    R@1
=========  ======
cub200     86.6
cars196    87.7
sop        84.4
inshop     91.2
=========  ======

**What this recipe trains**: VPTSP-G. The frozen ViT with deep visual
prompts (``model.kwargs.num_prompts``, ``prompt_depth``, ``prompt_step``),
BitFit (``tune='bitfit'``: every bias trains, nothing else of the trunk),
the new LayerNorm before the linear head (``head_norm``); the semantic
proxies: each image passed a second time through the ViT with its class's
prompts, a proxy head and a GRU updating a ``[C, E]`` memory of semantic
proxies carried from step to step (``config.semantic_proxies``, from
:data:`SEMANTIC`; :mod:`circle_jax.train.semantic`,
:mod:`circle_jax.models.semantic_proxies`), and the loss
``vptsp_proxy_anchor`` (:func:`circle_jax.losses.vptsp.vptsp_proxy_anchor_loss`:
Proxy-Anchor, margin 0.1, alpha 32, on the ``proxy_bias_ratio`` mix of the
learned and the semantic proxies). Its positive term is averaged over the
proxies with positives, as Proxy-Anchor's paper; the code averages it over
all ``C`` proxies (named in that module).

Where to put the weights: export timm's ``vit_small_patch16_224.augreg_in21k``
(the code's ``vit_small_patch16_224_in21k`` under timm 0.9.16) once, in any
PyTorch environment::

  python -c "import timm, safetensors.torch as st; m = timm.create_model('vit_small_patch16_224.augreg_in21k', pretrained=True, num_classes=0); st.save_file(m.state_dict(), 'vit_small_patch16_224.augreg_in21k.safetensors')"

Launch (one run per dataset; the manual_dir holds the official files listed
in docs/data.md)::

  python -m experiments.main \\
      --config=experiments/configs/vptsp_g.py:cub200 \\
      --workdir=/tmp/vptsp_g_cub200 \\
      --config.dataset.manual_dir=/path/to/cub200 \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k.safetensors

  python -m experiments.main \\
      --config=experiments/configs/vptsp_g.py:cars196 \\
      --workdir=/tmp/vptsp_g_cars196 \\
      --config.dataset.manual_dir=/path/to/cars196 \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k.safetensors

  python -m experiments.main \\
      --config=experiments/configs/vptsp_g.py:sop \\
      --workdir=/tmp/vptsp_g_sop \\
      --config.dataset.manual_dir=/path/to/sop \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k.safetensors

  python -m experiments.main \\
      --config=experiments/configs/vptsp_g.py:inshop \\
      --workdir=/tmp/vptsp_g_inshop \\
      --config.dataset.manual_dir=/path/to/inshop \\
      --config.model.pretrained=/path/to/vit_small_patch16_224.augreg_in21k.safetensors

The code's recipe (``config/<dataset>_small.yaml`` over ``params.py``'s
defaults; :data:`CODE`):

* ViT-S/16, class token, the final LayerNorm, then a new LayerNorm and a
  linear layer to 384-d (the code's ``fc_norm`` + ``head``, xavier-uniform;
  ours Kaiming fan-out), L2-normalised; input mean = std = 0.5
  (``inception`` preset); mixed precision (ours bfloat16 compute).
* Prompts: CUB, SOP, In-Shop 10 / 90 / 90 tokens in each of the 12 blocks;
  Cars 80 tokens in the first block, 2 fewer in each next one, over 11
  blocks. SOP and In-Shop checkpoint the blocks (``checkpoint``); prompts
  here need ``remat=False`` (the scanned blocks take no tokens), so those
  two run without rematerialisation.
* Batches of 64 = 32 classes x 2 (CUB, Cars) and 32 = 32 classes x 1 (SOP,
  In-Shop), the ``random_class`` sampler (ours ``pk``); an epoch is
  ``train images // batch`` steps: CUB 15 epochs, Cars 50, SOP 120,
  In-Shop 80.
* Optimiser: CUB SGD (momentum 0.9) lr 5e-3, weight decay 1e-6; Cars AdamW
  5e-4, 0; SOP AdamW 1e-4, 1e-4; In-Shop AdamW 1e-4, 1e-7. The learned
  proxies have their own optimiser at ``lr_proxy`` (0.1, 0.01, 0.05, 0.05),
  here the ``loss`` group's multiplier ``lr_proxy / lr``; every trained
  backbone parameter (prompts, biases, the head's LayerNorm) and the
  semantic branch (class prompts, proxy head, GRU: ``'loss/semantic'``,
  multiplier 1) share ``lr``.
* Schedule: PyTorch's ``CosineAnnealingLR`` stepped per epoch with
  ``T_max = lr_cosine_length`` (50, 50, 120, 100 epochs) and ``eta_min``,
  stopped after the training epochs (so CUB ends at 79 % of its peak). Ours:
  a per-step cosine over the training steps ending at the code's last rate
  (``cosine_final_fraction``, :func:`final_fraction`).
* Train: random-resized crop 224 (scale 0.08-1), horizontal flip. Eval:
  resize 256, centre crop 224.
* The code evaluates the test split every epoch and reports the best; ours
  trains on all train classes (``validation_fraction = 0``) and reports the
  last step (``best_metric = ''``).
"""

from __future__ import annotations

import math

from circle_jax import config as config_lib
from experiments.configs import hyp_vit
from experiments.configs import recipes

DATASETS = ("cub200", "cars196", "sop", "inshop")
CONFIG_FILE = "vptsp_g.py"
TIMM_MODEL = "vit_small_patch16_224.augreg_in21k"
FAMILY = "augreg"
EMBEDDING_DIM = 384

# dataset -> the official config's values (config/<dataset>_small.yaml, and
# params.py's defaults where the file is silent).
CODE = {
    "cub200": dict(batch=64, per_class=2, optim="sgd", lr=5e-3, decay=1e-6,
                   lr_proxy=0.1, epochs=15, cosine_length=50,
                   cosine_min=1e-8, num_prompt=10, prompt_depth=12,
                   prompt_step=0),
    "cars196": dict(batch=64, per_class=2, optim="adamw", lr=5e-4, decay=0.0,
                    lr_proxy=0.01, epochs=50, cosine_length=50,
                    cosine_min=1e-6, num_prompt=80, prompt_depth=11,
                    prompt_step=2),
    "sop": dict(batch=32, per_class=1, optim="adamw", lr=1e-4, decay=1e-4,
                lr_proxy=0.05, epochs=120, cosine_length=120,
                cosine_min=5e-5, num_prompt=90, prompt_depth=12,
                prompt_step=0),
    "inshop": dict(batch=32, per_class=1, optim="adamw", lr=1e-4, decay=1e-7,
                   lr_proxy=0.05, epochs=80, cosine_length=100,
                   cosine_min=5e-6, num_prompt=90, prompt_depth=12,
                   prompt_step=0),
}

# The semantic-proxy branch's settings (num_p_prompt, p_prompt_depth,
# prompt_p_block_step, proxy_bias_ratio, rnn_dropout; GRU 'gru_relu'):
# config.semantic_proxies and the loss's proxy_bias_ratio.
SEMANTIC = {
    "cub200": dict(num_prompts=3, prompt_depth=12, prompt_step=0,
                   proxy_bias_ratio=0.5, dropout=0.0),
    "cars196": dict(num_prompts=50, prompt_depth=8, prompt_step=2,
                    proxy_bias_ratio=0.7, dropout=0.0),
    "sop": dict(num_prompts=5, prompt_depth=12, prompt_step=0,
                proxy_bias_ratio=0.2, dropout=0.1),
    "inshop": dict(num_prompts=80, prompt_depth=12, prompt_step=0,
                   proxy_bias_ratio=0.2, dropout=0.1),
}

PUBLISHED = {
    "cub200": {"recall@1": 86.6},
    "cars196": {"recall@1": 87.7},
    "sop": {"recall@1": 84.4},
    "inshop": {"recall@1": 91.2},
}


def steps(dataset: str) -> int:
  """The code's epochs in steps (``train images // batch`` per epoch)."""
  code = CODE[dataset]
  return recipes.train_images(dataset) // code["batch"] * code["epochs"]


def final_fraction(dataset: str) -> float:
  """The code's learning rate after its last epoch, as a fraction of the
  peak (``CosineAnnealingLR`` at ``epochs`` of ``T_max``)."""
  code = CODE[dataset]
  lr, low = code["lr"], code["cosine_min"]
  t = code["epochs"] / code["cosine_length"]
  return (low + (lr - low) * (1 + math.cos(math.pi * t)) / 2) / lr


def get_config(dataset: str = "cub200"):
  """The VPTSP-G code's recipe for ``dataset`` (module docstring).

  Args:
    dataset: one of :data:`DATASETS`.

  Returns:
    The training config.
  """
  recipes.check_dataset(CONFIG_FILE, dataset, DATASETS)
  code = CODE[dataset]
  c = recipes.vit_base(dataset, model="vit_s16", family=FAMILY,
                       embedding_dim=EMBEDDING_DIM)
  k = c.model.kwargs
  k.num_prompts = code["num_prompt"]
  k.prompt_depth = code["prompt_depth"]
  k.prompt_step = code["prompt_step"]
  k.head_norm = True
  k.tune = "bitfit"
  c.dataset.preprocess.resize_size = 256
  c.dataset.preprocess.scale = (0.08, 1.0)
  c.batch.sampler = "pk"
  c.batch.classes_per_batch = code["batch"] // code["per_class"]
  c.batch.images_per_class = code["per_class"]
  c.optim.name = code["optim"]
  c.optim.learning_rate = code["lr"]
  c.optim.weight_decay = code["decay"]
  if code["optim"] == "sgd":
    c.optim.momentum = 0.9
  c.optim.lr_multipliers["loss"] = code["lr_proxy"] / code["lr"]
  # The semantic branch's parameters lie under the loss's but train at lr.
  c.optim.lr_multipliers["loss/semantic"] = 1.0
  c.optim.schedule = "cosine"
  c.optim.cosine_final_fraction = final_fraction(dataset)
  c.num_train_steps = steps(dataset)
  c.eval_every_steps = 0
  c.checkpoint_every_steps = max(c.num_train_steps // 10, 1)
  sem = dict(SEMANTIC[dataset])
  c.loss = config_lib.loss_config(
      "vptsp_proxy_anchor", proxy_bias_ratio=sem.pop("proxy_bias_ratio"))
  for field, value in sem.items():
    c.semantic_proxies[field] = value
  return c


def launch_command(dataset: str) -> str:
  """The one-line command that trains this recipe on ``dataset``."""
  return hyp_vit.launch_command(CONFIG_FILE, dataset, TIMM_MODEL)
