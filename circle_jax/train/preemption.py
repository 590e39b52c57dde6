"""Preemption and Ctrl-C: the training loop stops after the current step.

Cloud and TPU preemption, ``kill``, SLURM and Kubernetes all send SIGTERM and
then, after a grace period, SIGKILL. The default action of SIGTERM ends the
process at once, losing every step since the last periodic checkpoint. While
a :class:`PreemptionWatch` is active, the loop instead finishes the step in
flight, saves it synchronously and stops; the job then exits with
:data:`EXIT_PREEMPTED`, so a scheduler (or a wrapper script) can tell a
preempted run, to be requeued with the same command, from a failed one.

Multi-host runs must agree on the step they save. There JAX's preemption
service (enabled by ``jax.distributed.initialize``) receives the SIGTERM,
propagates the notice to every host and picks the first step that all hosts
can reach; :func:`jax.experimental.multihost_utils.reached_preemption_sync_point`
becomes true at that step on every host at once, which is the sync point the
JAX documentation describes. The watch asks it at every step and installs its
own signal handler only in single-process runs, where that service is off and
the call returns False.

Ctrl-C (SIGINT) is caught the same way in single-process runs. Python's
default raises ``KeyboardInterrupt`` wherever the main thread is, also
inside the call of a train step whose input buffers were donated to it: the
state is then gone and the steps since the last periodic checkpoint are lost
(seen on a GPU, where the loop spends most of its time dispatching). The
first Ctrl-C therefore only sets the flag; the loop saves the step in flight
when it completes, and the job exits with 130 as after any Ctrl-C. A second
Ctrl-C raises ``KeyboardInterrupt`` at once, for a step that hangs.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Optional

import jax
from jax.experimental import multihost_utils

# EX_TEMPFAIL of sysexits.h: a temporary failure; run the same command again.
EXIT_PREEMPTED = 75


class PreemptionWatch:
  """``with PreemptionWatch() as watch: ... if watch.should_stop(step): ...``.

  Attributes:
    signal_name: the signal that was received (None until one is).
  """

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self._signals = tuple(signals)
    self._previous = {}
    self.signal_name: Optional[str] = None

  def _handler(self, signum, frame):  # pylint: disable=unused-argument
    if signum == signal.SIGINT and self.signal_name is not None:
      raise KeyboardInterrupt  # asked twice: stop now, unsaved
    if self.signal_name is None:
      self.signal_name = signal.Signals(signum).name
    if signum == signal.SIGINT:
      print("\nCtrl-C: stopping after the step in flight, which is saved "
            "(Ctrl-C again to stop at once, unsaved).", file=sys.stderr,
            flush=True)

  def __enter__(self) -> "PreemptionWatch":
    # Signal handlers can only be set from the main thread; JAX's preemption
    # service owns SIGTERM in multi-process runs.
    if (jax.process_count() == 1
        and threading.current_thread() is threading.main_thread()):
      for s in self._signals:
        self._previous[s] = signal.signal(s, self._handler)
    return self

  def __exit__(self, *exc) -> None:
    for s, previous in self._previous.items():
      signal.signal(s, previous)
    self._previous = {}

  @property
  def preempted_by(self) -> Optional[str]:
    """The signal to report as a preemption; None for Ctrl-C or none yet."""
    return None if self.signal_name in (None, "SIGINT") else self.signal_name

  def should_stop(self, step: int) -> bool:
    """Whether to save ``step`` (the step just completed) and stop.

    Call it after every step with the same ``step`` on every host.
    """
    if self.signal_name is not None:
      return True
    if jax.process_count() > 1 and multihost_utils.reached_preemption_sync_point(
        step):
      self.signal_name = "SIGTERM"
      return True
    return False
