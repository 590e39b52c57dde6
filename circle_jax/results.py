"""The results table of the loss comparisons, written and read back.

One row per loss, one column per metric; a cell is ``mean ± std`` over seeds
(the sample standard deviation, ddof=1), scaled for display (percent by
default), with the best displayed mean of each column in bold::

  | loss | runs | P@1 | R@1 | MAP@R | NMI | train s |
  | --- | ---: | ---: | ---: | ---: | ---: | ---: |
  | `circle` | 3 | **61.2 ± 0.4** | ... | 41 ± 2 |

:func:`table_markdown` and :func:`format_stat` write it;
:func:`read_table_markdown` and :func:`parse_stat` are their inverses to the
shown digits. ``experiments/compare/losses.py`` writes the tables under
``experiments/results/compare/``; ``experiments/tools/check_readme.py`` and
the tests read them.

The protocol lines of such a file (``describe_*``, :func:`hyperparameter_lines`)
say in words what a run's (JSON) config and ``metrics.json`` hold: the
data, model, batch, optimiser, how the reported step was selected, and each
loss's hyperparameters against its paper's defaults.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Stat:
  """Mean and sample standard deviation (ddof=1; None for n=1) of n values."""

  mean: float
  std: Optional[float]
  n: int


def aggregate(values: Sequence[float]) -> Optional[Stat]:
  """:class:`Stat` of ``values`` (None when there are none)."""
  values = [float(v) for v in values]
  if not values:
    return None
  std = statistics.stdev(values) if len(values) > 1 else None
  return Stat(statistics.fmean(values), std, len(values))


def format_stat(stat: Optional[Stat], scale: float = 100.0,
                digits: int = 1) -> str:
  """``"61.2 ± 0.4"`` (mean ± std, x ``scale``); one seed: ``"61.2"``.

  ``"–"`` when there is no value.
  """
  if stat is None:
    return "–"
  text = f"{stat.mean * scale:.{digits}f}"
  if stat.std is not None:
    text += f" ± {stat.std * scale:.{digits}f}"
  return text


_STAT_TEXT = re.compile(r"^(-?\d+(?:\.\d*)?)(?: ± (\d+(?:\.\d*)?))?$")


def parse_stat(text: str, scale: float = 100.0, n: int = 0
               ) -> Optional[Stat]:
  """The inverse of :func:`format_stat`, to the shown digits.

  ``"**61.2 ± 0.4**"`` -> ``Stat(0.612, 0.004, n)`` (bold markers of the best
  mean are ignored); ``"61.2"`` -> std None; ``"–"`` -> None.

  Raises:
    ValueError: ``text`` is none of these forms.
  """
  text = text.strip().strip("*")
  if text == "–":
    return None
  m = _STAT_TEXT.match(text)
  if not m:
    raise ValueError(f"'{text}' is not 'mean ± std', 'mean' or '–'")
  std = None if m.group(2) is None else float(m.group(2)) / scale
  return Stat(float(m.group(1)) / scale, std, n)


def read_table_markdown(markdown: str, scale: float = 100.0
                        ) -> Dict[str, Dict[str, Optional[Stat]]]:
  """``{loss: {column title: Stat}}`` of a :func:`table_markdown` table.

  ``markdown`` may be a whole results file: the table is found by its
  ``| loss | runs |`` header. ``Stat.n`` is the row's complete runs; the
  ``train s`` column is left out.

  Raises:
    ValueError: no such table, or a cell that :func:`parse_stat` rejects.
  """
  lines = markdown.splitlines()
  start = next((i for i, l in enumerate(lines)
                if l.startswith("| loss | runs |")), None)
  if start is None:
    raise ValueError("no '| loss | runs | ...' results table")
  cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
  titles = cells(lines[start])
  out = {}
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      break
    row = dict(zip(titles, cells(line)))
    n = int(row["runs"].split("/")[0])
    out[row["loss"].strip("`")] = {
        t: parse_stat(c, scale, n) for t, c in row.items()
        if t not in ("loss", "runs", "train s")}
  return out


def table_markdown(summary: Dict[str, Dict[str, Optional[Stat]]],
                   columns: Sequence[Tuple[str, str]],
                   runs_per_loss: Dict[str, Tuple[int, int]],
                   scale: float = 100.0, digits: int = 1) -> str:
  """The results table: one row per loss, the best mean per column in bold.

  Args:
    summary: ``{loss: {metric key: Stat or None}}``, rows in table order
      (``"train_seconds"`` gives the ``train s`` column).
    columns: ``(metric key, title)`` pairs.
    runs_per_loss: ``{loss: (complete runs, requested runs)}``.
    scale: display factor of the metric values (100: percent).
    digits: decimals shown; "best" compares the displayed means, so ties
      are all bold.

  Returns:
    The Markdown table (no trailing newline).
  """
  best = {}
  for key, _ in columns:
    shown = [round(row[key].mean * scale, digits) for row in summary.values()
             if row.get(key) is not None]
    best[key] = max(shown) if shown else None
  head = ["loss", "runs"] + [t for _, t in columns] + ["train s"]
  lines = ["| " + " | ".join(head) + " |",
           "| --- | ---: |" + " ---: |" * (len(columns) + 1)]
  for loss, row in summary.items():
    done, wanted = runs_per_loss[loss]
    cells = [f"`{loss}`", str(done) if done == wanted else f"{done}/{wanted}"]
    for key, _ in columns:
      text = format_stat(row.get(key), scale, digits)
      stat = row.get(key)
      if stat is not None and round(stat.mean * scale, digits) == best[key]:
        text = f"**{text}**"
      cells.append(text)
    cells.append(format_stat(row.get("train_seconds"), 1.0, 0))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


# ----------------------------------------------------------------------------
# The protocol lines of a results file.
# ----------------------------------------------------------------------------


def _fmt_value(v) -> str:
  return f'"{v}"' if isinstance(v, str) else repr(v)


def _hyperparameter_row(label: str, name: str,
                        hyper: Mapping[str, Any]) -> str:
  """The row of the loss ``name`` with the hyperparameters ``hyper`` (its
  config section without ``name``)."""
  # pylint: disable=g-import-not-at-top  (the codec needs no JAX)
  from circle_jax import config as config_lib
  from circle_jax import losses as losses_lib
  entry = losses_lib.get_loss(name)
  parts = []
  # The geometry, the class matrix's layout and the regularizers: shown
  # where not the default.
  geometry = {**entry.geometry_defaults(),
              **config_lib.class_layout_defaults(entry),
              **config_lib.regularizer_fields(entry)}
  for k, v in hyper.items():
    if k in geometry:
      if v != geometry[k]:
        parts.append(f"`{k}={_fmt_value(v)}`")
    elif k in entry.defaults:
      text = f"`{k}={_fmt_value(v)}`"
      if v != entry.defaults[k]:
        text += f" (paper default {_fmt_value(entry.defaults[k])})"
      parts.append(text)
    elif v is not None:  # execution options such as block_size
      parts.append(f"`{k}={_fmt_value(v)}`")
  learnable = (f"`{entry.param_name}`: {entry.param_init}"
               if entry.param_name else "none")
  return (f"| {label} | {', '.join(parts) or 'none'} | {learnable} "
          f"| {entry.paper} |")


def hyperparameter_lines(configs: Mapping[str, Mapping[str, Any]]
                         ) -> List[str]:
  """One table row per loss: its hyperparameters, those that differ from the
  registry (paper) default marked, its learnable array and its source; then
  a row per term its config adds (``config.more_losses``, labelled
  ``+ WEIGHT x `NAME```).

  Args:
    configs: ``{loss registry name: the (JSON) config of one of its runs}``,
      in row order.
  """
  lines = ["| loss | hyperparameters | learnable | source |",
           "| --- | --- | --- | --- |"]
  for loss, cfg in configs.items():
    hyper = {k: v for k, v in cfg.get("loss", {}).items() if k != "name"}
    lines.append(_hyperparameter_row(f"`{loss}`", loss, hyper))
    for key, term in (cfg.get("more_losses") or {}).items():
      # A term's weight and miner are the combination's, not the loss's.
      hyper = {k: v for k, v in term.items()
               if k not in ("name", "weight", "miner")}
      lines.append(_hyperparameter_row(
          f"+ {term['weight']:g} x `{term['name']}` (more_losses.{key})",
          term["name"], hyper))
  return lines


def describe_model(cfg: Mapping[str, Any]) -> str:
  """The ``model`` line of a results file, from a (JSON) run config."""
  m = cfg["model"]
  kwargs = ", ".join(f"{k}={v}" for k, v in sorted((m.get("kwargs") or
                                                    {}).items()))
  text = f"{m['name']}" + (f" ({kwargs})" if kwargs else "")
  text += (f", {m.get('pooling', 'avg')} pooling, embedding dim "
           f"{m['embedding_dim']}, {m.get('dtype', 'float32')}")
  if m.get("pretrained"):
    text += f", pretrained from {m['pretrained']}"
  else:
    text += ", trained from scratch"
  if m.get("freeze_bn"):
    text += ", frozen BatchNorm"
  return text


def describe_batch(cfg: Mapping[str, Any]) -> str:
  """The ``batch`` line of a results file, from a (JSON) run config."""
  b = cfg["batch"]
  if b.get("sampler", "pk") == "random":
    return f"{b['size']} random images"
  p, k = b["classes_per_batch"], b["images_per_class"]
  if b.get("sampler") == "views":
    return (f"{p} images x {k} augmented views = {p * k} (each image its "
            f"own label)")
  return f"P x K = {p} classes x {k} images = {p * k}"


def describe_more_losses(cfg: Mapping[str, Any]) -> str:
  """The terms that a (JSON) run config adds to every loss of a results file
  (``config.more_losses``), e.g. ``0.5 x `hier` (Kim, Jeong & Kwak, ...)``;
  ``""`` when it adds none."""
  # pylint: disable=g-import-not-at-top  (the codec needs no JAX)
  from circle_jax import losses as losses_lib
  return "; ".join(
      f"{term['weight']:g} x `{term['name']}` "
      f"({losses_lib.get_loss(term['name']).paper})"
      for term in (cfg.get("more_losses") or {}).values())


def describe_optim(cfg: Mapping[str, Any]) -> str:
  """The ``optimiser`` line of a results file, from a (JSON) run config."""
  o = cfg["optim"]
  text = f"{o['name']}, lr {o['learning_rate']:g}"
  text += f", weight decay {o.get('weight_decay', 0.0):g}"
  if o.get("name") in ("sgd", "rmsprop") and o.get("momentum"):
    text += f", momentum {o['momentum']:g}"
  sched = o.get("schedule", "constant")
  text += f", {sched} schedule"
  if sched == "step":
    text += (f" (x{o['decay_factor']:g} every {o['decay_every_steps']} "
             "steps)")
  if o.get("lr_warmup_steps"):
    text += f", {o['lr_warmup_steps']} warm-up steps"
  mult = {k: v for k, v in (o.get("lr_multipliers") or {}).items()
          if v != 1.0}
  if mult:
    text += ", lr x " + ", ".join(f"{v:g} ({k})" for k, v in
                                  sorted(mult.items()))
  if o.get("freeze_backbone_steps"):
    text += f", backbone frozen for {o['freeze_backbone_steps']} steps"
  if o.get("grad_clip_norm"):
    text += f", gradient norm clipped at {o['grad_clip_norm']:g}"
  if o.get("grad_clip_value"):
    text += f", gradient values clipped at {o['grad_clip_value']:g}"
  return text


def describe_data(cfg: Mapping[str, Any],
                  metrics: Sequence[Mapping[str, Any]]) -> str:
  """The ``data`` line: train / selection / test classes and images.

  ``metrics``: the ``metrics.json`` of the complete runs (the first gives
  the number of test queries and the validation split, if any).
  """
  # pylint: disable=g-import-not-at-top
  from circle_jax.data import registry
  from circle_jax.data import rotations as rotations_lib
  # pylint: enable=g-import-not-at-top
  name = cfg["dataset"]["name"]
  try:
    spec = registry.get_dataset_info(name)
  except ValueError:
    return name
  queries = None
  if metrics:
    queries = metrics[0]["result"]["test"].get("num_queries")
  images = queries or sum(spec.num_images[s] for s in spec.eval_splits)
  val = metrics[0].get("validation") if metrics else None
  kept = spec.num_train_classes - (val["num_classes"] if val else 0)
  rotations = cfg["dataset"].get("rotations", 1)
  mirror = cfg["dataset"].get("mirror_classes", False)
  train = f"train on {kept} classes"
  if rotations > 1 or mirror:
    copies = [f"{rotations} rotations"] if rotations > 1 else []
    copies += ["2 mirror images"] if mirror else []
    settings = [f"dataset.rotations={rotations}"] if rotations > 1 else []
    settings += ["dataset.mirror_classes=True"] if mirror else []
    n = kept * rotations_lib.class_copies(rotations, mirror)
    train = (f"train on {kept} classes x {' x '.join(copies)} = {n} classes "
             f"({', '.join(settings)})")
  if val:
    by_superclass = val.get("by") == "superclass"
    of = f" of held-out {spec.superclass_name}s" if by_superclass else ""
    how = ", dataset.validation_by=superclass" if by_superclass else ""
    train += (f", select on {val['num_classes']} held-out train classes{of} "
              f"({val['num_images']} images, "
              f"dataset.validation_fraction={val['fraction']:g}{how})")
  if "query" in spec.eval_splits:
    test = (f"{int(images)} query images, retrieved among "
            f"{spec.num_images['gallery']} gallery images")
  else:
    test = f"{int(images)} images, each retrieved among the others"
  return (f"{name}: {train}; test on {spec.num_test_classes} unseen classes "
          f"({test})")


def describe_selection(cfg: Mapping[str, Any],
                       metrics: Sequence[Mapping[str, Any]]) -> str:
  """The ``reported step`` line: how the step of each run was selected.

  ``metrics``: the ``metrics.json`` of the complete runs.
  """
  done = metrics
  kinds = sorted({m["result"]["selection"] for m in done})
  texts = []
  for kind in kinds:
    metric = next(m["result"].get("metric") for m in done
                  if m["result"]["selection"] == kind)
    if kind == "validation":
      texts.append(f"the step with the best validation {metric} (held-out "
                   "train classes); the table gives the test metrics of "
                   "that step")
    elif kind == "test":
      texts.append(f"the step with the best **test** {metric} (no "
                   "validation split): optimistic, since the test split "
                   "picks the step; set --config.dataset.validation_fraction "
                   "to select on held-out train classes")
    else:
      texts.append("the last step (no model selection)")
  last = cfg.get("num_train_steps")
  if (done and kinds != ["last"]
      and all(m["result"].get("step") == last for m in done)):
    texts.append("here the last step in every run")
  every = cfg.get("eval_every_steps") or 0
  cadence = (f"evaluated every {every} steps and at the end" if every else
             "evaluated at the end only")
  return "; ".join(texts or ["no completed run"]) + f" ({cadence})"
