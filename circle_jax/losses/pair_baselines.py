"""Placeholder: being written."""

def contrastive_loss(*args, **kwargs):
  raise NotImplementedError('contrastive_loss')

def triplet_margin_loss(*args, **kwargs):
  raise NotImplementedError('triplet_margin_loss')

def lifted_structure_loss(*args, **kwargs):
  raise NotImplementedError('lifted_structure_loss')

def n_pair_loss(*args, **kwargs):
  raise NotImplementedError('n_pair_loss')

def margin_loss(*args, **kwargs):
  raise NotImplementedError('margin_loss')

