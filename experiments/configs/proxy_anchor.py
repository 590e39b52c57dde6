"""Proxy-Anchor loss (Kim et al., CVPR 2020): ``proxy_anchor.py:DATASET``.

Paper: S. Kim, D. Kim, M. Cho, S. Kwak, "Proxy Anchor Loss for Deep Metric
Learning", CVPR 2020 (arXiv:2003.13911); code:
github.com/tjddus9597/Proxy-Anchor-CVPR2020. BN-Inception, 512-d embedding,
alpha = 32, delta = 0.1.

Published (%, Table 1: CUB and Cars, Table 2: SOP, Table 3: In-Shop; R@1 and
the next two columns of every dataset also appear, identical, in a
third-party comparison table; the last columns are as we read the paper):

=========  ======  ======  ======  ======
dataset    R@1     R@2     R@4     R@8
=========  ======  ======  ======  ======
cub200     68.4    79.2    86.8    91.6
cars196    86.1    91.7    95.0    97.3
=========  ======  ======  ======  ======

=========  ======  ======  =======  ========
dataset    R@1     R@10    R@100    R@1000
=========  ======  ======  =======  ========
sop        79.1    90.8    96.2     98.7
=========  ======  ======  =======  ========

=========  ======  ======  ======  ======  ======
dataset    R@1     R@10    R@20    R@30    R@40
=========  ======  ======  ======  ======  ======
inshop     91.5    98.1    98.8    99.1    99.2
=========  ======  ======  ======  ======  ======

(The code's README reports newer runs, better than the paper: CUB 69.1,
Cars 86.4, SOP 79.2, In-Shop 91.9 R@1, with the per-dataset commands named in
experiments/configs/recipes.py ``proxy_anchor_code``.)

Launch (one run per dataset; the manual_dir holds the official files listed
in docs/data.md, the pretrained file is Cadene's ImageNet BN-Inception)::

  python -m experiments.main \
      --config=experiments/configs/proxy_anchor.py:cub200 \
      --workdir=/tmp/proxy_anchor_cub200 \
      --config.dataset.manual_dir=/path/to/cub200 \
      --config.model.pretrained=/path/to/bn_inception-52deb4733.pth

  python -m experiments.main \
      --config=experiments/configs/proxy_anchor.py:cars196 \
      --workdir=/tmp/proxy_anchor_cars196 \
      --config.dataset.manual_dir=/path/to/cars196 \
      --config.model.pretrained=/path/to/bn_inception-52deb4733.pth

  python -m experiments.main \
      --config=experiments/configs/proxy_anchor.py:sop \
      --workdir=/tmp/proxy_anchor_sop \
      --config.dataset.manual_dir=/path/to/sop \
      --config.model.pretrained=/path/to/bn_inception-52deb4733.pth

  python -m experiments.main \
      --config=experiments/configs/proxy_anchor.py:inshop \
      --workdir=/tmp/proxy_anchor_inshop \
      --config.dataset.manual_dir=/path/to/inshop \
      --config.model.pretrained=/path/to/bn_inception-52deb4733.pth

The papers' and the code's: the loss (alpha = 32, delta = 0.1, one proxy per
class, the ``proxy_anchor`` defaults) and the recipe of
experiments/configs/recipes.py ``proxy_anchor_code``: GAP + GMP, frozen BN,
random batches of 180, AdamW lr 1e-4 with weight decay 1e-4, proxies at 100
x lr, one warm-up epoch training only the head and proxies, lr x0.5 every 10
epochs, 60 epochs, gradient values clipped at 10, 224 crops of scale
(0.08, 1), an evaluation per epoch. Ours: the 60 epochs and the decay every 10
epochs in steps (train-split size // 180 steps per epoch: CUB 32, Cars 44,
SOP 330, In-Shop 143), and the model selection: the step is selected on 20 %
of the train classes held out for validation
(``dataset.validation_fraction = 0.2``; the proxies are one per *kept* train
class), and the test numbers of that step are the result.
"""

from circle_jax import config as config_lib
from experiments.configs import recipes

DATASETS = ("cub200", "cars196", "sop", "inshop")

# Published test numbers (%), the module docstring's tables.
PUBLISHED = {
    "cub200": {"recall@1": 68.4, "recall@2": 79.2, "recall@4": 86.8,
               "recall@8": 91.6},
    "cars196": {"recall@1": 86.1, "recall@2": 91.7, "recall@4": 95.0,
                "recall@8": 97.3},
    "sop": {"recall@1": 79.1, "recall@10": 90.8, "recall@100": 96.2,
            "recall@1000": 98.7},
    "inshop": {"recall@1": 91.5, "recall@10": 98.1, "recall@20": 98.8,
               "recall@30": 99.1, "recall@40": 99.2},
}


def get_config(dataset: str = "cub200"):
  """Proxy-Anchor (alpha 32, delta 0.1) with the Proxy-Anchor code's recipe.

  Args:
    dataset: one of :data:`DATASETS`; see the module docstring for the
      launch command of each.

  Returns:
    The training config.
  """
  recipes.check_dataset("proxy_anchor.py", dataset, DATASETS)
  c = recipes.paper_base(dataset)
  recipes.proxy_anchor_code(c, dataset)
  c.loss = config_lib.loss_config("proxy_anchor")  # alpha = 32, delta = 0.1.
  return c
