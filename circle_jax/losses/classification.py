"""Placeholder: being written."""

def normface_loss(*args, **kwargs):
  raise NotImplementedError('normface_loss')

def cosface_loss(*args, **kwargs):
  raise NotImplementedError('cosface_loss')

def arcface_loss(*args, **kwargs):
  raise NotImplementedError('arcface_loss')

def softmax_loss(*args, **kwargs):
  raise NotImplementedError('softmax_loss')

