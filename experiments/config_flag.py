"""The ``--config`` flag of the experiments, with loss switching.

It is ``ml_collections.config_flags.DEFINE_config_file`` (``--config=FILE`` or
``FILE:ARG``, then ``--config.a.b=value`` overrides) with one addition: when
the command line names another loss (``--config.loss.name=NAME``), the whole
``config.loss`` section is replaced by ``NAME``'s own, with that loss's paper
defaults (``experiments.configs.base.loss_config``), *before* the overrides
are applied. So::

  python -m experiments.main --config experiments/configs/digits.py \\
      --config.loss.name=multi_similarity --config.loss.beta=40

trains Multi-Similarity with ``alpha=2, beta=40, base=0.5, epsilon=0.1``,
whatever order the two flags come in, and ``--config.loss.gamma=80`` with it
is an error that lists MS's hyperparameters. Without ``--config.loss.name``
(or with the file's own loss name) the file's loss values are kept.
"""

from __future__ import annotations

import re
import sys
from typing import Callable, List, Optional, Sequence

from absl import flags
import ml_collections
from ml_collections.config_flags import config_flags

from circle_jax import losses as losses_lib
from experiments.configs import base


def _flag_values(argv: Sequence[str], name: str) -> List[str]:
  """Values of ``--name=v`` / ``--name v`` in ``argv``, in order."""
  out = []
  for i, arg in enumerate(argv):
    m = re.fullmatch(rf"--?{re.escape(name)}(=(.*))?", arg)
    if not m:
      continue
    if m.group(1) is not None:
      out.append(m.group(2))
    elif i + 1 < len(argv):
      out.append(argv[i + 1])
  return out


def _overridden_fields(argv: Sequence[str], prefix: str) -> List[str]:
  """Field names ``f`` of ``--prefix.f[=...]`` flags in ``argv``."""
  out = []
  for arg in argv:
    m = re.match(rf"--?(?:no)?{re.escape(prefix)}\.([^=.]+)(=|$)", arg)
    if m and m.group(1) not in out:
      out.append(m.group(1))
  return out


def switch_loss(config: ml_collections.ConfigDict, argv: Sequence[str],
                flag_name: str = "config") -> ml_collections.ConfigDict:
  """Applies ``--<flag>.loss.name`` of ``argv`` to ``config`` (in place).

  Args:
    config: the config returned by the config file's ``get_config``.
    argv: the command line.
    flag_name: the config flag's name.

  Returns:
    ``config``, whose ``loss`` section is the named loss's own
    (:func:`base.loss_config`) if the command line names another loss.

  Raises:
    ValueError: an unknown loss name, or a ``--<flag>.loss.<field>``
      override that the selected loss does not have (the message lists the
      ones it has).
  """
  if not isinstance(config, ml_collections.ConfigDict) or "loss" not in config:
    return config
  names = _flag_values(argv, f"{flag_name}.loss.name")
  if names and names[-1] != config.loss.get("name"):
    name = names[-1]
    if name not in losses_lib.LOSSES:
      raise ValueError(
          f"config.loss.name: unknown loss {name!r}; known losses: "
          f"{', '.join(sorted(losses_lib.LOSSES))}.")
    with config.unlocked():
      config.loss = base.loss_config(name)
  fields = [f for f in config.loss.keys() if f != "name"]
  for field in _overridden_fields(argv, f"{flag_name}.loss"):
    if field != "name" and field not in config.loss:
      raise ValueError(
          f"config.loss.{field}: loss {config.loss.get('name')!r} has no "
          f"hyperparameter {field!r}; it accepts {sorted(fields)} "
          f"(--{flag_name}.loss.name=NAME selects another loss).")
  return config


class _Parser(config_flags.ConfigFileFlagParser):
  """Loads the config file, then switches the loss section (see module doc)."""

  def __init__(self, name: str, argv: Callable[[], Sequence[str]]):
    super().__init__(name=name, lock_config=True)
    self._argv = argv

  def parse(self, path):
    config = super().parse(path)
    return switch_loss(config, self._argv(), self.name)


def DEFINE_config_file(  # pylint: disable=invalid-name
    name: str, default: Optional[str] = None, help_string: str = "",
    flag_values: flags.FlagValues = flags.FLAGS,
    sys_argv: Optional[Sequence[str]] = None) -> flags.FlagHolder:
  """``config_flags.DEFINE_config_file`` with loss switching.

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
  def argv():
    args = sys.argv if sys_argv is None else sys_argv
    return flags.FLAGS.read_flags_from_files(list(args), force_gnu=False)

  # pylint: disable=protected-access
  flag = config_flags._ConfigFlag(
      parser=_Parser(name, argv), serializer=flags.ArgumentSerializer(),
      name=name, default=default,
      help_string=help_string or "Training config file (FILE or FILE:ARG).",
      flag_values=flag_values, sys_argv=sys_argv)
  # pylint: enable=protected-access
  return flags.DEFINE_flag(flag, flag_values)
