"""Writes the small torch.save fixtures read by tests/models/test_torch_pickle.py.

Run from the repository root with PyTorch installed (made with torch 2.13.0):

  python tests/models/data/make_torch_fixtures.py

Every tensor's values follow from its name (see ``expected_fixture`` in the
test), so the test needs no PyTorch.
"""

import collections
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def fixture_state_dict():
  base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
  sd = collections.OrderedDict()
  sd["conv.weight"] = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).reshape(
      2, 3, 2, 2) / 8
  sd["transposed"] = base.t()            # non-contiguous view of `base`
  sd["offset_view"] = base[1:, 2:]       # view with a storage offset
  sd["base"] = base
  sd["long"] = torch.tensor([1, 2, -3], dtype=torch.int64)
  sd["half"] = torch.tensor([0.5, -1.5], dtype=torch.float16)
  sd["bf16"] = torch.tensor([0.5, -2.0], dtype=torch.bfloat16)
  sd["double_scalar"] = torch.tensor(3.25, dtype=torch.float64)
  sd["empty"] = torch.zeros(0, 3)
  sd["param"] = torch.nn.Parameter(torch.full((2, 2), 7.0))
  sd["bn.num_batches_tracked"] = torch.tensor(5)
  return sd


if __name__ == "__main__":
  sd = fixture_state_dict()
  torch.save(sd, os.path.join(HERE, "tiny_zip.pth"))
  torch.save(sd, os.path.join(HERE, "tiny_legacy.pth"),
             _use_new_zipfile_serialization=False)
  torch.save({"state_dict": {"module." + k: v for k, v in sd.items()}},
             os.path.join(HERE, "tiny_wrapped.pth"))
