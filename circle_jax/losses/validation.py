"""Placeholder: being written."""

def validate_labels(*args, **kwargs):
  raise NotImplementedError('validate_labels')

