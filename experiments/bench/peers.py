"""The peer library of the loss benchmarks: pytorch-metric-learning.

:func:`load_torch` imports torch and pytorch-metric-learning lazily (the
``[bench]`` extra; without them the benchmarks report "n/a");
:func:`pml_loss` builds the peer's implementation of a registry loss with the
hyperparameters mapped from ours (``experiments.bench.losses``,
``experiments.bench.contrastive``). Which PML class is a registry loss's
is read from :data:`circle_jax.pml_names.PML_LOSS_CLASSES` (the migration
table's one mapping); a loss whose hyperparameters carry PML's constructor
names and units is built from it generically (:func:`pml_loss`).
"""

from __future__ import annotations

import inspect
import math

from circle_jax import pml_names


def load_torch():
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import pytorch_metric_learning  # pylint: disable=import-outside-toplevel
    from pytorch_metric_learning import losses as pml  # pylint: disable=import-outside-toplevel
    from pytorch_metric_learning import miners as pml_miners  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return None, f"pytorch-metric-learning not installed ({e.name}): pip install -e .[bench]"
  return (torch, pytorch_metric_learning, pml, pml_miners), ""


def _generic(cls, component, hyper, num_classes, dim):
  """``cls`` built from ``hyper`` (ours, renamed to PML's names as the
  migration table's row states) and the class-matrix sizes its
  constructor asks for. Only the constructor's named parameters are
  passed (the others take PML's defaults)."""
  params = inspect.signature(cls.__init__).parameters
  sizes = {"num_classes": num_classes, "embedding_size": dim,
           "descriptors_dim": dim, "l": dim, "K": num_classes}
  kwargs = {k: v for k, v in sizes.items() if k in params}
  ours = {o: p for p, o in pml_names.renames(component).items()}
  for k, v in hyper.items():
    if ours.get(k, k) in params:
      kwargs[ours.get(k, k)] = v
  return cls(**kwargs)


def pml_forward(name, loss_fn, miner, x, labels):
  """The peer's loss of ``x`` (``[B, D]``) as the registry loss ``name``
  sees it: VICReg's two views are rows ``2i`` and ``2i + 1``; Manifold's
  labels (each sample's proxy) are PML's ``indices_tuple``."""
  if name == "vicreg":
    return loss_fn(x[0::2], ref_emb=x[1::2])
  if name == "manifold":
    return loss_fn(x, indices_tuple=labels)
  if miner is not None:
    return loss_fn(x, labels, miner(x, labels))
  return loss_fn(x, labels)


def pml_loss(mods, name, hyper, num_classes, dim):
  """The peer library's implementation of registry loss ``name`` (or None).

  Returns ``(loss_module, miner_or_None)`` with the hyperparameters mapped
  from ours where the library has the same parameter.
  """
  _, _, pml, pml_miners = mods
  h = hyper
  if name == "circle":
    return pml.CircleLoss(m=h["margin"], gamma=h["gamma"]), None
  if name == "multi_similarity":
    miner = (pml_miners.MultiSimilarityMiner(epsilon=h["epsilon"])
             if h["mining"] else None)
    return pml.MultiSimilarityLoss(alpha=h["alpha"], beta=h["beta"],
                                   base=h["base"]), miner
  if name == "proxy_anchor":
    return pml.ProxyAnchorLoss(num_classes, dim, margin=h["margin"],
                               alpha=h["alpha"]), None
  if name == "contrastive":
    return pml.ContrastiveLoss(pos_margin=h["pos_margin"],
                               neg_margin=h["neg_margin"]), None
  if name == "triplet":
    if h["mining"] == "batch_hard":
      return (pml.TripletMarginLoss(margin=h["margin"]),
              pml_miners.BatchHardMiner())
    return pml.TripletMarginLoss(margin=h["margin"]), None
  if name == "lifted_structure":
    return pml.LiftedStructureLoss(neg_margin=h["margin"]), None
  if name == "supcon":
    return pml.SupConLoss(temperature=h["tau"]), None
  if name == "nt_xent":
    return pml.NTXentLoss(temperature=h["tau"]), None
  if name == "n_pair":
    return pml.NPairsLoss(), None
  if name == "margin":
    return pml.MarginLoss(margin=h["margin"], nu=h["nu"], learn_beta=True,
                          num_classes=num_classes), None
  if name == "proxy_nca":
    return pml.ProxyNCALoss(num_classes, dim, softmax_scale=h["scale"]), None
  if name == "soft_triple":
    return pml.SoftTripleLoss(num_classes, dim,
                              centers_per_class=h["centers_per_class"],
                              la=h["la"], gamma=h["gamma"],
                              margin=h["margin"]), None
  if name == "normface":
    return pml.NormalizedSoftmaxLoss(num_classes, dim,
                                     temperature=1.0 / h["scale"]), None
  if name == "cosface":
    return pml.CosFaceLoss(num_classes, dim, margin=h["margin"],
                           scale=h["scale"]), None
  if name == "arcface":
    return pml.ArcFaceLoss(num_classes, dim,
                           margin=math.degrees(h["margin"]),
                           scale=h["scale"]), None
  if name == "subcenter_arcface":
    return pml.SubCenterArcFaceLoss(
        num_classes=num_classes, embedding_size=dim,
        margin=math.degrees(h["margin"]), scale=h["scale"],
        sub_centers=h["centers_per_class"]), None
  cls = getattr(pml, pml_names.PML_LOSS_CLASSES.get(name, ""), None)
  if cls is None:
    return None
  return _generic(cls, pml_names.find(f"losses.{cls.__name__}"), h,
                  num_classes, dim), None
