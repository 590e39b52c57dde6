"""Training recipes shared by the paper configs (one config file per paper).

The paper configs (``circle_loss.py``, ``multi_similarity.py``,
``proxy_anchor.py``, ``ranked_list.py``, ``ranked_proxy_anchor.py``) are each
:func:`paper_base` + one of the three training recipes below + the paper's
loss. The recipes are those of the official code of the papers (what each
setting is and where it comes from is in the function docstrings); the paper
configs say which recipe they use and which numbers are the papers'.

Common to every paper config (:func:`paper_base`): BN-Inception (the Caffe
model as ported by Cadene; ``--config.model.pretrained`` takes its
``bn_inception-52deb4733.pth``), a 512-d embedding, and model selection on
held-out *train* classes: ``dataset.validation_fraction = 0.2`` holds out
20 % of the train classes, the periodic evaluations run on them,
``best_metric`` (Recall@1) selects the step there, and the test numbers of
that step are the result. The papers' codes select the best evaluation on the
test split instead, so our numbers are not optimistic in the way theirs are,
and they train on 80 % of the train classes.

Step counts are ours wherever a paper or its code gives epochs or gives no
count: they are converted with the *full* train-split sizes of
``circle_jax.data.DATASETS`` (:func:`train_images`; the validation hold-out
makes the real epochs about 20 % shorter), as each recipe says.
"""

from __future__ import annotations

from typing import Sequence

import ml_collections

from circle_jax import data as data_lib
from circle_jax import config as config_lib
from circle_jax import models

VALIDATION_FRACTION = 0.2
EMBEDDING_DIM = 512

# Placeholders of the launch commands in the configs' docstrings and in
# experiments/results/main_paper_tables.md: the folder holding the official files
# of each dataset (docs/data.md lists them: CUB_200_2011.tgz; car_ims.tgz and
# cars_annos.mat; Stanford_Online_Products.zip; img.zip and
# list_eval_partition.txt) and the ImageNet BN-Inception weights (Cadene's
# bn_inception-52deb4733.pth, the file the MS and Proxy-Anchor codes load).
MANUAL_DIRS = {
    "cub200": "/path/to/cub200",
    "cars196": "/path/to/cars196",
    "sop": "/path/to/sop",
    "inshop": "/path/to/inshop",
}
PRETRAINED = "/path/to/bn_inception-52deb4733.pth"


def train_images(dataset: str) -> int:
  """Images of the full train split (``circle_jax.data.DATASETS``)."""
  return data_lib.get_dataset_info(dataset).num_images["train"]


def _round(x: float, to: int) -> int:
  return max(to, int(round(x / to)) * to)


def check_dataset(config_file: str, dataset: str,
                  supported: Sequence[str]) -> str:
  """Returns ``dataset`` or raises ValueError naming the supported ones."""
  if dataset not in supported:
    raise ValueError(
        f"experiments/configs/{config_file}: dataset must be one of "
        f"{', '.join(supported)} (--config=experiments/configs/{config_file}"
        f":DATASET); got {dataset!r}.")
  return dataset


def launch_command(config_file: str, dataset: str) -> str:
  """The command line that trains ``config_file`` on ``dataset`` (one line)."""
  stem = config_file[:-3] if config_file.endswith(".py") else config_file
  return (f"python -m experiments.main "
          f"--config=experiments/configs/{stem}.py:{dataset} "
          f"--workdir=/tmp/{stem}_{dataset} "
          f"--config.dataset.manual_dir={MANUAL_DIRS[dataset]} "
          f"--config.model.pretrained={PRETRAINED}")


def paper_base(dataset: str) -> ml_collections.ConfigDict:
  """:func:`base.base_config` with what every paper config shares."""
  c = config_lib.base_config()
  c.dataset.name = dataset
  c.dataset.num_workers = 8
  c.dataset.validation_fraction = VALIDATION_FRACTION
  c.model.name = "bn_inception"
  c.model.embedding_dim = EMBEDDING_DIM
  c.model.pretrained = ""          # set on the command line (see MANUAL_DIRS)
  c.batch.eval_batch_size = 256
  c.best_metric = "recall@1"
  c.best_mode = "max"
  return c


def vit_base(dataset: str, *, model: str, family: str,
             embedding_dim: int) -> ml_collections.ConfigDict:
  """:func:`paper_base` with what the ViT recipes share (Hyp-ViT, Unicom,
  VPTSP-G): the ViT ``model`` of ``family`` at 224 pixels in bfloat16, its
  class token as the feature, the family's normalisation, no validation
  hold-out and no model selection (the codes report the last step)."""
  c = paper_base(dataset)
  c.dataset.validation_fraction = 0.0
  c.best_metric = ""
  c.model.name = model
  c.model.embedding_dim = embedding_dim
  c.model.dtype = "bfloat16"
  c.model.pooling = "avg"  # the ViT's feature is 1 x 1: pooling is identity
  c.model.kwargs.family = family
  c.model.kwargs.image_size = 224
  c.model.kwargs.pool = "cls"
  # The family's normalisation (augreg: mean = std = 0.5; DINO: ImageNet's).
  c.dataset.preprocess.preset = models.VIT_FAMILIES[family].preprocess
  c.dataset.preprocess.image_size = 224
  return c


# --------------------------------------------------------------------------
# Multi-Similarity code (msight-tech/research-ms-loss).
# --------------------------------------------------------------------------

MS_CODE_CUB_STEPS = 3000


def ms_code_steps(dataset: str) -> int:
  """3000 on CUB (the code's configs/example.yaml); elsewhere ours.

  The code ships a CUB config only: 3000 iterations of 80 images, i.e. 40.9
  epochs of CUB's 5,864 train images. Other datasets get the same number of
  epochs, rounded to 100 steps: Cars 4,100, SOP 30,500, In-Shop 13,200.
  """
  if dataset == "cub200":
    return MS_CODE_CUB_STEPS
  return _round(MS_CODE_CUB_STEPS * train_images(dataset)
                / train_images("cub200"), 100)


def ms_code(c: ml_collections.ConfigDict, dataset: str, *,
            classes_per_batch: int = 16, images_per_class: int = 5) -> None:
  """The Multi-Similarity code's recipe (also used for Circle loss).

  From ``msight-tech/research-ms-loss`` (``configs/example.yaml``, the CUB
  run of its README, and ``ret_benchmark/config/defaults.py``):

  * BN-Inception, global *max* pooling (``adaptive_max_pool2d`` in its
    ``bninception.py``), a linear 512-d head, L2-normalised;
  * BatchNorm frozen (``set_bn_eval`` every iteration). The code only puts
    BN in eval mode, its scale/bias still train; our ``freeze_bn`` also
    freezes scale/bias (as the Proxy-Anchor code does);
  * P x K batches: 80 images, K = 5 (``TRAIN_BATCHSIZE: 80``,
    ``NUM_INSTANCES: 5``);
  * Adam, lr 3e-5 for all parameters (the ``lr_mul`` 0.1 its
    ``solver/build.py`` stores for the backbone is read by nothing), L2
    weight decay 5e-4, no warm-up;
  * lr x0.1 at 40 % and 80 % of training (``STEPS: [1200, 2400]`` of
    ``MAX_ITERS: 3000`` on CUB): StepLR every 40 % of the steps;
  * train: random-resized crop 227 of scale (0.16, 1) after resizing to
    256, flip 1/2; eval: resize 256, centre crop 227; BGR 0-255 minus
    (104, 117, 128) (``INPUT`` defaults);
  * evaluation every 200 iterations on CUB (``VALIDATION.VERBOSE``).

  Ours: the step count off CUB (:func:`ms_code_steps`) and the evaluation
  cadence off CUB (about 15 evaluations per run, as on CUB).
  """
  steps = ms_code_steps(dataset)
  c.model.pooling = "max"
  c.model.freeze_bn = True
  c.dataset.preprocess.image_size = 227
  c.dataset.preprocess.resize_size = 256
  c.dataset.preprocess.scale = (0.16, 1.0)
  c.batch.sampler = "pk"
  c.batch.classes_per_batch = classes_per_batch
  c.batch.images_per_class = images_per_class
  c.optim.name = "adam"
  c.optim.learning_rate = 3e-5
  c.optim.weight_decay = 5e-4
  c.optim.schedule = "step"
  c.optim.decay_every_steps = int(0.4 * steps)
  c.optim.decay_factor = 0.1
  c.num_train_steps = steps
  c.eval_every_steps = 200 if dataset == "cub200" else _round(steps / 15, 50)
  c.checkpoint_every_steps = c.eval_every_steps


# --------------------------------------------------------------------------
# Proxy-Anchor code (tjddus9597/Proxy-Anchor-CVPR2020).
# --------------------------------------------------------------------------

PA_BATCH = 180
PA_EPOCHS = 60
PA_DECAY_EPOCHS = 10


def pa_steps_per_epoch(dataset: str, batch: int = PA_BATCH) -> int:
  """Full batches per epoch (the code's loader drops the last one)."""
  return train_images(dataset) // batch


def proxy_anchor_code(c: ml_collections.ConfigDict, dataset: str) -> None:
  """The Proxy-Anchor code's recipe (also used for Ranked Proxy-Anchor).

  From ``tjddus9597/Proxy-Anchor-CVPR2020`` (``code/train.py`` defaults,
  ``code/net/bn_inception.py``, ``code/dataset/utils.py`` and the CUB
  command of its README):

  * BN-Inception, global average + global max pooling (summed), a linear
    512-d head (Kaiming-normal fan-out), L2-normalised;
  * BatchNorm frozen, scale/bias included (``--bn-freeze 1``);
  * random (not P x K) batches of 180, last partial batch dropped;
  * AdamW, lr 1e-4, decoupled weight decay 1e-4; the proxies at 100 x lr;
  * one warm-up epoch (``--warm 1``) training only the head and the
    proxies (the schedule keeps counting meanwhile);
  * lr x0.5 every 10 epochs (``--lr-decay-step 10``, ``--lr-decay-gamma
    0.5``), 60 epochs (``--epochs`` default);
  * gradient values clipped at 10 (``clip_grad_value_``);
  * train: random-resized crop 224 of scale (0.08, 1) (torchvision's
    default), flip 1/2; eval: resize 256, centre crop 224; BGR 0-255 minus
    (104, 117, 128);
  * evaluation after every epoch.

  The README's commands for Cars (``--lr-decay-step 20``) and for SOP and
  In-Shop (``--lr 6e-4 --bn-freeze 0 --lr-decay-step 20 --lr-decay-gamma
  0.25``) are its newer, better-than-the-paper runs (Cars 86.4, SOP 79.2,
  In-Shop 91.9 R@1); this recipe is the code's defaults on every dataset.
  Epochs become steps with :func:`pa_steps_per_epoch` (ours).
  """
  per_epoch = pa_steps_per_epoch(dataset)
  c.model.pooling = "avg+max"
  c.model.freeze_bn = True
  c.dataset.preprocess.image_size = 224
  c.dataset.preprocess.resize_size = 256
  c.dataset.preprocess.scale = (0.08, 1.0)
  c.batch.sampler = "random"
  c.batch.size = PA_BATCH
  c.optim.name = "adamw"
  c.optim.learning_rate = 1e-4
  c.optim.weight_decay = 1e-4
  c.optim.lr_multipliers.loss = 100.0
  c.optim.freeze_backbone_steps = per_epoch
  c.optim.schedule = "step"
  c.optim.decay_every_steps = PA_DECAY_EPOCHS * per_epoch
  c.optim.decay_factor = 0.5
  c.optim.grad_clip_value = 10.0
  c.num_train_steps = PA_EPOCHS * per_epoch
  c.eval_every_steps = per_epoch
  c.checkpoint_every_steps = per_epoch


# --------------------------------------------------------------------------
# Ranked List Loss code (XinshaoAmosWang/Ranked-List-Loss-for-DML).
# --------------------------------------------------------------------------

RLL_CUB_STEPS = 10000


def rll_code_steps(dataset: str) -> int:
  """10,000 on CUB (the code's CUB solver); Cars: the same epochs (13,700)."""
  if dataset == "cub200":
    return RLL_CUB_STEPS
  return _round(RLL_CUB_STEPS * train_images(dataset)
                / train_images("cub200"), 100)


def ranked_list_code(c: ml_collections.ConfigDict, dataset: str) -> None:
  """The Ranked List Loss code's recipe (Caffe; CUB files of its repo).

  From ``XinshaoAmosWang/Ranked-List-Loss-for-DML``, ``CUB_V01/``
  (``60_n1.4_pn0.2_tp0_tn10/solver.prototxt`` and ``train.prototxt``,
  ``train_60_n1.4_pn0.2_tp0_tn10/train_multiGPUs.m``):

  * GoogLeNet-V2 (= BN-Inception), global *average* pooling (``pool5/7x7``
    AVE), a 512-d linear head (``lr_mult: 100``), L2-normalised;
  * BatchNorm in training mode (Caffe ``BatchNorm`` layers without
    ``use_global_stats``): not frozen;
  * P x K batches of 60: 20 classes x 3 images (``id_num``,
    ``image_per_id``);
  * SGD, momentum 0.9, lr 1e-3 (the head at 100 x), L2 weight decay 2e-5;
  * lr x0.5 every 2,000 of 10,000 iterations (``multistep``);
  * 227-pixel crops (``cropped_size``).

  Not reproduced: the code also trains two auxiliary embedding heads on
  inception 3c and 4e (its RLL-L and RLL-M; the paper's RLL-H numbers are
  the last head's), and its augmentation squashes images to 256 x 256 and
  takes a random 227 crop, which no preset here does: we use the MS code's
  random-resized crop of scale (0.16, 1). The CUB solver of the repository
  sets alpha = 1.4, m = 0.2; the paper's and the code's defaults are alpha
  = 1.2, m = 0.4 (the config's loss). Cars: the same number of epochs as
  CUB (:func:`rll_code_steps`, ours); evaluations every 500 iterations on
  CUB (the script's ``save_interval``), 20 per run elsewhere (ours).
  """
  steps = rll_code_steps(dataset)
  c.model.pooling = "avg"
  c.model.freeze_bn = False
  c.dataset.preprocess.image_size = 227
  c.dataset.preprocess.resize_size = 256
  c.dataset.preprocess.scale = (0.16, 1.0)
  c.batch.sampler = "pk"
  c.batch.classes_per_batch = 20
  c.batch.images_per_class = 3
  c.optim.name = "sgd"
  c.optim.momentum = 0.9
  c.optim.learning_rate = 1e-3
  c.optim.lr_multipliers.head = 100.0
  c.optim.weight_decay = 2e-5
  c.optim.schedule = "step"
  c.optim.decay_every_steps = int(0.2 * steps)
  c.optim.decay_factor = 0.5
  c.num_train_steps = steps
  c.eval_every_steps = 500 if dataset == "cub200" else _round(steps / 20, 50)
  c.checkpoint_every_steps = c.eval_every_steps
