"""A loss's public forms, built from one declaration of its hyperparameters.

A loss has several public forms (embedding, similarity or distance matrix,
class-level, pair weights) that take the same keyword-only hyperparameters
with the same defaults. They are declared once, as the fields of a frozen
dataclass: a pair loss's rule (:mod:`circle_jax.losses.engine.rule`) or a
plain :func:`declaration`. Every form reads them from there:

* :func:`takes` turns a hand-written function with one keyword-only
  parameter (``rule``) into the public form whose signature lists the
  declaration's fields in its place;
* the forms that only hand the rule to an engine front end are built, not
  written: :func:`embedding_form` (``engine.embedding_loss``, the shared
  ``**options``), :func:`matrix_form` (``engine.matrix_loss``) and
  :func:`class_level_form` (``engine.class_level_loss``). Their docstrings
  stay in the loss's module.

The public signature (``inspect.signature``: the registry's defaults, the
generated call tables, ``jax.jit``'s ``static_argnames``) is the one a
hand-written form would have, e.g. ``circle_loss(embeddings, labels, *,
margin=0.4, gamma=80.0, **options)``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Optional

import jax

from circle_jax.losses import engine

Array = jax.Array

_KW = inspect.Parameter.KEYWORD_ONLY
# Rule fields that the shared ``**options`` set (not a form's keywords).
_OPTION_FIELDS = ("geometry",)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY,
               inspect.Parameter.POSITIONAL_OR_KEYWORD)


def declaration(cls):
  """A frozen dataclass whose fields are a loss's hyperparameters."""
  return dataclasses.dataclass(frozen=True)(cls)


def keywords(value) -> dict:
  """The fields of a declaration's ``value`` as keyword arguments (to hand
  them on to another form of the same loss)."""
  return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def takes(declared, *, defaults=None, into: str = "rule", **fixed):
  """Builds the ``into`` keyword of a form from the fields of ``declared``.

  Args:
    declared: a dataclass (a rule or a :func:`declaration`); its fields are
      the form's keyword-only hyperparameters, in order.
    defaults: an instance of ``declared`` whose values are this form's
      defaults (e.g. the class-level settings of a paper); default: the
      class's field defaults.
    into: the keyword-only parameter of the wrapped function that receives
      ``declared(**hyperparameters)``.
    **fixed: fields this form sets itself (e.g. ``on_distance=True``); they
      are not in its signature.

  Returns:
    A decorator giving the public form.
  """
  fields = [f for f in dataclasses.fields(declared)
            if f.name not in fixed and f.name not in _OPTION_FIELDS]
  source = declared if defaults is None else defaults

  def wrap(fn):
    signature = inspect.signature(fn)
    params = []
    for p in signature.parameters.values():
      params += [p] if p.name != into else [
          inspect.Parameter(f.name, _KW, default=getattr(source, f.name),
                            annotation=f.type) for f in fields]
    positional = sum(p.kind in _POSITIONAL for p in params)

    @functools.wraps(fn)
    def form(*args, **kwargs):
      if len(args) > positional:  # Python's own words, without ``into``
        raise TypeError(f"{fn.__name__}() takes {positional} positional "
                        f"arguments but {len(args)} were given")
      given = {f.name: kwargs.pop(f.name) for f in fields
               if f.name in kwargs}
      given.update(fixed)
      value = (declared(**given) if defaults is None
               else dataclasses.replace(defaults, **given))
      return fn(*args, **kwargs, **{into: value})

    form.__signature__ = signature.replace(parameters=params)
    return form

  return wrap


def _named(fn, name: str, doc: str, declared):
  """``fn`` as the public ``name`` of ``declared``'s module: its name (in
  Python's own TypeErrors too), its docstring."""
  fn.__code__ = fn.__code__.replace(co_name=name, co_qualname=name)
  fn.__name__ = fn.__qualname__ = name
  fn.__doc__ = doc
  fn.__module__ = declared.__module__
  return fn


def embedding_form(rule_cls, name: str, doc: str):
  """``name(embeddings, labels, *, <fields>, **options)``: the rule through
  :func:`circle_jax.losses.engine.embedding_loss`."""
  def form(embeddings: Array, labels: Array, *, rule, **options) -> Array:
    return engine.embedding_loss(rule, embeddings, labels, **options)
  return takes(rule_cls, **_on_similarity(rule_cls))(
      _named(form, name, doc, rule_cls))


def matrix_form(rule_cls, name: str, doc: str, *, on_distance=False):
  """``name(similarity, labels, *, <fields>, pos_mask=None, neg_mask=None)``
  (``distance`` with ``on_distance``, a field the form then sets): the rule
  on a square ``[B, B]`` matrix through
  :func:`circle_jax.losses.engine.matrix_loss`."""
  def form(similarity: Array, labels: Array, *, rule,
           pos_mask: Optional[Array] = None,
           neg_mask: Optional[Array] = None) -> Array:
    return engine.matrix_loss(rule, similarity, labels, pos_mask=pos_mask,
                              neg_mask=neg_mask)

  def distance_form(distance: Array, labels: Array, *, rule,
                    pos_mask: Optional[Array] = None,
                    neg_mask: Optional[Array] = None) -> Array:
    return engine.matrix_loss(rule, distance, labels, pos_mask=pos_mask,
                              neg_mask=neg_mask, name="distance")

  if not on_distance:
    return takes(rule_cls, **_on_similarity(rule_cls))(
        _named(form, name, doc, rule_cls))
  return takes(rule_cls, on_distance=True)(
      _named(distance_form, name, doc, rule_cls))


def class_level_form(rule_cls, name: str, doc: str, *, defaults):
  """``name(embeddings, labels, class_weights, *, <fields>)`` with this
  form's ``defaults``: the rule through
  :func:`circle_jax.losses.engine.class_level_loss`."""
  def form(embeddings: Array, labels: Array, class_weights: Array, *,
           rule) -> Array:
    return engine.class_level_loss(rule, embeddings, labels, class_weights)
  return takes(rule_cls, defaults=defaults)(
      _named(form, name, doc, rule_cls))


def _on_similarity(rule_cls):
  """A rule's ``on_distance`` switch, set by its forms (not a keyword)."""
  names = [f.name for f in dataclasses.fields(rule_cls)]
  return {"on_distance": False} if "on_distance" in names else {}
