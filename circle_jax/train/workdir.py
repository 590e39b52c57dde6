"""A workdir remembers the config of its run.

``DIR/config.json`` is the config the run's checkpoints were trained with.
Rerunning the job on ``DIR`` resumes only if the new config trains the same
model on the same data with the same loss and optimiser: fields that change
what a step computes (model, data, loss, batch, optimiser, seed, model
selection) must be equal, and the job refuses with
:class:`WorkdirConfigError` listing every differing field otherwise. Fields in
:data:`RESUMABLE_FIELDS` (how long to train, how often to evaluate, log and
checkpoint, where files are, how many workers) may change; the new values
are written to ``config.json`` and each change is recorded in
``DIR/config_changes.json`` with the step it took effect at.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from circle_jax import config as config_lib
from circle_jax import losses as losses_lib
from circle_jax.errors import UserError

CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.json"

# Fields that may differ when a run resumes: they change how long, how often
# or where, not what a step computes.
RESUMABLE_FIELDS = (
    "num_train_steps", "log_every_steps", "eval_every_steps",
    "checkpoint_every_steps", "eval_at_init", "eval_ks", "eval_clustering",
    "async_checkpoints", "parallelism", "dataset.data_dir",
    "dataset.manual_dir", "dataset.num_workers", "dataset.num_threads",
    "batch.eval_batch_size", "fewshot", "eval_shift", "compilation_cache_dir",
    "eval_metrics", "eval_avg_of_avgs", "oneshot",
    # Where the class matrix lives: the loss and the checkpoint are the same
    # sharded or whole (circle_jax.train.class_rows).
    "loss.shard_classes",
)

# The resumable fields that only change how a run is evaluated. A finished
# run resumed with other values is evaluated again at its last step (and at
# its selected best step, which stays the one selected when it trained).
EVALUATION_FIELDS = ("eval_ks", "eval_clustering", "eval_shift", "fewshot",
                     "eval_metrics", "eval_avg_of_avgs", "oneshot")


def in_fields(path: str, fields) -> bool:
  """Whether the flat config path ``path`` is one of ``fields`` or inside
  one of them (``'fewshot.ways'`` is in ``('fewshot',)``)."""
  return any(path == f or path.startswith(f + ".") for f in fields)


def is_evaluation_field(path: str) -> bool:
  return in_fields(path, EVALUATION_FIELDS)


# The value shown for a field that one of two configs lacks.
ABSENT = "<absent>"


class WorkdirConfigError(UserError):
  """The workdir holds a run trained with another config."""


def config_to_dict(config) -> Dict[str, Any]:
  """A ConfigDict as the plain JSON structure saved in ``config.json``."""
  return json.loads(config.to_json_best_effort(sort_keys=True))


def flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
  """``{'a': {'b': 1}}`` -> ``{'a.b': 1}`` (empty sections are kept as {})."""
  out = {}
  for k, v in tree.items():
    path = f"{prefix}{k}"
    if isinstance(v, dict) and v:
      out.update(flatten(v, path + "."))
    else:
      out[path] = v
  return out


def _added_since(path, va, vb, defaults) -> bool:
  """Whether one side lacks ``path`` and the other holds what it stands for."""
  if ABSENT not in (va, vb):
    return False
  present = vb if va == ABSENT else va
  if present is None or present == {}:  # unset, or a section without values
    return True
  return path in defaults and defaults[path] == present


def config_diff(saved: Dict[str, Any], new: Dict[str, Any]
                ) -> List[Tuple[str, Any, Any]]:
  """``(field, saved value, new value)`` for every differing leaf, sorted.

  A field that one config lacks (saved before the field existed) counts as
  at its schema default, as :func:`circle_jax.config.from_dict` reads it
  (a ``loss.*`` field: the default of the loss both configs name, e.g. the
  ``geometry`` fields), or, for any field, unset (None) in the other (an
  execution option such as ``loss.collective``).
  """
  a, b = flatten(saved), flatten(new)
  defaults = {k: v for k, v in flatten(config_to_dict(
      config_lib.base_config())).items() if not k.startswith("loss.")}
  name = a.get("loss.name")
  if name == b.get("loss.name") and name in losses_lib.LOSSES:
    defaults.update(flatten(config_to_dict(config_lib.loss_config(name)),
                            "loss."))
  out = []
  for path in sorted(set(a) | set(b)):
    va, vb = a.get(path, ABSENT), b.get(path, ABSENT)
    if va != vb and not _added_since(path, va, vb, defaults):
      out.append((path, va, vb))
  return out


def load_config(workdir: str) -> Optional[Dict[str, Any]]:
  """The saved ``config.json`` of a workdir, or None."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise WorkdirConfigError(
        f"{path} cannot be read ({e}); restore it, or start fresh with "
        "another --workdir.") from None


def check_resume(workdir: str, new: Dict[str, Any], *, resume_step: int,
                 force: bool = False) -> List[Tuple[str, Any, Any]]:
  """Compares a workdir's saved config with the new one before resuming.

  Args:
    workdir: the run's folder.
    new: :func:`config_to_dict` of the new config.
    resume_step: the checkpoint step the run would resume from.
    force: resume even if fields outside :data:`RESUMABLE_FIELDS` changed.

  Returns:
    The differences (all resumable unless ``force``).

  Raises:
    WorkdirConfigError: a non-resumable field differs and not ``force``; the
      message lists every such field with its saved and new value.
  """
  saved = load_config(workdir)
  if saved is None:
    return []
  diff = config_diff(saved, new)
  fixed = [d for d in diff if not _resumable(d[0])]
  if fixed and not force:
    shown = "; ".join(f"{p}: {_short(a)} -> {_short(b)}" for p, a, b in fixed)
    raise WorkdirConfigError(
        f"{workdir} holds a run at step {resume_step} trained with another "
        f"config ({shown}). To start fresh use another --workdir (or delete "
        "this one); to resume it with the new values anyway pass "
        "--force_resume.")
  return diff


def _resumable(path: str) -> bool:
  return in_fields(path, RESUMABLE_FIELDS)


def _short(v) -> str:
  text = json.dumps(v) if v != ABSENT else v
  return text if len(text) <= 60 else text[:57] + "..."


def record(workdir: str, new: Dict[str, Any], *, step: int,
           changes: List[Tuple[str, Any, Any]]) -> None:
  """Writes ``config.json`` and appends ``changes`` to ``config_changes.json``."""
  os.makedirs(workdir, exist_ok=True)
  _write_json(os.path.join(workdir, CONFIG_FILE), new)
  if not changes:
    return
  path = os.path.join(workdir, CHANGES_FILE)
  history = []
  if os.path.exists(path):
    with open(path) as f:
      history = json.load(f)
  history.append({
      "step": int(step),
      "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
      "changes": {p: {"from": a, "to": b} for p, a, b in changes},
  })
  _write_json(path, history)


def load_changes(workdir: str) -> list:
  path = os.path.join(workdir, CHANGES_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return json.load(f)


def _write_json(path: str, value) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
