"""Datasets and input pipelines for zero-shot deep metric learning.

* :func:`get_dataset_info` / :func:`load_split`: tfds builders of CUB-200,
  Cars-196, SOP, In-Shop, Omniglot and digits with class-disjoint splits,
  stored as ArrayRecord and read with random access.
* :class:`PKSampler`, :class:`RandomSampler`, :class:`ViewSampler` (V
  augmented views of each image, labelled by the image): batches as
  deterministic functions of ``(seed, step)``; :class:`HierarchicalSampler`
  (PML's: classes from a few super-classes per batch),
  :class:`FixedSetOfTriplets` and :class:`TuplesToWeightsSampler` (PML's),
  too.
* :func:`split_classes`: a class-disjoint validation split of the train
  classes, for model selection.
* :class:`RotatedClasses`: each train class and its rotations by 90, 180,
  270 degrees as classes (the few-shot practice on Omniglot).
* :func:`get_preprocess`: the papers' preprocessing (``bninception``,
  ``imagenet``, ``grayscale``, ``grayscale_affine``; train and eval
  variants).
* :func:`train_iterator`, :func:`eval_iterator`, :func:`global_batch`: grain
  pipelines and multi-host batch assembly.

See docs/data.md.
"""

from circle_jax.data.augment import get_preprocess
from circle_jax.data.augment import ImageDecodeError
from circle_jax.data.augment import Preprocess
from circle_jax.data.augment import PRESETS
from circle_jax.data.builders import CorruptImageError
from circle_jax.data.builders import EncryptedArchiveError
from circle_jax.data.builders import MissingDatasetFilesError
from circle_jax.data.builders import split_labels
from circle_jax.data.builders import split_super_labels
from circle_jax.data.pipeline import eval_iterator
from circle_jax.data.pipeline import EvalIterable
from circle_jax.data.pipeline import global_batch
from circle_jax.data.pipeline import train_iterator
from circle_jax.data.pipeline import TrainIterator
from circle_jax.data.registry import DATASETS
from circle_jax.data.registry import DatasetSpec
from circle_jax.data.registry import get_builder
from circle_jax.data.registry import get_dataset_info
from circle_jax.data.registry import is_prepared
from circle_jax.data.registry import load_split
from circle_jax.data.rotations import class_copies
from circle_jax.data.rotations import ROTATIONS
from circle_jax.data.rotations import RotatedClasses
from circle_jax.data.samplers import FixedSetOfTriplets
from circle_jax.data.samplers import HierarchicalSampler
from circle_jax.data.samplers import PKSampler
from circle_jax.data.samplers import RandomSampler
from circle_jax.data.samplers import TuplesToWeightsSampler
from circle_jax.data.samplers import ViewSampler
from circle_jax.data.splits import ClassSubset
from circle_jax.data.splits import holdout_classes
from circle_jax.data.splits import holdout_superclasses
from circle_jax.data.splits import num_holdout_classes
from circle_jax.data.splits import split_classes
