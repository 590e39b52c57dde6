"""Host-side label checks for the proxy and class-level losses.

Under ``jit`` a loss sees labels only as traced values, so it cannot raise on
a label outside ``[0, num_classes)``: such a label silently gives a wrong
result (``jnp`` indexing clamps or wraps it; the proxy losses' one-hot masks
drop the sample). :func:`validate_labels` is the
host-side (NumPy) check the data pipeline runs on every batch or once on the
whole label set, before the labels enter a compiled step.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np

_MAX_REPORTED = 10


def validate_labels(labels, num_classes: int) -> np.ndarray:
  """Checks on the host that integer labels lie in ``[0, num_classes)``.

  Args:
    labels: an integer array of any shape (NumPy, JAX or a sequence), e.g.
      ``[B]`` or ``[devices, B]``. Must be concrete: call this outside
      ``jit``, in the data pipeline.
    num_classes: ``C``, the number of classes (rows of the proxies or class
      weights).

  Returns:
    The labels as a NumPy integer array (same shape), so the call can be
    chained: ``labels = validate_labels(labels, C)``.

  Raises:
    TypeError: ``labels`` is traced (inside ``jit``), or not of an integer
      dtype, or ``num_classes`` is not an integer.
    ValueError: ``num_classes`` < 1, or some labels are out of range; the
      message names the offending values and their positions.
  """
  if isinstance(labels, jax.core.Tracer):
    raise TypeError(
        "validate_labels is a host-side check and got a traced value; call it "
        "outside jit (in the data pipeline) on concrete labels."
    )
  if isinstance(num_classes, (bool, np.bool_)) or not isinstance(
      num_classes, numbers.Integral):
    raise TypeError(f"`num_classes` must be an int; got {num_classes!r}.")
  if num_classes < 1:
    raise ValueError(f"`num_classes` must be >= 1; got {num_classes}.")
  labels = np.asarray(labels)
  if labels.dtype == np.bool_ or not np.issubdtype(labels.dtype, np.integer):
    raise TypeError(
        f"`labels` must be an integer array of class ids; got dtype "
        f"{labels.dtype}. Cast it with `.astype(np.int32)`."
    )
  bad = (labels < 0) | (labels >= num_classes)
  if np.any(bad):
    positions = np.argwhere(bad)
    values = labels[bad]
    shown = min(len(values), _MAX_REPORTED)
    where = [tuple(int(i) for i in pos) if labels.ndim != 1 else int(pos[0])
             for pos in positions[:shown]]
    more = f" (and {len(values) - shown} more)" if len(values) > shown else ""
    raise ValueError(
        f"`labels` must lie in [0, {num_classes}); found {len(values)} "
        f"out-of-range label(s): values {sorted(set(values.tolist()))[:shown]} "
        f"at positions {where}{more}. Remap the labels to 0..{num_classes - 1} "
        f"or pass the right num_classes."
    )
  return labels
