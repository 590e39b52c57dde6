"""Ranked Proxy-Anchor loss (RPAL): ``ranked_proxy_anchor.py:DATASET``.

Source: Zhang Bing, Chen Haiyan, Hou Xiaye, Yuan Ligang and Liu Zhenya
(Nanjing University of Aeronautics and Astronautics), the Ranked
Proxy-Anchor loss, a Chinese-language journal paper. Its formula images are
missing from the text available to us, so ``circle_jax.losses``'
``ranked_proxy_anchor`` is a reconstruction from the paper's prose and from
the two losses it builds on: Proxy-Anchor's structure (S. Kim, D. Kim,
M. Cho, S. Kwak, "Proxy Anchor Loss for Deep Metric Learning", CVPR 2020)
with Ranked List loss's boundaries and weighting (X. Wang, Y. Hua,
E. Kodirov, G. Hu, R. Garnier, N. M. Robertson, "Ranked List Loss for Deep
Metric Learning", CVPR 2019); docs/losses_rll_proxy.md explains the
reconstruction. We have no published numbers of it to compare with;
experiments/results/main_paper_tables.md leaves that column empty.

Setting (the paper's, as its prose states it): alpha = 1.4, m = 0.4,
T_n = 20 (the ``ranked_proxy_anchor`` defaults, Euclidean distance between
normalised vectors), AdamW lr 1e-4, weight decay 1e-4, 60 epochs, batches of
180, on CUB-200-2011 and Cars196. Everything else is the Proxy-Anchor code's
recipe (experiments/configs/recipes.py ``proxy_anchor_code``: BN-Inception,
512-d, GAP + GMP, frozen BN, proxies at 100 x lr, one warm-up epoch, lr x0.5
every 10 epochs, gradient values clipped at 10, 224 crops): our choice, as
the paper gives no more. Epochs become steps with the train-split sizes (CUB
32, Cars 44 steps per epoch). Model selection (ours): the step is selected
on 20 % of the train classes held out for validation
(``dataset.validation_fraction = 0.2``), and the test numbers of that step
are the result.

Launch (one run per dataset; the manual_dir holds the official files listed
in docs/data.md, the pretrained file is Cadene's ImageNet BN-Inception)::

  python -m experiments.main \
      --config=experiments/configs/ranked_proxy_anchor.py:cub200 \
      --workdir=/tmp/ranked_proxy_anchor_cub200 \
      --config.dataset.manual_dir=/path/to/cub200 \
      --config.model.pretrained=/path/to/bn_inception-52deb4733.pth

  python -m experiments.main \
      --config=experiments/configs/ranked_proxy_anchor.py:cars196 \
      --workdir=/tmp/ranked_proxy_anchor_cars196 \
      --config.dataset.manual_dir=/path/to/cars196 \
      --config.model.pretrained=/path/to/bn_inception-52deb4733.pth
"""

from circle_jax import config as config_lib
from experiments.configs import recipes

DATASETS = ("cub200", "cars196")

# No published numbers to compare with (see the module docstring).
PUBLISHED = {}


def get_config(dataset: str = "cub200"):
  """RPAL (alpha 1.4, m 0.4, T_n 20) with the Proxy-Anchor code's recipe.

  Args:
    dataset: one of :data:`DATASETS`; see the module docstring for the
      launch command of each.

  Returns:
    The training config.
  """
  recipes.check_dataset("ranked_proxy_anchor.py", dataset, DATASETS)
  c = recipes.paper_base(dataset)
  recipes.proxy_anchor_code(c, dataset)
  c.loss = config_lib.loss_config("ranked_proxy_anchor")  # alpha 1.4, m 0.4, T 20.
  return c
