"""The ``--config`` flag (:func:`DEFINE_config_file`): ml_collections'
config file flag, then the switch to a loss's or a model's own defaults when
the command line names another one (:func:`switch_loss`,
:func:`switch_model`). The fields and their defaults are
:mod:`circle_jax.config`'s.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from absl import flags
import ml_collections
from ml_collections import config_flags

from circle_jax import config as config_lib
from circle_jax import losses as losses_lib
from circle_jax import models as models_lib


def _set_path(config, path: str, value) -> None:
  """``config.<path> = value`` for a dotted ``path``."""
  *parents, field = path.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[field] = value


def _switched(section: str, overrides: Mapping[str, Any],
              file_name: Optional[str], registry) -> Optional[str]:
  """The name that ``overrides`` give ``config.<section>`` if it is another
  entry of ``registry`` than the config file's ``file_name`` (else None).

  Raises:
    ConfigValueError: the name is not in ``registry`` (the message lists it).
  """
  name = overrides.get(f"{section}.name")
  if name is None or name == file_name:
    return None
  if name not in registry:
    plural = {"loss": "losses"}.get(section, section + "s")
    raise config_lib.ConfigValueError(
        f"config.{section}.name: unknown {section} {name!r}; known "
        f"{plural}: {', '.join(sorted(registry))}.")
  return name


def switch_loss(config: ml_collections.ConfigDict,
                overrides: Mapping[str, Any],
                file_loss: Optional[str] = None) -> ml_collections.ConfigDict:
  """Applies the command line's ``--config.loss.name`` to ``config`` (in
  place), whatever the order of the flags.

  When the command line names another loss than the config file, the whole
  ``config.loss`` section is replaced by that loss's own
  (:func:`circle_jax.config.loss_config`, its paper defaults) and the command
  line's ``--config.loss.*`` overrides are applied again, in their order:
  ``--config.loss.beta=40 --config.loss.name=multi_similarity`` trains
  Multi-Similarity with ``alpha=2, beta=40, base=0.5, epsilon=0.1``. Without
  ``--config.loss.name`` (or with the file's own loss name) the file's loss
  values are kept.

  Args:
    config: the config after the command line's overrides.
    overrides: the ``{path: value}`` of the ``--config.*`` overrides, in
      command-line order (``config_flags.get_override_values``).
    file_loss: the config file's loss name (before the overrides).

  Returns:
    ``config``.

  Raises:
    ConfigValueError: an unknown loss name, or a ``--config.loss.<field>``
      override that the selected loss does not have (the message lists the
      ones it has).
  """
  if not isinstance(config, ml_collections.ConfigDict) or "loss" not in config:
    return config
  name = _switched("loss", overrides, file_loss, losses_lib.LOSSES)
  if name is not None:
    config.loss = config_lib.loss_config(name)
    for path, value in overrides.items():
      if path.startswith("loss.") and path != "loss.name":
        _set_path(config, path, value)
  held = getattr(config.loss, "held", {})
  if held:
    field = next(iter(held))
    fields = [f for f in config.loss.keys() if f != "name"]
    raise config_lib.ConfigValueError(
        f"config.loss.{field}: loss {config.loss.get('name')!r} has no "
        f"hyperparameter {field!r}; it accepts {sorted(fields)} "
        "(--config.loss.name=NAME selects another loss).")
  return config


# The model fields that belong to one model: switching the model on the
# command line drops the config file's values (the new model's defaults).
MODEL_OWN_FIELDS = ("kwargs", "pretrained")


def switch_model(config: ml_collections.ConfigDict,
                 overrides: Mapping[str, Any],
                 file_model: Optional[str] = None
                 ) -> ml_collections.ConfigDict:
  """Applies the command line's ``--config.model.name`` to ``config`` (in
  place).

  As for the loss (:func:`switch_loss`): when the command line names another
  model than the config file, the file's options of its own model
  (:data:`MODEL_OWN_FIELDS`: ``model.kwargs``, e.g. conv4's ``width``, and
  ``model.pretrained``) are replaced by the new model's (its backbone's
  options at their defaults, :func:`circle_jax.models.backbone_defaults`; no
  weights file), and the command line's ``--config.model.kwargs.<option>=v``
  or ``--config.model.pretrained=FILE`` are applied again, in any flag
  order. The fields every model has (``embedding_dim``, ``pooling``,
  ``dtype``, ...) are kept.

  Returns:
    ``config``.
  """
  if not isinstance(config, ml_collections.ConfigDict) or "model" not in config:
    return config
  name = _switched("model", overrides, file_model, models_lib.MODELS)
  if name is None:
    return config
  config.model.kwargs = config_lib.Config(models_lib.backbone_defaults(name))
  config.model.pretrained = ""
  config_lib.lock(config)  # (the new kwargs open, with their path)
  own = tuple(f"model.{f}" for f in MODEL_OWN_FIELDS)
  for path, value in overrides.items():
    if path in own or path.startswith(tuple(o + "." for o in own)):
      _set_path(config, path, value)
  return config


def DEFINE_config_file(  # pylint: disable=invalid-name
    name: str, default: Optional[str] = None, help_string: str = "",
    flag_values: flags.FlagValues = flags.FLAGS,
    sys_argv: Optional[Sequence[str]] = None) -> flags.FlagHolder:
  """``config_flags.DEFINE_config_file``, then :func:`switch_loss` and
  :func:`switch_model`.

  ``--config=FILE`` or ``FILE:ARG``, then ``--config.a.b=value`` overrides,
  parsed by ml_collections in command-line order. Its
  ``accept_new_attributes`` lets an override name a field that the file's
  loss section lacks (``--config.loss.beta=40`` on a Circle config, before
  or after ``--config.loss.name=multi_similarity``): the section holds it
  (:class:`circle_jax.config.LossSection`), and the schema refuses any
  other unknown field (:class:`circle_jax.config.ConfigFieldError`).
  (``lock_config=False``: the schema's configs come locked, and ml_collections'
  own lock would close the open sections.)
  Once absl has parsed the command line it runs the flag's validator, which
  reads the overrides (``config_flags.get_override_values``) and the file's
  loss and model names (the defaults of the ``--config.loss.name`` and
  ``--config.model.name`` flags, i.e. the file's values) and switches the
  two sections (:func:`switch_loss`, :func:`switch_model`). Errors are
  absl flag errors, one line each.

  Args:
    name: the flag's name (``config``).
    default: default config file.
    help_string: the flag's help.
    flag_values: where to define it.
    sys_argv: the command line to read overrides from (default: sys.argv, as
      ml_collections does).

  Returns:
    The flag holder; ``.value`` is the locked ConfigDict.
  """
  holder = config_flags.DEFINE_config_file(
      name, default,
      help_string or "Training config file (FILE or FILE:ARG).",
      flag_values=flag_values, lock_config=False, accept_new_attributes=True,
      sys_argv=None if sys_argv is None else list(sys_argv))

  def file_value(field: str) -> Optional[str]:
    key = f"{name}.{field}"
    return flag_values[key].default if key in flag_values else None

  def switch(config) -> bool:
    overrides = config_flags.get_override_values(flag_values[name])
    switch_loss(config, overrides, file_value("loss.name"))
    switch_model(config, overrides, file_value("model.name"))
    return True

  flags.register_validator(name, switch, flag_values=flag_values)
  return holder
