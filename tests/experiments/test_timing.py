"""Specification of experiments/timing.py."""

import time

import jax.numpy as jnp

from experiments import timing


def test_call_times_counts_warmup_and_timed_calls():
  calls = []
  times = timing.call_times(lambda: calls.append(1) or jnp.ones(3), 2, 4)
  assert len(calls) == 6 and len(times) == 4
  assert all(t >= 0 for t in times)


def test_call_times_stops_at_a_call_over_budget():
  slow = lambda: (time.sleep(0.02), ())[1]
  # A slow warm-up call is the only time; a slow timed call is the last one.
  assert len(timing.call_times(slow, 1, 5, budget_s=0.01)) == 1
  calls = []
  def slow_timed():
    calls.append(1)
    if len(calls) > 1:
      time.sleep(0.02)
    return ()
  times = timing.call_times(slow_timed, 1, 5, budget_s=0.01)
  assert len(times) == 1 and times[0] >= 0.02
