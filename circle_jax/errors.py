"""The base class of the errors a user can cause and fix.

A wrong config value, a missing or corrupt dataset file, a workdir that holds
another run, a checkpoint that does not fit the model, a run that diverged:
each is raised as a subclass of :class:`UserError` whose message names the
problem and the fix in its first line. The command-line tools
(``experiments.main``, ``circle_jax.embed``) print that line instead of a
traceback (``--verbose`` shows both); any other exception is a bug and keeps
its traceback.
"""

import contextlib
import os


class UserError(Exception):
  """An error the user can fix; the first line of the message says how."""


class ConfigError(UserError, ValueError):
  """A config value is invalid; the message starts with the field's name
  (raised by :mod:`circle_jax.train.config_checks` and
  :mod:`circle_jax.train.loss_checks`)."""


class WeightsFileError(UserError, ValueError):
  """A pretrained weights file is missing, damaged or of another kind."""


@contextlib.contextmanager
def reading_weights(path, expected: str):
  """Turns a failure to read the weights file ``path`` into one line.

  The readers of weights files (h5py, the safe unpickler of ``.pth``
  files, numpy, safetensors) fail on a truncated or foreign file with their
  own errors (h5py's ``file signature not found``, ``unpickling stack
  underflow``), which name neither the file nor what it should have been.
  Wrap the read::

    with reading_weights(path, "a Keras ResNet-50 .h5/.keras file"):
      ...

  Args:
    path: the file.
    expected: what it should be, in words (with its extensions).

  Raises:
    WeightsFileError: the file is missing or a folder (before the read), or
      the read failed: one line naming the file, the reader's first line and
      what was expected. A :class:`UserError` raised inside (e.g. weights
      that do not fit the model) and a missing reader (``ImportError``)
      pass unchanged.
  """
  path = os.fspath(path)
  fix = "(--config.model.pretrained)"
  if os.path.isdir(path):
    raise WeightsFileError(
        f"Pretrained weights {path!r} is a folder; give the file itself: "
        f"{expected} {fix}.")
  if not os.path.exists(path):
    raise WeightsFileError(
        f"Pretrained weights {path!r} not found; expected {expected} {fix}.")
  try:
    yield
  except (UserError, ImportError):
    raise
  except Exception as e:  # pylint: disable=broad-except
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:400]
    raise WeightsFileError(
        f"Cannot read the pretrained weights {path!r} ({type(e).__name__}: "
        f"{first}): expected {expected}; the file is damaged, truncated or of "
        f"another kind: download it again {fix}.") from e
