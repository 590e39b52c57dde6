"""Every loss's value and gradient as pinned before the loss restructure.

``data/pinned.npz`` holds the results of the cases of ``pinned_cases`` as
computed by the code before the engines / rules restructure (regenerate only
on purpose with ``python -m tests.losses.make_pinned``). Each case must
reproduce them to float32 rounding.
"""

import numpy as np
import pytest

from tests.losses import make_pinned
from tests.losses import pinned_cases

_PINNED = np.load(make_pinned.PATH)
_CASES = pinned_cases.cases()


def test_every_pinned_array_has_a_case_and_every_case_is_pinned():
  names = {k.rsplit("/", 1)[0] for k in _PINNED.files}
  pinned_cases_names = set()
  for name in _CASES:
    assert any(k.startswith(name + "/") for k in _PINNED.files), name
    pinned_cases_names.add(name)
  assert all(any(n.startswith(c) for c in pinned_cases_names) for n in names)


@pytest.mark.parametrize("name", sorted(_CASES))
def test_pinned(name):
  got = pinned_cases.flatten(name, _CASES[name]())
  want = {k: _PINNED[k] for k in _PINNED.files if k.startswith(name + "/")}
  assert sorted(got) == sorted(want)
  for key, w in want.items():
    g = got[key]
    assert g.shape == w.shape and g.dtype == w.dtype, key
    if w.dtype == bool or np.issubdtype(w.dtype, np.integer):
      np.testing.assert_array_equal(g, w, err_msg=key)
    else:
      scale = float(np.max(np.abs(w))) if w.size else 0.0
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * max(scale, 1.0),
                                 err_msg=key)
