"""Placeholder: being written."""

def pair_weights(*args, **kwargs):
  raise NotImplementedError('pair_weights')

