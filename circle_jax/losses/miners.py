"""Placeholder: being written."""

def multi_similarity_miner(*args, **kwargs):
  raise NotImplementedError('multi_similarity_miner')

def batch_hard_miner(*args, **kwargs):
  raise NotImplementedError('batch_hard_miner')

def semi_hard_miner(*args, **kwargs):
  raise NotImplementedError('semi_hard_miner')

def pair_margin_miner(*args, **kwargs):
  raise NotImplementedError('pair_margin_miner')

def distance_weighted_miner(*args, **kwargs):
  raise NotImplementedError('distance_weighted_miner')

