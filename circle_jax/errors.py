"""The base class of the errors a user can cause and fix.

A wrong config value, a missing or corrupt dataset file, a workdir that holds
another run, a checkpoint that does not fit the model, a run that diverged:
each is raised as a subclass of :class:`UserError` whose message names the
problem and the fix in its first line. The command-line tools
(``experiments.main``, ``circle_jax.embed``) print that line instead of a
traceback (``--verbose`` shows both); any other exception is a bug and keeps
its traceback.
"""


class UserError(Exception):
  """An error the user can fix; the first line of the message says how."""
