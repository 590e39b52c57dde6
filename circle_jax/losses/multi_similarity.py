"""Placeholder: being written."""

def multi_similarity_loss(*args, **kwargs):
  raise NotImplementedError('multi_similarity_loss')

def multi_similarity_loss_from_similarity(*args, **kwargs):
  raise NotImplementedError('multi_similarity_loss_from_similarity')

