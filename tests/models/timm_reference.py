"""Imports timm for the reference tests (test-only; skips when absent).

timm imports torchvision. With the CPU build of torch pinned in
requirements-test.txt, a torchvision wheel built for CUDA (the one PyPI
serves for Linux) cannot load its C++ operators, and its
``_meta_registrations`` module then fails at import with ``operator
torchvision::nms does not exist``. The ViT code of timm uses none of those
operators, so when torchvision cannot import, this helper stands in an empty
``torchvision._meta_registrations`` and imports it again (torchvision's
Python parts then load; its detection ops would fail if called, which the
tests never do).
"""

from __future__ import annotations

import sys
import types

import pytest


def import_timm():
  """``(timm, torch)``, or skips the test when either is not installed."""
  torch = pytest.importorskip("torch")
  try:
    import torchvision  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except RuntimeError as e:
    if "torchvision::" not in str(e):
      raise
    for name in [n for n in sys.modules
                 if n == "torchvision" or n.startswith("torchvision.")]:
      del sys.modules[name]
    sys.modules["torchvision._meta_registrations"] = types.ModuleType(
        "torchvision._meta_registrations")
  except ImportError:
    pass
  timm = pytest.importorskip("timm")
  return timm, torch
