"""Importing this module gives JAX 8 simulated CPU devices.

It adds ``--xla_force_host_platform_device_count=8`` to ``XLA_FLAGS`` (and
sets ``JAX_PLATFORMS=cpu`` unless set), which XLA reads when JAX starts its
backend: import it before anything imports ``jax``. The benchmarks of
per-device memory import it first (``experiments.bench.ring_memory``,
``experiments.bench.sharded_classes``, ``experiments.bench.contrastive``);
single-device programs run on the first device, at the speed of a 1-device
process (checked: the matmul floor at B=4096, D=512 times alike).
"""

import os

DEVICES = 8

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""),
     f"--xla_force_host_platform_device_count={DEVICES}"]).strip()
