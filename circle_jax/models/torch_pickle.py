"""A torch-free reader for PyTorch ``.pth`` / ``.pt`` state dicts.

``torch.save`` writes either

* the zip format (PyTorch >= 1.6): ``<archive>/data.pkl`` is a pickle whose
  tensors reference storages through persistent ids ``('storage',
  StorageType, key, location, numel)``; the raw little-endian (see the
  ``byteorder`` record) bytes of storage ``key`` are the record
  ``<archive>/data/<key>``; or
* the legacy pickle format (PyTorch 0.4 - 1.5, and the 2017-era checkpoints
  such as Cadene's BN-Inception): a sequence of pickles (magic number,
  protocol version, system info, the object with persistent ids
  ``('storage', StorageType, key, location, numel, view_metadata)``, the list
  of storage keys), followed by each storage as an int64 element count and
  its raw bytes.

Tensors are rebuilt by ``torch._utils._rebuild_tensor{,_v2,_v3}(storage,
offset, size, stride, ...)``. This module unpickles with an allow-list
(ordered dicts, those rebuild functions, storage types and dtypes), so it runs
no code from the file, and rebuilds every tensor as a NumPy array with
``numpy.lib.stride_tricks.as_strided`` (bounds-checked).

The very old tar format (PyTorch < 0.1.10) and TorchScript archives are not
supported; load those with PyTorch and save ``{k: v.numpy()}`` with
``numpy.savez``.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import zipfile
from typing import Any, Callable, Dict

import ml_dtypes
import numpy as np

_LEGACY_MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL_VERSION = 1001

_STORAGE_DTYPES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
    "ComplexFloatStorage": np.complex64,
    "ComplexDoubleStorage": np.complex128,
    "UntypedStorage": np.uint8,
}

_TORCH_DTYPES = {
    "float32": np.float32, "float": np.float32,
    "float64": np.float64, "double": np.float64,
    "float16": np.float16, "half": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "int64": np.int64, "long": np.int64,
    "int32": np.int32, "int": np.int32,
    "int16": np.int16, "short": np.int16,
    "int8": np.int8, "uint8": np.uint8, "bool": np.bool_,
    "complex64": np.complex64, "complex128": np.complex128,
}


class _StorageType:
  """Stands for ``torch.<X>Storage`` in the pickle."""

  def __init__(self, name: str):
    self.name = name
    self.dtype = np.dtype(_STORAGE_DTYPES[name])


class _Dtype:
  """Stands for ``torch.<dtype>`` in the pickle (``_rebuild_tensor_v3``)."""

  def __init__(self, name: str):
    self.dtype = np.dtype(_TORCH_DTYPES[name])


class _Storage:
  """A flat NumPy buffer standing for a (typed) torch storage.

  In the legacy format the bytes follow the pickle, so ``data`` is None while
  unpickling and tensors are rebuilt lazily (:class:`_LazyTensor`).
  """

  def __init__(self, data):
    self.data = data


class _LazyTensor:
  """A tensor whose storage bytes have not been read yet."""

  def __init__(self, args):
    self.args = args

  def materialize(self):
    return _rebuild_tensor(*self.args)


def _materialize(obj):
  if isinstance(obj, _LazyTensor):
    return obj.materialize()
  if isinstance(obj, dict):
    return type(obj)((k, _materialize(v)) for k, v in obj.items())
  if isinstance(obj, (list, tuple)):
    return type(obj)(_materialize(v) for v in obj)
  return obj


def _as_str(x) -> str:
  return x.decode("ascii") if isinstance(x, bytes) else x


def _rebuild_tensor(storage, storage_offset, size, stride, *_unused):
  if not isinstance(storage, _Storage):
    raise pickle.UnpicklingError("A tensor does not reference a storage.")
  if storage.data is None:
    return _LazyTensor((storage, storage_offset, size, stride))
  flat = storage.data
  size = tuple(int(s) for s in size)
  stride = tuple(int(s) for s in stride)
  if len(size) != len(stride):
    raise pickle.UnpicklingError(
        f"Tensor size {size} and stride {stride} differ in rank.")
  if any(s == 0 for s in size):
    return np.zeros(size, flat.dtype)
  if min(stride, default=0) < 0:
    raise pickle.UnpicklingError(f"Negative tensor stride {stride}.")
  last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
  if storage_offset < 0 or last >= flat.size:
    raise pickle.UnpicklingError(
        f"Tensor (offset {storage_offset}, size {size}, stride {stride}) "
        f"exceeds its storage of {flat.size} elements; the file is corrupt.")
  view = np.lib.stride_tricks.as_strided(
      flat[storage_offset:], shape=size,
      strides=tuple(s * flat.itemsize for s in stride), writeable=False)
  return np.array(view, order="C")  # Owns its memory, C-contiguous.


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
                       backward_hooks, metadata=None):
  del requires_grad, backward_hooks
  if metadata:
    raise pickle.UnpicklingError(
        f"Tensors with metadata {metadata} (conjugate/negative views) are not "
        "supported; call `.resolve_conj().resolve_neg()` before saving.")
  return _rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad,
                       backward_hooks, dtype, metadata=None):
  tensor = _rebuild_tensor_v2(storage, storage_offset, size, stride,
                              requires_grad, backward_hooks, metadata)
  if isinstance(tensor, _LazyTensor):
    return tensor
  if isinstance(dtype, _Dtype) and tensor.dtype != dtype.dtype:
    raise pickle.UnpicklingError(
        f"Tensor dtype {dtype.dtype} differs from its storage's {tensor.dtype}.")
  return tensor


def _rebuild_parameter(data, requires_grad, backward_hooks, *state):
  del requires_grad, backward_hooks, state
  return data


_ALLOWED: Dict[tuple, Callable[..., Any]] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}


class _Unpickler(pickle.Unpickler):
  """Unpickles only plain containers, tensors, storage types and dtypes."""

  def __init__(self, file, persistent_load):
    super().__init__(file, encoding="utf-8")
    self._persistent_load = persistent_load

  def find_class(self, module, name):
    if (module, name) in _ALLOWED:
      return _ALLOWED[(module, name)]
    if module in ("torch", "torch.cuda") and name in _STORAGE_DTYPES:
      return _StorageType(name)
    if module == "torch" and name in _TORCH_DTYPES:
      return _Dtype(name)
    raise pickle.UnpicklingError(
        f"Refusing to unpickle `{module}.{name}`: a state-dict reader only "
        "accepts dicts of tensors. If the file holds a whole model or other "
        "objects, load it with PyTorch and save `{k: v.numpy() for k, v in "
        "model.state_dict().items()}` with `numpy.savez`.")

  def persistent_load(self, pid):
    return self._persistent_load(pid)


def _read_zip(path: str) -> Any:
  with zipfile.ZipFile(path) as zf:
    names = zf.namelist()
    pkl = [n for n in names if n.endswith("data.pkl")]
    if len(pkl) != 1:
      raise ValueError(
          f"{path} is a zip file but not a torch.save archive (expected one "
          f"'<archive>/data.pkl' record, found {pkl or 'none'}).")
    prefix = pkl[0][: -len("data.pkl")]
    byteorder = "little"
    if prefix + "byteorder" in names:
      byteorder = zf.read(prefix + "byteorder").decode("ascii")
    if byteorder not in ("little", "big"):
      raise ValueError(f"{path}: unknown byteorder record {byteorder!r}.")
    storages: Dict[str, _Storage] = {}

    def persistent_load(pid):
      pid = tuple(pid)
      if _as_str(pid[0]) != "storage" or len(pid) != 5:
        raise pickle.UnpicklingError(f"Unsupported persistent id {pid[:1]}.")
      storage_type, key, _location, numel = pid[1:]
      key = _as_str(key)
      if key not in storages:
        dtype = storage_type.dtype.newbyteorder(
            "<" if byteorder == "little" else ">")
        raw = zf.read(f"{prefix}data/{key}")
        count = int(numel) if storage_type.name != "UntypedStorage" else len(raw)
        if len(raw) < count * dtype.itemsize:
          raise pickle.UnpicklingError(
              f"Storage {key} has {len(raw)} bytes, expected "
              f"{count * dtype.itemsize}; the file is truncated.")
        data = np.frombuffer(raw, dtype, count=count)
        storages[key] = _Storage(data.astype(dtype.newbyteorder("=")))
      return storages[key]

    with zf.open(pkl[0]) as f:
      return _Unpickler(io.BytesIO(f.read()), persistent_load).load()


def _read_legacy(path: str) -> Any:
  with open(path, "rb") as f:
    magic = pickle.load(f)
    if magic != _LEGACY_MAGIC_NUMBER:
      raise ValueError(f"{path} is not a torch.save file (bad magic number).")
    version = pickle.load(f)
    if version != _LEGACY_PROTOCOL_VERSION:
      raise ValueError(f"{path}: unsupported legacy protocol {version}.")
    sys_info = pickle.load(f)
    little = bool(sys_info.get("little_endian", True))
    pending: Dict[str, tuple] = {}     # root key -> (storage type, numel)
    roots: Dict[str, _Storage] = {}
    views: list = []                   # (view storage, root key, offset, size)

    def persistent_load(pid):
      pid = tuple(pid)
      if _as_str(pid[0]) != "storage" or len(pid) != 6:
        raise pickle.UnpicklingError(
            f"Unsupported persistent id {pid[:1]}; only state dicts of "
            "tensors can be read without PyTorch.")
      storage_type, root_key, _location, numel, view_metadata = pid[1:]
      root_key = _as_str(root_key)
      if root_key not in roots:
        roots[root_key] = _Storage(None)
        pending[root_key] = (storage_type, int(numel))
      if view_metadata is None:
        return roots[root_key]
      _view_key, offset, size = view_metadata
      view = _Storage(None)
      views.append((view, root_key, int(offset), int(size)))
      return view

    obj = _Unpickler(f, persistent_load).load()
    keys = [_as_str(k) for k in pickle.load(f)]
    for key in keys:
      if key not in pending:
        raise pickle.UnpicklingError(f"Unknown storage key {key}.")
      storage_type, numel = pending[key]
      (count,) = struct.unpack("<q" if little else ">q", f.read(8))
      dtype = storage_type.dtype.newbyteorder("<" if little else ">")
      raw = f.read(count * dtype.itemsize)
      if count != numel or len(raw) != count * dtype.itemsize:
        raise pickle.UnpicklingError(
            f"Storage {key}: expected {numel} elements of {dtype}, the file "
            "has fewer; it is truncated or corrupt.")
      data = np.frombuffer(raw, dtype).astype(dtype.newbyteorder("="))
      roots[key].data = data
    missing = sorted(k for k, r in roots.items() if r.data is None)
    if missing:
      raise pickle.UnpicklingError(f"Storages {missing} have no data.")
    for view, root_key, offset, size in views:
      view.data = roots[root_key].data[offset: offset + size]
    return _materialize(obj)


def load_torch_file(path: str | os.PathLike) -> Any:
  """Reads a ``torch.save`` file (zip or legacy format) without PyTorch.

  Args:
    path: a ``.pth`` / ``.pt`` file holding (nested) dicts of tensors.

  Returns:
    The unpickled object with every tensor as a NumPy array (bfloat16 via
    ``ml_dtypes``).

  Raises:
    pickle.UnpicklingError: the file holds objects other than containers and
      tensors (e.g. a whole ``nn.Module``), or is corrupt.
    ValueError: the file is not a ``torch.save`` file.
  """
  path = os.fspath(path)
  if zipfile.is_zipfile(path):
    return _read_zip(path)
  with open(path, "rb") as f:
    head = f.read(262)
  if len(head) > 261 and head[257:262] == b"ustar":
    raise ValueError(
        f"{path} uses the tar format of PyTorch < 0.1.10; load it with that "
        "PyTorch and re-save it.")
  return _read_legacy(path)
