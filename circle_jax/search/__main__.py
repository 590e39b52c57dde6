"""``python -m circle_jax.search``: see :mod:`circle_jax.search.cli`."""

import sys

from circle_jax.search import cli

if __name__ == "__main__":
  sys.exit(cli.main())
