"""Pretrained-weight conversion: Keras ResNet and PyTorch BN-Inception.

Both loaders return the *backbone* variables ``{'params': ..., 'batch_stats':
...}`` of our Flax module; :func:`replace_backbone` puts them into a full
model's variables (checking every shape). Conversion is strict: a missing
tensor, a tensor of the wrong shape or (with ``strict=True``) an unexpected
tensor raises one ``ValueError`` listing all of them.

Layouts:

* Convolution kernels: Keras stores ``[kh, kw, in, out]`` (Flax's layout);
  PyTorch stores ``[out, in, kh, kw]`` and is transposed ``(2, 3, 1, 0)``.
* BatchNorm: Keras ``gamma, beta, moving_mean, moving_variance`` and PyTorch
  ``weight, bias, running_mean, running_var`` map to Flax ``params/scale,
  params/bias, batch_stats/mean, batch_stats/var``.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any, Dict, List, Mapping, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

from circle_jax.errors import reading_weights
from circle_jax.errors import UserError
from circle_jax.models import bn_inception as bn_inception_lib
from circle_jax.models import resnet as resnet_lib
from circle_jax.models import torch_pickle

Path = Tuple[str, ...]

# Keras weight names, in the order Keras 3 stores them (``vars/0``, ...).
_KERAS_CONV = ("kernel", "bias")
_KERAS_BN = ("gamma", "beta", "moving_mean", "moving_variance")
# (collection, Flax leaf, module kind) -> Keras weight name.
_FLAX_TO_KERAS = {
    ("params", "kernel", "conv"): "kernel",
    ("params", "bias", "conv"): "bias",
    ("params", "scale", "bn"): "gamma",
    ("params", "bias", "bn"): "beta",
    ("batch_stats", "mean", "bn"): "moving_mean",
    ("batch_stats", "var", "bn"): "moving_variance",
}


class ConversionError(UserError, ValueError):
  """Raised when a checkpoint does not match the model; lists every problem."""


def adapt_input_channels(kernel: np.ndarray, in_channels: int, *,
                         what: str = "the first convolution") -> np.ndarray:
  """The first convolution's kernel for images of ``in_channels`` channels.

  timm's rule (``timm.models._manipulate.adapt_input_conv`` with
  ``base_chans`` the kernel's own input channels ``I``): for one channel,
  the kernel summed over its ``I`` input channels (a grayscale image seen as
  ``I`` equal channels gives the same response); for ``C`` channels, the
  input channels repeated to ``C`` and scaled by ``I / C`` (RGB weights on
  4-channel images, or grayscale weights on RGB images: an image whose
  channels are equal gives the same response). ``I == C``: unchanged.

  Args:
    kernel: ``[kh, kw, I, O]`` (Flax layout), ``I`` 1 or 3.
    in_channels: ``C``, the channels of the model's images.
    what: how errors name the kernel.

  Returns:
    float32 ``[kh, kw, C, O]``.

  Raises:
    ConversionError: a kernel that is not 4-d, or ``I`` not 1 or 3 when
      ``C != I`` (one line).
  """
  kernel = np.asarray(kernel, np.float32)
  if kernel.ndim != 4:
    raise ConversionError(
        f"{what} has shape {kernel.shape}, not a [kh, kw, in, out] kernel; "
        "the weights are of another model (--config.model.pretrained).")
  have = kernel.shape[2]
  if have == in_channels:
    return kernel
  if in_channels == 1:
    return kernel.sum(axis=2, keepdims=True)
  if have not in (1, 3):
    raise ConversionError(
        f"{what} takes {have}-channel images and the model's have "
        f"{in_channels}; only 1- or 3-channel weights adapt to other images "
        "(timm's adapt_input_conv): use weights made for "
        f"{in_channels}-channel images (--config.model.pretrained).")
  reps = -(-in_channels // have)
  tiled = np.concatenate([kernel] * reps, axis=2)[:, :, :in_channels]
  return tiled * np.float32(have / in_channels)


def _expected_backbone(module, image_size: int, in_channels: int = 3
                       ) -> Dict[str, Dict[Path, Any]]:
  """Flat ``{collection: {path: ShapeDtypeStruct}}`` of a backbone's variables."""
  shapes = jax.eval_shape(
      lambda: module.init(jax.random.PRNGKey(0),
                          jnp.zeros((1, image_size, image_size, in_channels)),
                          train=False))
  return {col: flax.traverse_util.flatten_dict(shapes[col])
          for col in ("params", "batch_stats")}


# The fix printed with the first problem of each kind.
_FIXES = {
    "shape mismatch": "the weights are of another model or size: give the "
                      "weights of --config.model.name (and its options), or "
                      "the model of these weights",
    "missing": "the weights file lacks tensors the model needs: give the "
               "weights of --config.model.name (--config.model.pretrained)",
    "unexpected": "the weights file holds tensors the model does not use: "
                  "give the weights of --config.model.name "
                  "(--config.model.pretrained; in Python, strict=False "
                  "ignores them)",
}


def _report(source: str, missing: List[str], mismatched: List[str],
            unexpected: List[str]) -> None:
  """Raises one :class:`ConversionError` listing every problem; its first
  line names the first problem and the fix."""
  if not (missing or mismatched or unexpected):
    return

  def fmt(title, items):
    if not items:
      return ""
    shown = "\n    ".join(items[:40])
    more = f"\n    ... and {len(items) - 40} more" if len(items) > 40 else ""
    return f"\n  {title} ({len(items)}):\n    {shown}{more}"

  kinds = [(k, v) for k, v in (("shape mismatch", mismatched),
                               ("missing", missing),
                               ("unexpected", unexpected)) if v]
  kind, items = kinds[0]
  total = len(missing) + len(mismatched) + len(unexpected)
  others = f" (and {total - 1} more problem(s))" if total > 1 else ""
  raise ConversionError(
      f"{source} does not match the model: {kind} {items[0]}{others}; "
      f"{_FIXES[kind]}."
      + fmt("missing", missing)
      + fmt("shape mismatch", mismatched)
      + fmt("unexpected (pass strict=False to ignore)", unexpected))


# ----------------------------------------------------------------------------
# PyTorch / NumPy state dicts and BN-Inception.
# ----------------------------------------------------------------------------


def load_state_dict(path: str | os.PathLike) -> Dict[str, np.ndarray]:
  """Reads a flat ``{name: array}`` state dict from ``.pth``/``.pt``/``.npz``.

  ``.pth``/``.pt`` files are read without PyTorch
  (:func:`circle_jax.models.torch_pickle.load_torch_file`). A checkpoint that
  wraps the weights as ``{'state_dict': ...}`` or ``{'model': ...}`` is
  unwrapped, and the ``module.`` prefix of ``nn.DataParallel`` is removed.
  """
  path = os.fspath(path)
  with reading_weights(path, "a PyTorch state dict (.pth/.pt, saved with "
                       "torch.save) or a .npz of its arrays"):
    if path.endswith(".npz"):
      with np.load(path, allow_pickle=False) as z:
        sd = {k: z[k] for k in z.files}
    else:
      sd = torch_pickle.load_torch_file(path)
      for wrapper in ("state_dict", "model"):
        if (isinstance(sd, Mapping) and wrapper in sd
            and isinstance(sd[wrapper], Mapping)):
          sd = sd[wrapper]
      if not isinstance(sd, Mapping):
        raise ValueError(f"it holds a {type(sd).__name__}, not a state dict")
  out = {}
  for k, v in sd.items():
    k = k.decode() if isinstance(k, bytes) else str(k)
    if k.startswith("module."):
      k = k[len("module."):]
    out[k] = np.asarray(v)
  return out


# Tensors of the PyTorch checkpoint that the trunk does not use: the ImageNet
# classifier and BatchNorm's step counter.
_BN_INCEPTION_IGNORED_SUFFIXES = (".num_batches_tracked",)
_BN_INCEPTION_IGNORED_PREFIXES = ("last_linear.", "fc.")


def _torch_name(col: str, path: Path) -> Tuple[str, Any]:
  """PyTorch key and array transform for one flat Flax variable path."""
  module, leaf = ".".join(path[:-1]), path[-1]
  if col == "batch_stats":
    return f"{module}.running_{leaf}", None
  if leaf == "kernel":
    return f"{module}.weight", (2, 3, 1, 0)
  if leaf == "scale":
    return f"{module}.weight", None
  return f"{module}.bias", None


# The first convolutions, whose kernels adapt to the images' channels
# (:func:`adapt_input_channels`).
BN_INCEPTION_STEM = ("conv1_7x7_s2", "kernel")
RESNET_STEM = ("conv1_conv", "kernel")


def convert_bn_inception(state_dict: Mapping[str, np.ndarray], *,
                         strict: bool = True,
                         source: str = "The BN-Inception checkpoint",
                         in_channels: int = 3):
  """Converts a Cadene-layout BN-Inception state dict to backbone variables.

  Args:
    state_dict: ``{name: array}`` with PyTorch names and layouts, e.g.
      ``conv1_7x7_s2.weight [64, 3, 7, 7]``, ``conv1_7x7_s2_bn.running_mean``.
    strict: raise on tensors the trunk does not use (besides ``last_linear.*``
      and ``*.num_batches_tracked``, always ignored).
    source: how to name the checkpoint in errors.
    in_channels: the channels of the model's images; the first convolution
      is adapted to them (:func:`adapt_input_channels`: summed for
      grayscale images).

  Returns:
    ``{'params': ..., 'batch_stats': ...}`` for :class:`BNInception`, float32.
  """
  expected = _expected_backbone(bn_inception_lib.BNInception(), 224,
                                in_channels)
  out = {"params": {}, "batch_stats": {}}
  used = set()
  missing, mismatched = [], []
  for col, flat in expected.items():
    for path, spec in flat.items():
      key, perm = _torch_name(col, path)
      if key not in state_dict:
        missing.append(f"{key} (for {col}/{'/'.join(path)})")
        continue
      used.add(key)
      value = np.asarray(state_dict[key])
      if path == BN_INCEPTION_STEM and value.ndim == 4:
        value = adapt_input_channels(
            value.transpose(perm), in_channels,
            what=f"{source}: {key!r}").transpose(3, 2, 0, 1)
      want = spec.shape if perm is None else tuple(
          spec.shape[perm.index(i)] for i in range(len(perm)))
      if value.shape != want:
        mismatched.append(f"{key}: checkpoint {value.shape}, model needs {want}")
        continue
      if perm is not None:
        value = value.transpose(perm)
      out[col][path] = np.asarray(value, np.float32)
  unexpected = []
  if strict:
    unexpected = sorted(
        k for k in state_dict if k not in used
        and not k.endswith(_BN_INCEPTION_IGNORED_SUFFIXES)
        and not k.startswith(_BN_INCEPTION_IGNORED_PREFIXES))
  _report(source, sorted(missing), mismatched, unexpected)
  return {col: flax.traverse_util.unflatten_dict(v) for col, v in out.items()}


def load_bn_inception(path: str | os.PathLike, *, strict: bool = True,
                      in_channels: int = 3):
  """Loads BN-Inception ImageNet weights (``.pth`` or ``.npz``).

  Accepts Cadene's ``bn_inception-52deb4733.pth`` / ``bn_inception-239d2248.pth``
  (as used by the MS and Proxy-Anchor codes) or any ``.npz`` with the same
  names and PyTorch layouts. PyTorch is not needed.

  ``in_channels``: the channels of the model's images (1: grayscale); the
  first convolution adapts to them (:func:`adapt_input_channels`).

  Returns:
    Backbone variables ``{'params', 'batch_stats'}``; put them into a model
    with :func:`replace_backbone`.
  """
  return convert_bn_inception(load_state_dict(path), strict=strict,
                              source=f"{os.fspath(path)!r}",
                              in_channels=in_channels)


# ----------------------------------------------------------------------------
# Keras ResNet.
# ----------------------------------------------------------------------------


def _read_keras_weights(path: str) -> Dict[str, Dict[str, np.ndarray]]:
  """``{layer_name: {weight_name: array}}`` from a Keras weights file.

  Supports the legacy HDF5 layout (the ``*_weights_tf_dim_ordering_tf_kernels
  _notop.h5`` files Keras downloads, ``model.save('x.h5')``) and the Keras 3
  layout (``model.save_weights('x.weights.h5')``, and ``x.keras`` archives).
  """
  try:
    import h5py  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(
        "Reading Keras weights needs h5py (`pip install h5py==3.16.0`).") from e

  def from_h5(f) -> Dict[str, Dict[str, np.ndarray]]:
    root = f["model_weights"] if "model_weights" in f else f
    layers: Dict[str, Dict[str, np.ndarray]] = {}
    if "layer_names" in root.attrs:                 # Legacy (Keras 2 / TF).
      for lname in root.attrs["layer_names"]:
        lname = lname.decode() if isinstance(lname, bytes) else str(lname)
        g = root[lname]
        names = [n.decode() if isinstance(n, bytes) else str(n)
                 for n in g.attrs.get("weight_names", [])]
        weights = {}
        for n in names:
          short = n.split("/")[-1].split(":")[0]
          weights[short] = np.asarray(g[n])
        if weights:
          layers[lname] = weights
      return layers
    if "layers" in root:                            # Keras 3.
      for group in root["layers"].values():
        if "vars" not in group or not len(group["vars"]):
          continue
        v = group["vars"]
        lname = v.attrs.get("name", None)
        if lname is None:
          raise ValueError(
              f"{path}: a Keras 3 weights file without layer names (saved by "
              "an older Keras 3). Re-save it with `model.save('x.h5')` or "
              "keras>=3.15.")
        lname = lname.decode() if isinstance(lname, bytes) else str(lname)
        arrays = [np.asarray(v[str(i)]) for i in range(len(v))]
        order = _KERAS_BN if len(arrays) == 4 else _KERAS_CONV
        layers[lname] = dict(zip(order, arrays))
      return layers
    raise ValueError(f"{path} is not a Keras weights file (no 'layer_names' "
                     "attribute and no 'layers' group).")

  if zipfile.is_zipfile(path):                      # .keras archive.
    with zipfile.ZipFile(path) as zf:
      if "model.weights.h5" not in zf.namelist():
        raise ValueError(f"{path} is a zip file without model.weights.h5.")
      import io  # pylint: disable=g-import-not-at-top
      with h5py.File(io.BytesIO(zf.read("model.weights.h5")), "r") as f:
        return from_h5(f)
  with h5py.File(path, "r") as f:
    return from_h5(f)


def _keras_layer(path: Path) -> Tuple[str, str]:
  """Keras layer name and suffix kind for a Flax module path."""
  if len(path) == 1:                                # conv1_conv / conv1_bn
    return path[0], "bn" if path[0].endswith("_bn") else "conv"
  block, sub = path                                 # conv2_block1 / conv_1
  kind, idx = sub.split("_")
  return f"{block}_{idx}_{kind}", kind


def convert_keras_resnet(layers: Mapping[str, Mapping[str, np.ndarray]], *,
                         depth: int = 50, strict: bool = True,
                         source: str = "The Keras checkpoint",
                         in_channels: int = 3):
  """Converts ``{layer: {weight: array}}`` of a Keras ResNet to our variables.

  Args:
    layers: Keras layer name -> ``{'kernel', 'bias'}`` or ``{'gamma', 'beta',
      'moving_mean', 'moving_variance'}``.
    depth: 50, 101 or 152.
    strict: raise on Keras layers with weights that the trunk does not use
      (the ImageNet classifier ``predictions`` is always ignored).
    source, in_channels: as :func:`convert_bn_inception`.

  Returns:
    ``{'params': ..., 'batch_stats': ...}`` for :class:`ResNet`, float32.
  """
  name = f"resnet{depth}"
  if name not in resnet_lib.STAGE_SIZES:
    raise ValueError(f"`depth` must be 50, 101 or 152; got {depth}.")
  module = resnet_lib.ResNet(stage_sizes=resnet_lib.STAGE_SIZES[name])
  expected = _expected_backbone(module, 64, in_channels)
  out = {"params": {}, "batch_stats": {}}
  used = set()
  missing, mismatched = [], []
  for col, flat in expected.items():
    for path, spec in flat.items():
      lname, kind = _keras_layer(path[:-1])
      wname = _FLAX_TO_KERAS[(col, path[-1], kind)]
      key = f"{lname}/{wname}"
      if lname not in layers or wname not in layers[lname]:
        missing.append(key)
        continue
      used.add(lname)
      value = np.asarray(layers[lname][wname])
      if path == RESNET_STEM:
        value = adapt_input_channels(value, in_channels,
                                     what=f"{source}: {key!r}")
      if value.shape != spec.shape:
        mismatched.append(
            f"{key}: checkpoint {value.shape}, model needs {spec.shape}")
        continue
      out[col][path] = np.asarray(value, np.float32)
  unexpected = []
  if strict:
    unexpected = sorted(k for k in layers
                        if k not in used and k != "predictions")
  _report(source, sorted(missing), mismatched, unexpected)
  return {col: flax.traverse_util.unflatten_dict(v) for col, v in out.items()}


def load_keras_resnet(path: str | os.PathLike, *, depth: int = 50,
                      strict: bool = True, in_channels: int = 3):
  """Loads Keras ``ResNet{50,101,152}`` weights (``.h5``/``.weights.h5``/``.keras``).

  Needs ``h5py`` (not Keras). Returns backbone variables ``{'params',
  'batch_stats'}``; put them into a model with :func:`replace_backbone`.
  ``in_channels``: the channels of the model's images (1: grayscale); the
  first convolution adapts to them (:func:`adapt_input_channels`).
  """
  path = os.fspath(path)
  with reading_weights(path, f"Keras ResNet-{depth} weights (.h5, "
                       ".weights.h5 or .keras)"):
    layers = _read_keras_weights(path)
  return convert_keras_resnet(layers, depth=depth, strict=strict,
                              source=repr(path), in_channels=in_channels)


def load_keras_resnet50(path: str | os.PathLike, *, strict: bool = True):
  """Loads Keras ``ResNet50`` weights; see :func:`load_keras_resnet`."""
  return load_keras_resnet(path, depth=50, strict=strict)


def replace_backbone(variables, backbone_variables):
  """Returns ``variables`` with the backbone's params and batch_stats replaced.

  Args:
    variables: a full model's variables (``model.init(...)``), with
      ``params['backbone']`` and ``batch_stats['backbone']``.
    backbone_variables: ``{'params', 'batch_stats'}`` from a loader.

  Raises:
    ConversionError: the trees or shapes differ (wrong model for the weights).
  """
  new = dict(variables)
  missing, mismatched, unexpected = [], [], []
  for col in ("params", "batch_stats"):
    if col not in variables and not backbone_variables.get(col):
      continue  # No BatchNorm (a ViT): no batch_stats on either side.
    have = flax.traverse_util.flatten_dict(variables[col]["backbone"])
    got = flax.traverse_util.flatten_dict(backbone_variables[col])
    missing += [f"{col}/{'/'.join(p)}" for p in have if p not in got]
    unexpected += [f"{col}/{'/'.join(p)}" for p in got if p not in have]
    mismatched += [
        f"{col}/{'/'.join(p)}: weights {np.shape(got[p])}, model "
        f"{np.shape(have[p])}"
        for p in have if p in got and np.shape(got[p]) != np.shape(have[p])]
    converted = {
        p: jnp.asarray(got[p], have[p].dtype) for p in have
        if p in got}
    col_tree = dict(variables[col])
    col_tree["backbone"] = flax.traverse_util.unflatten_dict(converted)
    new[col] = col_tree
  _report("The pretrained backbone", missing, mismatched, unexpected)
  return new
