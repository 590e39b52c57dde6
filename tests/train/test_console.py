"""What a run prints: progress lines, the result table, one-line errors."""

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from circle_jax.errors import UserError
from circle_jax.train import console


def test_metrics_table_orders_rows_and_prints_counts_as_integers():
  table = console.metrics_table(
      {"init": {"map@r": 0.1, "recall@10": 0.9, "recall@2": 0.5,
                "num_queries": 896.0, "nmi": 0.25, "recall@1": 0.4096},
       "final@150": {"map@r": 0.27, "recall@1": 0.6094, "num_queries": 896}},
      order=("map@r", "nmi"))
  lines = table.splitlines()
  assert lines[0].split() == ["metric", "init", "final@150"]
  assert [l.split()[0] for l in lines[1:]] == [
      "recall@1", "recall@2", "recall@10", "map@r", "nmi", "num_queries"]
  assert lines[1].split() == ["recall@1", "0.4096", "0.6094"]
  assert lines[-1].split() == ["num_queries", "896", "896"]
  assert lines[5].split() == ["nmi", "0.2500", "-"]   # missing in a column


def test_console_reporter_without_a_terminal_prints_lines_and_the_result():
  err, out = io.StringIO(), io.StringIO()
  r = console.ConsoleReporter(err=err, out=out)
  assert not r.use_bar        # a StringIO is not a terminal
  r.start(total=100, initial=20, description="digits/circle")
  r.advance(21)
  r.stats(50, 100, loss=1.23456, steps_per_sec=2.5, images_per_sec=100.0)
  r.note("step 50 validation: recall@1 0.5000")
  r.result("the table")
  assert err.getvalue().splitlines() == [
      "step 50/100  loss 1.2346  2.50 steps/s  100 images/s  ETA 0:00:20",
      "step 50 validation: recall@1 0.5000"]
  assert out.getvalue() == "the table\n"


def test_console_reporter_bar_shows_step_loss_rate_and_eta():
  err = io.StringIO()
  r = console.ConsoleReporter(err=err, out=io.StringIO(), bar=True)
  r.start(total=10, initial=0, description="digits/circle")
  for i in range(1, 6):
    r.advance(i)
  r.stats(5, 10, loss=0.5, steps_per_sec=4.0, images_per_sec=160.0)
  r.note("a note")
  r.finish()
  text = err.getvalue()
  assert "digits/circle 5/10" in text
  assert "loss 0.5000, 160 images/s" in text
  assert "ETA" in text and "step/s" in text
  assert "a note\n" in text


class _Bad(UserError):
  pass


def test_run_tool_prints_one_line_for_user_errors():
  err = io.StringIO()
  def fail():
    raise _Bad("config.loss.gamma: must be > 0; got -1.\nmore detail")
  assert console.run_tool(fail, verbose=False, err=err) == 1
  assert err.getvalue() == ("error: config.loss.gamma: must be > 0; got -1."
                            "  (--verbose for details)\n")
  err = io.StringIO()
  assert console.run_tool(fail, verbose=True, err=err) == 1
  assert "Traceback" in err.getvalue() and "more detail" in err.getvalue()


def test_run_tool_keeps_tracebacks_of_bugs_and_reports_interrupts():
  def bug():
    raise ZeroDivisionError("a bug")
  with pytest.raises(ZeroDivisionError):
    console.run_tool(bug, verbose=False, err=io.StringIO())
  err = io.StringIO()
  def interrupted():
    raise KeyboardInterrupt
  assert console.run_tool(interrupted, verbose=False, err=err,
                          on_interrupt=lambda e: "saved step 7") == 130
  assert err.getvalue() == "saved step 7\n"


def test_resume_command_quotes_arguments():
  argv = ["/x/main.py", "--workdir", "/tmp/my run", "--config.loss.name=ms"]
  assert console.resume_command(argv, "experiments.main") == (
      "python -m experiments.main --workdir '/tmp/my run' "
      "--config.loss.name=ms")


def test_format_duration():
  assert console.format_duration(0) == "0:00:00"
  assert console.format_duration(3725.4) == "1:02:05"


def test_bar_only_on_a_terminal_of_known_width():
  assert not console.is_bar_terminal(io.StringIO())
  master, slave = pty.openpty()
  try:
    with os.fdopen(slave, "w", closefd=False) as tty:
      # A fresh pseudo-terminal has size 0x0: tqdm's bar would be empty.
      assert os.get_terminal_size(slave).columns == 0
      assert not console.is_bar_terminal(tty)
      fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0,
                                                         0))
      assert console.is_bar_terminal(tty)
      assert console.ConsoleReporter(err=tty, out=io.StringIO()).use_bar
  finally:
    os.close(master)
    os.close(slave)


_LEFTOVERS = """
import sys
from circle_jax.train import console

class Leftover:
  def __init__(self, error):
    self.error = error

  def __del__(self):
    raise self.error

def collect(text):
  obj = Leftover(RuntimeError(text))
  del obj
  print("--", file=sys.stderr, flush=True)

console.configure_logging(sys.argv[1] == "verbose")
collect("Event loop is closed")
collect("another bug")
"""


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_quiet_mode_drops_the_leftovers_of_an_abandoned_orbax_write(mode):
  """After a failed checkpoint write (one line from the job), tensorstore's
  threads still finish the writes orbax abandoned and find its event loop
  closed; quiet mode drops those "unraisable" tracebacks, --verbose shows
  them, and any other unraisable error always shows."""
  proc = subprocess.run([sys.executable, "-c", _LEFTOVERS, mode],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  closed, other, _ = proc.stderr.split("--\n")
  assert ("Event loop is closed" in closed) == (mode == "verbose"), closed
  assert "another bug" in other
