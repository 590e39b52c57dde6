"""Paper-reproduction configs: ``--config=experiments/configs/paper.py:DATASET,LOSS``.

DATASET is one of cub200, cars196, sop, inshop; LOSS one of circle,
multi_similarity, proxy_anchor, ranked_list, ranked_proxy_anchor. Example::

  python -m experiments.main \
      --config=experiments/configs/paper.py:cub200,proxy_anchor \
      --workdir=/tmp/cub_pa --config.dataset.manual_dir=/data/CUB_200_2011 \
      --config.model.pretrained=/data/bn_inception-52deb4733.pth

Two training recipes, as in the papers' code:

* ``ms`` recipe (Multi-Similarity code, also used by Circle loss and Ranked
  List loss): BN-Inception, 512-d, P x K batches (K = 5), Adam lr 1e-5 with
  L2 weight decay 5e-4, 227-pixel random-resized crops with scale (0.16, 1).
* ``proxy_anchor`` recipe (Proxy-Anchor code): BN-Inception (or
  ``--config.model.name=resnet50``), 512-d, avg+max pooling, frozen BN,
  random batches of 180, AdamW lr 1e-4 and weight decay 1e-4, proxies at
  x100, one warm-up epoch training only the head and proxies, step decay by
  0.5 every 10 epochs (5 for SOP/In-Shop), gradient values clipped at 10.

Loss hyperparameters are the papers' (registry defaults where they are the
paper's): Circle gamma = 80, m = 0.4 (CUB, Cars, SOP; the paper's
fine-grained setting, also used here for In-Shop); MS alpha = 2, beta = 50,
lambda (base) = 0.5, epsilon = 0.1; Proxy-Anchor alpha = 32, delta = 0.1;
RLL alpha = 1.2, m = 0.4, T_n = 10; RPAL the registry's defaults.

Numbers marked "ours" (step counts) are not given by the papers in steps:
they are the papers' epochs converted with the train-split sizes, or our
choice where a paper states neither.
"""

from experiments.configs import base

# Train images per dataset (circle_jax.data.DATASETS).
_TRAIN_IMAGES = {"cub200": 5864, "cars196": 8054, "sop": 59551,
                 "inshop": 25882}
_MS_STEPS = {"cub200": 3000, "cars196": 3000, "sop": 12000,
             "inshop": 12000}  # ours.
_PA_EPOCHS = {"cub200": 60, "cars196": 60, "sop": 60, "inshop": 60}
_PA_DECAY_EPOCHS = {"cub200": 10, "cars196": 10, "sop": 5, "inshop": 5}
_LOSSES = {
    "circle": dict(gamma=80.0, margin=0.4),
    "multi_similarity": dict(alpha=2.0, beta=50.0, base=0.5, epsilon=0.1),
    "ranked_list": dict(alpha=1.2, margin=0.4, t_neg=10.0, t_pos=0.0),
    "proxy_anchor": dict(alpha=32.0, margin=0.1),
    "ranked_proxy_anchor": dict(),
}
_PROXY_RECIPE = ("proxy_anchor", "ranked_proxy_anchor")


def get_config(arg: str = "cub200,circle"):
  dataset, loss = (s.strip() for s in arg.split(","))
  if dataset not in _TRAIN_IMAGES:
    raise ValueError(f"paper.py: dataset must be one of "
                     f"{sorted(_TRAIN_IMAGES)}; got {dataset!r}.")
  if loss not in _LOSSES:
    raise ValueError(f"paper.py: loss must be one of {sorted(_LOSSES)}; "
                     f"got {loss!r}.")
  c = base.base_config()
  c.dataset.name = dataset
  c.dataset.num_workers = 8
  c.model.name = "bn_inception"
  c.model.embedding_dim = 512
  c.loss = base.loss_config(loss, **_LOSSES[loss])
  c.batch.eval_batch_size = 256
  c.best_metric = "recall@1"
  if loss in _PROXY_RECIPE:
    batch = 180
    steps_per_epoch = _TRAIN_IMAGES[dataset] // batch
    c.model.pooling = "avg+max"
    c.model.freeze_bn = True
    c.batch.sampler = "random"
    c.batch.size = batch
    c.dataset.preprocess.scale = (0.08, 1.0)
    c.optim.name = "adamw"
    c.optim.learning_rate = 1e-4
    c.optim.weight_decay = 1e-4
    c.optim.lr_multipliers.loss = 100.0
    c.optim.freeze_backbone_steps = steps_per_epoch  # 1 warm-up epoch
    c.optim.schedule = "step"
    c.optim.decay_every_steps = _PA_DECAY_EPOCHS[dataset] * steps_per_epoch
    c.optim.decay_factor = 0.5
    c.optim.grad_clip_value = 10.0
    c.num_train_steps = _PA_EPOCHS[dataset] * steps_per_epoch
    c.eval_every_steps = steps_per_epoch
    c.checkpoint_every_steps = steps_per_epoch
  else:
    c.dataset.preprocess.image_size = 227
    c.dataset.preprocess.scale = (0.16, 1.0)
    c.batch.sampler = "pk"
    c.batch.images_per_class = 5
    c.batch.classes_per_batch = 16 if dataset in ("cub200", "cars196") else 200
    c.optim.name = "adam"
    c.optim.learning_rate = 1e-5
    c.optim.weight_decay = 5e-4
    c.num_train_steps = _MS_STEPS[dataset]
    c.eval_every_steps = 500 if dataset in ("cub200", "cars196") else 2000
    c.checkpoint_every_steps = c.eval_every_steps
  return c
