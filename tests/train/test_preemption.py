"""SIGTERM and Ctrl-C are caught while a PreemptionWatch is active, and only then."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from circle_jax.train import preemption

# Slow (signals to child processes): not in the fast tier (CONTRIBUTING.md).
pytestmark = pytest.mark.slow


def test_sigterm_sets_the_flag_and_the_handler_is_restored():
  before = signal.getsignal(signal.SIGTERM)
  with preemption.PreemptionWatch() as watch:
    assert not watch.should_stop(3)
    os.kill(os.getpid(), signal.SIGTERM)  # a real signal to this process
    assert watch.should_stop(4)
    assert watch.signal_name == "SIGTERM"
    assert watch.preempted_by == "SIGTERM"
  assert signal.getsignal(signal.SIGTERM) is before


def test_first_ctrl_c_sets_the_flag_a_second_one_interrupts_at_once(capsys):
  before = signal.getsignal(signal.SIGINT)
  with preemption.PreemptionWatch() as watch:
    assert watch.preempted_by is None and not watch.should_stop(1)
    os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C: no exception
    assert watch.should_stop(2)
    assert watch.signal_name == "SIGINT"
    assert watch.preempted_by is None  # Ctrl-C, not a preemption (130, not 75)
    assert "stopping after the step in flight" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_after_sigterm_interrupts_at_once_and_stays_a_preemption():
  with preemption.PreemptionWatch() as watch:
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
    assert watch.preempted_by == "SIGTERM"


def test_without_a_watch_sigterm_still_ends_the_process():
  code = textwrap.dedent("""
      import os, signal
      from circle_jax.train import preemption
      with preemption.PreemptionWatch():
        pass
      os.kill(os.getpid(), signal.SIGTERM)
      print("survived")
  """)
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == -signal.SIGTERM
  assert "survived" not in proc.stdout


def test_exit_status_is_distinct():
  # Not 0, not 1 (a failure), not 130 (Ctrl-C), not 143 (killed by SIGTERM).
  assert preemption.EXIT_PREEMPTED not in (0, 1, 2, 130, 143)
