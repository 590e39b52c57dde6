"""Ranked List loss (Wang et al., CVPR 2019): ``ranked_list.py:DATASET``.

Paper: X. Wang, Y. Hua, E. Kodirov, G. Hu, R. Garnier, N. M. Robertson,
"Ranked List Loss for Deep Metric Learning", CVPR 2019 (arXiv:1903.03238);
code (Caffe): github.com/XinshaoAmosWang/Ranked-List-Loss-for-DML.
GoogLeNet-V2 (= BN-Inception), 512-d embedding, alpha = 1.2, m = 0.4,
T_n = 10 (T_p = 0, lambda = 0.5).

Published (%, the paper's comparison tables for CUB and for Cars, row RLL-H:
the 512-d embedding of the last layer; RLL-(L,M,H), 61.3 / 82.1 R@1,
concatenates three heads into 1,536-d and is not what this config trains).
The CUB row also appears, identical, in a third-party comparison table; the
Cars row is as we read the paper:

=========  ======  ======  ======  ======
dataset    R@1     R@2     R@4     R@8
=========  ======  ======  ======  ======
cub200     57.4    69.7    79.2    86.9
cars196    74.0    83.6    90.1    94.1
=========  ======  ======  ======  ======

Launch (one run per dataset; the manual_dir holds the official files listed
in docs/data.md, the pretrained file is Cadene's ImageNet BN-Inception)::

  python -m experiments.main \
      --config=experiments/configs/ranked_list.py:cub200 \
      --workdir=/tmp/ranked_list_cub200 \
      --config.dataset.manual_dir=/path/to/cub200 \
      --config.model.pretrained=/path/to/bn_inception-52deb4733.pth

  python -m experiments.main \
      --config=experiments/configs/ranked_list.py:cars196 \
      --workdir=/tmp/ranked_list_cars196 \
      --config.dataset.manual_dir=/path/to/cars196 \
      --config.model.pretrained=/path/to/bn_inception-52deb4733.pth

The paper's: the loss (alpha = 1.2, m = 0.4, T_n = 10, T_p = 0, lambda =
0.5; the ``ranked_list`` defaults, which are also the defaults of the code's
``caffe.proto``; the CUB solver in the repository sets alpha = 1.4,
m = 0.2). The code's (experiments/configs/recipes.py ``ranked_list_code``):
average pooling, BN in training mode, P x K = 20 x 3 = 60, SGD momentum 0.9,
lr 1e-3 with the head at 100 x, weight decay 2e-5, lr x0.5 every 2,000 of
10,000 steps on CUB, 227 crops. Ours: the random-resized crops of scale
(0.16, 1) (the code squashes to 256 x 256 and crops 227), no auxiliary heads,
the Cars step count (13,700: CUB's number of epochs) and evaluation cadence,
and the model selection: the step is selected on 20 % of the train classes
held out for validation (``dataset.validation_fraction = 0.2``), and the test
numbers of that step are the result.
"""

from circle_jax import config as config_lib
from experiments.configs import recipes

DATASETS = ("cub200", "cars196")

# Published test numbers (%), the module docstring's table.
PUBLISHED = {
    "cub200": {"recall@1": 57.4, "recall@2": 69.7, "recall@4": 79.2,
               "recall@8": 86.9},
    "cars196": {"recall@1": 74.0, "recall@2": 83.6, "recall@4": 90.1,
                "recall@8": 94.1},
}


def get_config(dataset: str = "cub200"):
  """Ranked List loss (alpha 1.2, m 0.4, T_n 10) with the RLL code's recipe.

  Args:
    dataset: one of :data:`DATASETS`; see the module docstring for the
      launch command of each.

  Returns:
    The training config.
  """
  recipes.check_dataset("ranked_list.py", dataset, DATASETS)
  c = recipes.paper_base(dataset)
  recipes.ranked_list_code(c, dataset)
  c.loss = config_lib.loss_config("ranked_list")  # alpha 1.2, m 0.4, T_n 10.
  return c
