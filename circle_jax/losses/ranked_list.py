"""Placeholder: being written."""

def ranked_list_loss(*args, **kwargs):
  raise NotImplementedError('ranked_list_loss')

def ranked_list_loss_from_distance(*args, **kwargs):
  raise NotImplementedError('ranked_list_loss_from_distance')

