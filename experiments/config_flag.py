"""The ``--config`` flag of the experiments: :mod:`circle_jax.config`'s.

``DEFINE_config_file`` is ``ml_collections``' config-file flag with loss
switching (``--config.loss.name=NAME`` swaps in loss ``NAME``'s own section
before the overrides apply); see :func:`circle_jax.config.switch_loss`.
"""

from circle_jax.config import DEFINE_config_file  # noqa: F401
from circle_jax.config import switch_loss  # noqa: F401
