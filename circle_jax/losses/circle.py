"""Placeholder: being written."""

def circle_loss(*args, **kwargs):
  raise NotImplementedError('circle_loss')

def circle_loss_from_similarity(*args, **kwargs):
  raise NotImplementedError('circle_loss_from_similarity')

def circle_loss_class_level(*args, **kwargs):
  raise NotImplementedError('circle_loss_class_level')

def unified_loss(*args, **kwargs):
  raise NotImplementedError('unified_loss')

def unified_loss_from_similarity(*args, **kwargs):
  raise NotImplementedError('unified_loss_from_similarity')

def unified_loss_class_level(*args, **kwargs):
  raise NotImplementedError('unified_loss_class_level')

