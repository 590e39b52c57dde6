"""Placeholder: being written."""

def proxy_anchor_loss(*args, **kwargs):
  raise NotImplementedError('proxy_anchor_loss')

def ranked_proxy_anchor_loss(*args, **kwargs):
  raise NotImplementedError('ranked_proxy_anchor_loss')

