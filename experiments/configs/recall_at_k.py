"""RS@k + SiMix (Patel et al., CVPR 2022): ``recall_at_k.py:SETTING``.

Paper: Y. Patel, G. Tolias, J. Matas, "Recall@k Surrogate Loss with Large
Batches and Similarity Mixup", CVPR 2022 (arXiv:2108.11179); code:
github.com/yash0307/RecallatK_surrogate (``src/main.py``'s per-dataset
settings, ``src/netlib.py``, ``src/datasets.py`` and its README's commands).
The loss is ``recall_at_k`` (:mod:`circle_jax.losses.recall_at_k`, whose
docstring lists how the official loss differs).

Published R@1 (%), as listed by Papers with Code
(paperswithcode.com/paper/recall-k-surrogate-loss-with-large-batches; the
other Recall@K columns and the CUB numbers are not recorded here, as we found
no second source for them):

==============  ==========  =====
setting         backbone    R@1
==============  ==========  =====
cars196         ResNet-50   88.3
cars196_vitb16  ViT-B/16    89.5
sop             ResNet-50   82.7
sop_vitb16      ViT-B/16    88.0
==============  ==========  =====

SOP with ViT-B/32 (85.1) and iNaturalist (71.8 ResNet-50, 83.0 ViT-B/16)
have no config: this library has no ViT-B/32 (patch 32) and no iNaturalist
builder.

Launch (one run per setting; the manual_dir holds the official files listed
in docs/data.md; the weights: Keras ImageNet ResNet-50, or timm's
``vit_base_patch16_224.augreg_in21k`` exported as for ``hyp_vit.py``)::

  python -m experiments.main --config=experiments/configs/recall_at_k.py:cars196 --workdir=/tmp/recall_at_k_cars196 --config.dataset.manual_dir=/path/to/cars196 --config.model.pretrained=/path/to/resnet50_weights_tf_dim_ordering_tf_kernels_notop.h5

  python -m experiments.main --config=experiments/configs/recall_at_k.py:cars196_vitb16 --workdir=/tmp/recall_at_k_cars196_vitb16 --config.dataset.manual_dir=/path/to/cars196 --config.model.pretrained=/path/to/vit_base_patch16_224.augreg_in21k.safetensors

  python -m experiments.main --config=experiments/configs/recall_at_k.py:sop --workdir=/tmp/recall_at_k_sop --config.dataset.manual_dir=/path/to/sop --config.model.pretrained=/path/to/resnet50_weights_tf_dim_ordering_tf_kernels_notop.h5

  python -m experiments.main --config=experiments/configs/recall_at_k.py:sop_vitb16 --workdir=/tmp/recall_at_k_sop_vitb16 --config.dataset.manual_dir=/path/to/sop --config.model.pretrained=/path/to/vit_base_patch16_224.augreg_in21k.safetensors

The code's recipe (``main.py``; ``--samples_per_class 4 --embed_dim 512
--fc_lr_mul 0`` from the README's commands):

* 512-d embedding, L2-normalised; ResNet-50 with BatchNorm frozen, or
  ViT-B/16 (ImageNet-21k; class token). The code pools ResNet-50 with GeM
  and puts a LayerNorm before the linear layer; ours: average pooling and no
  LayerNorm (the library has neither option).
* Batches of 4 images per class: Cars 392 (98 classes), SOP 4,000 (1,000
  classes), embedded in chunks of ``--bs_base`` whose activations are
  recomputed in the backward pass (Cars 98; SOP 200 for ResNet-50, 100 for
  ViT): ``batch.embed_chunk_size`` (GradCache, :mod:`circle_jax.train.gradcache`),
  per device, so these chunk sizes are for one device.
* RS@k with k = (1, 2, 4, 8, 16), tau1 0.01, tau2 1; SiMix
  (``--mixup 1``) on Cars, off on SOP: the README calls it optional and "very
  useful for small-scale datasets" without saying which published row used
  it (``--config.loss.simix`` switches it).
* Adam (ResNet-50; L2 weight decay 4e-4) or AdamW (ViT; decoupled 4e-4), one
  learning rate for all parameters: Cars 1e-4 (ResNet-50) and 1e-5 (ViT),
  SOP 2e-4 and 5e-5; lr x0.3 at the code's milestones. Our step schedule is
  periodic: SOP's milestones (25, 50 of 55 epochs) are exact; Cars ResNet-50
  (80, 140 of 170) becomes 80, 160; Cars ViT (20, 30, 40 of 50) becomes 20,
  40.
* Epochs in steps of ``train images // batch`` (ours): Cars 170 (ResNet-50)
  or 50 (ViT) epochs, SOP 55.
* Train: random-resized crop 224 (scale (0.08, 1)), flip; eval: resize
  256, centre crop 224; ImageNet's normalisation for the ViT (the code's, for
  every backbone); ResNet-50 keeps its Keras input.
* Every train class trains (a Cars batch holds all 98): no validation
  hold-out and no model selection, ``validation_fraction = 0``,
  ``best_metric = ''``; the result is the last step's test metrics (the code
  evaluates the test split every 5 epochs); evaluations every 5 epochs.
"""

from __future__ import annotations

from circle_jax import config as config_lib
from experiments.configs import recipes

CONFIG_FILE = "recall_at_k.py"
DATASETS = ("cars196", "cars196_vitb16", "sop", "sop_vitb16")
SAMPLES_PER_CLASS = 4
RESNET_WEIGHTS = "/path/to/resnet50_weights_tf_dim_ordering_tf_kernels_notop.h5"
VIT_WEIGHTS = "/path/to/vit_base_patch16_224.augreg_in21k.safetensors"

# setting -> (dataset, model, classes per batch, chunk, optimiser, lr,
#             epochs, lr period in epochs, simix), from main.py.
SETTINGS = {
    "cars196": ("cars196", "resnet50", 98, 98, "adam", 1e-4, 170, 80, True),
    "cars196_vitb16": ("cars196", "vit_b16", 98, 98, "adamw", 1e-5, 50, 20,
                       True),
    "sop": ("sop", "resnet50", 1000, 200, "adam", 2e-4, 55, 25, False),
    "sop_vitb16": ("sop", "vit_b16", 1000, 100, "adamw", 5e-5, 55, 25, False),
}

PUBLISHED = {
    "cars196": {"recall@1": 88.3},
    "cars196_vitb16": {"recall@1": 89.5},
    "sop": {"recall@1": 82.7},
    "sop_vitb16": {"recall@1": 88.0},
}


def launch_command(setting: str) -> str:
  """The one-line command that trains ``setting``."""
  dataset, model = SETTINGS[setting][:2]
  weights = RESNET_WEIGHTS if model == "resnet50" else VIT_WEIGHTS
  return (f"python -m experiments.main "
          f"--config=experiments/configs/{CONFIG_FILE}:{setting} "
          f"--workdir=/tmp/recall_at_k_{setting} "
          f"--config.dataset.manual_dir={recipes.MANUAL_DIRS[dataset]} "
          f"--config.model.pretrained={weights}")


def get_config(setting: str = "cars196"):
  """The official code's RS@k recipe (module docstring).

  Args:
    setting: one of :data:`DATASETS` (a dataset, ``_vitb16`` for ViT-B/16).

  Returns:
    The training config.
  """
  recipes.check_dataset(CONFIG_FILE, setting, DATASETS)
  (dataset, model, classes, chunk, optimiser, lr, epochs, period,
   simix) = SETTINGS[setting]
  c = recipes.paper_base(dataset)
  c.dataset.validation_fraction = 0.0
  c.best_metric = ""
  c.model.name = model
  if model == "resnet50":
    c.model.freeze_bn = True
  else:
    c.model.kwargs.family = "augreg"
    c.model.kwargs.image_size = 224
    c.model.kwargs.pool = "cls"
    c.dataset.preprocess.preset = "imagenet"
  c.dataset.preprocess.image_size = 224
  c.dataset.preprocess.resize_size = 256
  c.dataset.preprocess.scale = (0.08, 1.0)
  c.batch.sampler = "pk"
  c.batch.classes_per_batch = classes
  c.batch.images_per_class = SAMPLES_PER_CLASS
  c.batch.embed_chunk_size = chunk
  c.optim.name = optimiser
  c.optim.learning_rate = lr
  c.optim.weight_decay = 4e-4
  c.optim.schedule = "step"
  c.optim.decay_factor = 0.3
  per_epoch = recipes.train_images(dataset) // (classes * SAMPLES_PER_CLASS)
  c.optim.decay_every_steps = period * per_epoch
  c.num_train_steps = epochs * per_epoch
  c.eval_every_steps = 5 * per_epoch
  c.checkpoint_every_steps = c.eval_every_steps
  c.loss = config_lib.loss_config(
      "recall_at_k", simix=simix, samples_per_class=SAMPLES_PER_CLASS)
  return c
