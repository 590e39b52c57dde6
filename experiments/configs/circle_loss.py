"""Circle loss on CUB-200-2011, Cars196 and SOP: ``circle_loss.py:DATASET``.

Paper: Y. Sun, C. Cheng, Y. Zhang, C. Zhang, L. Zheng, Z. Wang, Y. Wei,
"Circle Loss: A Unified Perspective of Pair Similarity Optimization",
CVPR 2020. Fine-grained image retrieval, Table 5: BN-Inception, 512-d
embedding, gamma = 80, m = 0.4, P x K = 16 x 5 batches.

Published (Sun et al., CVPR 2020, Table 5, %; R@1 and the other columns
were transcribed separately and not cross-checked against a second source):

=========  ======  ======  ======  ======
dataset    R@1     R@2     R@4     R@8
=========  ======  ======  ======  ======
cub200     66.7    77.4    86.2    91.2
cars196    83.4    89.8    94.1    96.5
=========  ======  ======  ======  ======

=========  ======  ======  =======  ========
dataset    R@1     R@10    R@100    R@1000
=========  ======  ======  =======  ========
sop        78.3    90.5    96.1     98.6
=========  ======  ======  =======  ========

Launch (one run per dataset; the manual_dir holds the official files listed
in docs/data.md, the pretrained file is Cadene's ImageNet BN-Inception)::

  python -m experiments.main \
      --config=experiments/configs/circle_loss.py:cub200 \
      --workdir=/tmp/circle_loss_cub200 \
      --config.dataset.manual_dir=/path/to/cub200 \
      --config.model.pretrained=/path/to/bn_inception-52deb4733.pth

  python -m experiments.main \
      --config=experiments/configs/circle_loss.py:cars196 \
      --workdir=/tmp/circle_loss_cars196 \
      --config.dataset.manual_dir=/path/to/cars196 \
      --config.model.pretrained=/path/to/bn_inception-52deb4733.pth

  python -m experiments.main \
      --config=experiments/configs/circle_loss.py:sop \
      --workdir=/tmp/circle_loss_sop \
      --config.dataset.manual_dir=/path/to/sop \
      --config.model.pretrained=/path/to/bn_inception-52deb4733.pth

The paper's: backbone, dimension, gamma = 80, m = 0.4 (the ``circle``
defaults of circle_jax.losses), P = 16 classes x K = 5 images. The paper
gives no optimiser, schedule or augmentation for this experiment and no
code for it, so the rest is the Multi-Similarity code's recipe, whose P x K
batch of 80 is the same size (experiments/configs/recipes.py ``ms_code``:
max pooling, frozen BN, Adam 3e-5 with weight decay 5e-4, 227 crops, 3000
steps on CUB and as many epochs elsewhere; ours where the MS code is silent).
Model selection (ours): the step is selected on 20 % of the train classes
held out for validation (``dataset.validation_fraction = 0.2``), and the
test numbers of that step are the result.
"""

from circle_jax import config as config_lib
from experiments.configs import recipes

DATASETS = ("cub200", "cars196", "sop")

# Published test numbers (%), the module docstring's tables.
PUBLISHED = {
    "cub200": {"recall@1": 66.7, "recall@2": 77.4, "recall@4": 86.2,
               "recall@8": 91.2},
    "cars196": {"recall@1": 83.4, "recall@2": 89.8, "recall@4": 94.1,
                "recall@8": 96.5},
    "sop": {"recall@1": 78.3, "recall@10": 90.5, "recall@100": 96.1,
            "recall@1000": 98.6},
}


def get_config(dataset: str = "cub200"):
  """Circle loss (gamma 80, m 0.4), BN-Inception 512-d, 16 x 5 batches.

  Args:
    dataset: one of :data:`DATASETS`; see the module docstring for the
      launch command of each.

  Returns:
    The training config.
  """
  recipes.check_dataset("circle_loss.py", dataset, DATASETS)
  c = recipes.paper_base(dataset)
  recipes.ms_code(c, dataset, classes_per_batch=16, images_per_class=5)
  c.loss = config_lib.loss_config("circle")  # gamma = 80, m = 0.4: the defaults.
  return c
