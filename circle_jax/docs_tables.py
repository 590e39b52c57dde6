"""The tables of the README and the docs, generated from the registries.

The losses' names, functions, defaults, reductions, learnable parameters and
papers are stated once, in :mod:`circle_jax.losses.registry` (the defaults in
the loss functions' signatures), and the datasets' class counts, split sizes
and Recall@K cut-offs in :mod:`circle_jax.data.registry`. The README and
``docs/*.md`` show generated copies between two markers; the opening marker
names the table::

    <!-- generated: python -m circle_jax.docs_tables losses -->
    | name | function | ... |
    <!-- end generated -->

Tables (the word after ``docs_tables`` in the marker):

* ``losses``: :func:`circle_jax.losses.loss_table_markdown`, every registry
  field of every loss.
* ``readme-losses``: :func:`readme_loss_table`, the README's shorter table.
* ``calls NAME...``: :func:`call_table` of the named functions of
  :mod:`circle_jax.losses`: each call with its keyword defaults, read from
  the signature, and the registry name of a registered loss.
* ``datasets``: :func:`dataset_table`, the dataset registry's classes, split
  sizes and Recall@K cut-offs (``circle_jax.data.DATASETS``).
* ``pml``: :func:`pml_table`, pytorch-metric-learning's components and ours
  (``circle_jax.pml_names.COMPONENTS``), each row's status computed from
  the code: a row is "present" only while its names resolve.
* ``reductions``: :func:`reduction_table`, each pair loss's terms under the
  ``reduction`` option.

``python -m circle_jax.docs_tables`` rewrites every generated table of the
README and ``docs/*.md`` in place; ``--check`` only lists the stale ones and
exits with status 1. ``tests/test_docs.py`` fails while a committed table
differs from its regeneration.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pathlib
import re
import sys
from typing import Dict, List, Sequence

from circle_jax import losses

COMMAND = "python -m circle_jax.docs_tables"
END = "<!-- end generated -->"
_BEGIN = re.compile(
    r"<!-- generated: " + re.escape(COMMAND) + r" (?P<spec>[^>]*?) -->\n")
_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _value(value) -> str:
  """A default as Python source (strings in double quotes)."""
  return json.dumps(value) if isinstance(value, str) else repr(value)


def _table(columns: Sequence[str], rows) -> str:
  """A Markdown table: header, separator, one line per row of cells."""
  lines = [columns, ["---"] * len(columns), *rows]
  return "".join(f"| {' | '.join(cells)} |\n" for cells in lines)


def readme_loss_table() -> str:
  """The README's table: name, function, defaults, reduction, learnable, paper.

  Returns:
    Markdown, one row per entry of ``circle_jax.losses.LOSSES``, ending with
    a newline.
  """
  rows = []
  for entry in losses.LOSSES.values():
    defaults = ", ".join(f"`{k}={_value(v)}`"
                         for k, v in entry.defaults.items()) or "none"
    learnable = f"`{entry.param_name}`" if entry.param_name else "none"
    rows.append([f"`{entry.name}`", f"`{entry.fn.__name__}`", defaults,
                 entry.reduction, learnable, entry.paper])
  return _table(["name", "function", "defaults", "reduction", "learnable",
                 "paper"], rows)


def _call(fn) -> str:
  """``name(positional, *, keyword=default, ...)`` from ``fn``'s signature."""
  parts, star = [], False
  for p in inspect.signature(fn).parameters.values():
    if p.kind is p.KEYWORD_ONLY and not star:
      parts.append("*")
      star = True
    if p.kind is p.VAR_POSITIONAL:
      parts.append(f"*{p.name}")
      star = True
    elif p.kind is p.VAR_KEYWORD:
      parts.append(f"**{p.name}")
    elif p.default is p.empty:
      parts.append(p.name)
    else:
      parts.append(f"{p.name}={_value(p.default)}")
  return f"{fn.__name__}({', '.join(parts)})"


def call_table(names: Sequence[str]) -> str:
  """The calls of public functions of :mod:`circle_jax.losses`, defaults shown.

  Args:
    names: function names exported by ``circle_jax.losses``.

  Returns:
    Markdown with a ``call (defaults)`` column and a ``registry name`` column
    (the ``LOSSES`` key whose function it is, or ``-``), ending with a
    newline.

  Raises:
    ValueError: a name that ``circle_jax.losses`` does not export.
  """
  registered = {e.fn.__name__: e.name for e in losses.LOSSES.values()}
  rows = []
  for name in names:
    fn = getattr(losses, name, None)
    if not callable(fn):
      raise ValueError(f"circle_jax.losses has no function {name!r}; fix the "
                       f"name in the '{COMMAND} calls' marker.")
    reg = f"`{registered[name]}`" if name in registered else "-"
    rows.append([f"`{_call(fn)}`", reg])
  return _table(["call (defaults)", "registry name"], rows)


def dataset_table() -> str:
  """Classes, images per split, Recall@K and channels of every dataset.

  Returns:
    Markdown, one row per entry of ``circle_jax.data.DATASETS``, ending with
    a newline.
  """
  from circle_jax import data  # pylint: disable=g-import-not-at-top
  rows = [[f"`{spec.name}`",
           f"{spec.num_train_classes:,} / {spec.num_test_classes:,}",
           ", ".join(f"{split} {n:,}" for split, n in spec.num_images.items()),
           ", ".join(str(k) for k in spec.ks), str(spec.channels)]
          for spec in data.DATASETS.values()]
  return _table(["name", "classes (train / test)", "images", "Recall@K",
                 "channels"], rows)


def _loss_call(name: str) -> str:
  """``losses.fn(positional..., hyper=.., ...)`` of a registered loss."""
  entry = losses.LOSSES[name]
  params = inspect.signature(entry.fn).parameters.values()
  args = [p.name for p in params
          if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
  args += [f"{k}=.." for k in entry.defaults]
  return f"`losses.{entry.fn.__name__}({', '.join(args)})`"


def pml_table() -> str:
  """pytorch-metric-learning 2.9's components and ours, with their status.

  Returns:
    Markdown: a line of counts, then one row per
    ``circle_jax.pml_names.COMPONENTS`` entry (PML name, our call, command
    line, status, difference), ending with a newline. A loss's call is read
    from its registry entry; a status is "present" only when every name the
    row needs resolves (:func:`circle_jax.pml_names.status`).
  """
  from circle_jax import pml_names  # pylint: disable=g-import-not-at-top
  rows, counts = [], {"present": 0, "not yet": 0, "left out": 0}
  for c in pml_names.COMPONENTS:
    status = pml_names.status(c)
    counts[status] += 1
    ours = c.ours
    if not ours:  # a loss: its call from the registry
      name = c.needs[0].split(":", 1)[1]
      ours = _loss_call(name) if status == "present" else f"`{name}`"
    difference = c.left_out or c.difference
    missing = pml_names.missing_options(c) if status == "present" else ()
    if missing:
      difference += ("; " if difference else "") + "not yet: " + ", ".join(
          f"`{o}`" for o in missing)
    rows.append([f"`{c.pml}`", ours, c.cli or "-", status,
                 difference or "-"])
  summary = (f"{len(rows)} components ({pml_names.count_rule()}): "
             + ", ".join(f"{n} {k}" for k, n in counts.items()) + ".\n\n")
  return summary + _table(["PML 2.9", "ours", "command line", "status",
                           "difference"], rows)


_TERMS = {
    1: ("anchor", "PML's `element` terms; every engine"),
    2: ("pair", "each set reduced on its own, then added (PML's "
        "`MultipleReducers`); the dense engine"),
    3: ("triplet", "PML's `triplet` terms (`mining=\"all\"`)"),
}


def _reduction_terms(entry):
  """``(terms, difference)`` of a loss's ``reduction`` option, read by
  tracing it on a tiny batch with ``reduction="none"`` (the terms' rank)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  x = jax.ShapeDtypeStruct((4, 3), jnp.float32)
  y = jnp.asarray([0, 0, 1, 1], jnp.int32)
  params = None if entry.param_name is None else jax.eval_shape(
      lambda: entry.init_params(jax.random.PRNGKey(0), 2, 3))
  try:
    out = jax.eval_shape(lambda e, p: entry.apply(
        e, y, p, key=jax.random.PRNGKey(0), reduction="none"), x, params)
  except (ValueError, TypeError) as e:  # the refusal's reason, in brackets
    reason = re.search(r"\((.*)\)", str(e))
    return "its own only", reason.group(1) if reason else "not supported"
  return _TERMS[len(out.shape)]


def reduction_table() -> str:
  """The ``reduction`` option of every pair loss: what a term is and how
  the reduction differs from PML's reducer on the same loss.

  Returns:
    Markdown, one row per registered loss that takes the option.
  """
  rows = []
  for name, entry in losses.LOSSES.items():
    if entry.reduction_fields():
      terms, note = _reduction_terms(entry)
      rows.append([f"`{name}`", terms, entry.reduction,
                   entry.reduction_note or note])
  return _table(["loss", "a term is", "own reduction (`reduction` unset)",
                 "with `reduction`, compared with PML"], rows)


def render(spec: str) -> str:
  """The table a marker names (see the module docstring)."""
  kind, *args = spec.split()
  if kind == "losses" and not args:
    return losses.loss_table_markdown()
  if kind == "readme-losses" and not args:
    return readme_loss_table()
  if kind == "calls" and args:
    return call_table(args)
  if kind == "datasets" and not args:
    return dataset_table()
  if kind == "pml" and not args:
    return pml_table()
  if kind == "reductions" and not args:
    return reduction_table()
  raise ValueError(
      f"Unknown generated table {spec!r}; the marker takes 'losses', "
      f"'readme-losses', 'datasets', 'pml', 'reductions' or 'calls NAME...'.")


def regenerate(text: str) -> str:
  """``text`` with every generated table rewritten from the registry.

  Raises:
    ValueError: an opening marker without its ``<!-- end generated -->``, or
      a marker that names an unknown table.
  """
  out, pos = [], 0
  for begin in _BEGIN.finditer(text):
    if begin.start() < pos:
      raise ValueError(f"Nested generated table at {begin.group(0)!r}.")
    end = text.find(END, begin.end())
    if end < 0:
      raise ValueError(f"{begin.group(0).strip()} has no {END} after it.")
    out += [text[pos:begin.end()], render(begin.group("spec")), END]
    pos = end + len(END)
  return "".join(out) + text[pos:]


def documents(root: pathlib.Path = _ROOT) -> List[pathlib.Path]:
  """The README and ``docs/*.md`` under the repository ``root``."""
  return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def stale(root: pathlib.Path = _ROOT) -> Dict[pathlib.Path, str]:
  """``{path: regenerated text}`` of the documents whose tables are stale."""
  out = {}
  for path in documents(root):
    text = path.read_text(encoding="utf-8")
    new = regenerate(text)
    if new != text:
      out[path] = new
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog=COMMAND, description=__doc__.split("\n", 1)[0])
  parser.add_argument("--root", type=pathlib.Path, default=_ROOT,
                      help="repository root (default: this checkout)")
  parser.add_argument("--check", action="store_true",
                      help="only list stale documents; exit 1 if any")
  args = parser.parse_args(argv)
  changed = stale(args.root)
  for path, text in changed.items():
    if args.check:
      print(f"stale: {path} (run `{COMMAND}`)")
    else:
      path.write_text(text, encoding="utf-8")
      print(f"rewrote the generated tables of {path}")
  return 1 if args.check and changed else 0


if __name__ == "__main__":
  sys.exit(main())
