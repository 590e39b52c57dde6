"""What a run shows a person: progress, notes, the result table, one-line errors.

The training loop reports through a *reporter*:

* :class:`LogReporter` (the default of
  :func:`circle_jax.train.loop.train_and_evaluate`) writes everything to the
  absl log at INFO, for library use and tests.
* :class:`ConsoleReporter` (``experiments.main``) draws a live progress bar on
  a terminal's stderr (step, loss, steps/s, images/s, ETA; one plain line per
  ``log_every_steps`` when stderr is not a terminal), prints short notes
  (resume, evaluations) above it, and the final table on stdout.

:func:`configure_logging` turns the libraries' INFO logs (orbax, absl, tfds,
grain) off unless ``--verbose``, and :func:`run_tool` turns a
:class:`circle_jax.errors.UserError` into one line on stderr (the traceback
only with ``--verbose``) and Ctrl-C into the command that resumes.
"""

from __future__ import annotations

import datetime
import logging as std_logging
import os
import shlex
import sys
import traceback
from typing import Callable, Optional, Sequence, TextIO

from absl import logging

from circle_jax.errors import UserError

# Loggers of the libraries a run uses; quiet (WARNING) unless --verbose.
LIBRARY_LOGGERS = ("absl", "orbax", "tensorflow_datasets", "grain", "jax",
                   "etils", "array_record")


# Libraries that log through absl's logger: quiet mode keeps their errors only
# (their warnings are about their own internals, e.g. tfds' "Variant folder
# ... has no dataset_info.json" before a first preparation).
_QUIET_PACKAGES = ("tensorflow_datasets", "orbax", "grain", "array_record",
                   "etils")


# Orbax logs the traceback of a failed checkpoint write or read from its
# background threads before the error reaches the job, which then reports it
# in one line (circle_jax.train.checkpoint re-raises every such failure), so
# quiet mode drops orbax's errors too.
_REPORTED_PACKAGES = ("orbax",)


class _LibraryWarningFilter(std_logging.Filter):

  def filter(self, record):
    path = record.pathname.replace("\\", "/")
    if record.levelno >= std_logging.ERROR:
      return not any(f"/{p}/" in path for p in _REPORTED_PACKAGES)
    return not any(f"/{p}/" in path for p in _QUIET_PACKAGES)


_FILTER = _LibraryWarningFilter()


class _OrbaxTaskFilter(std_logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" for orbax's tasks.

  When one array of a checkpoint fails to write (a full disk), orbax raises
  the first error, which the job reports in one line, and abandons the
  other writes in flight; asyncio logs each of those when it is collected.
  """

  def filter(self, record):
    return "/orbax/" not in record.getMessage()


_ORBAX_TASK_FILTER = _OrbaxTaskFilter()


def _is_closed_loop_leftover(unraisable) -> bool:
  """An abandoned write's callback that found orbax's event loop closed."""
  return (isinstance(unraisable.exc_value, RuntimeError)
          and str(unraisable.exc_value) == "Event loop is closed")


def _quiet_unraisablehook(unraisable) -> None:
  if not _is_closed_loop_leftover(unraisable):
    sys.__unraisablehook__(unraisable)


def configure_logging(verbose: bool) -> None:
  """INFO logs of absl and the libraries on with ``verbose``.

  Otherwise absl logs WARNING and above, and the libraries' own warnings
  (tfds, orbax, grain) are dropped; errors show, except orbax's, which the
  checkpoint code raises again as one-line errors, and the tracebacks of
  the writes orbax abandons after such an error (asyncio's "Task exception
  was never retrieved", "Event loop is closed" from tensorstore's threads).
  """
  level = std_logging.INFO if verbose else std_logging.WARNING
  logging.set_verbosity(logging.INFO if verbose else logging.WARNING)
  for name in LIBRARY_LOGGERS:
    std_logging.getLogger(name).setLevel(level)
  absl_logger = std_logging.getLogger("absl")
  asyncio_logger = std_logging.getLogger("asyncio")
  if verbose:
    absl_logger.removeFilter(_FILTER)
    asyncio_logger.removeFilter(_ORBAX_TASK_FILTER)
    sys.unraisablehook = sys.__unraisablehook__
  else:
    if _FILTER not in absl_logger.filters:
      absl_logger.addFilter(_FILTER)
    if _ORBAX_TASK_FILTER not in asyncio_logger.filters:
      asyncio_logger.addFilter(_ORBAX_TASK_FILTER)
    # After a failed checkpoint write (reported in one line), the writes
    # orbax abandoned still finish in tensorstore's threads and find its
    # event loop closed: Python prints each as an "unraisable" traceback.
    sys.unraisablehook = _quiet_unraisablehook
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    tfds.display_progress_bar(verbose)
  except ImportError:  # pragma: no cover
    pass


def format_duration(seconds: float) -> str:
  """``H:MM:SS`` (days folded into hours)."""
  seconds = max(0, int(round(seconds)))
  return str(datetime.timedelta(seconds=seconds))


def format_value(name: str, value) -> str:
  """Counts as integers, other metrics with 4 decimals."""
  if value is None:
    return "-"
  if isinstance(value, (int,)) and not isinstance(value, bool):
    return str(value)
  v = float(value)
  if name.startswith("num_") and v.is_integer():
    return str(int(v))
  return f"{v:.4f}"


def metrics_table(columns: dict, *, order: Optional[Sequence[str]] = None
                  ) -> str:
  """A fixed-width table: one row per metric, one column per entry.

  Args:
    columns: ``{column title: {metric: value}}``.
    order: metric names in this order after the ``recall@K`` rows (the rest
      sorted after them, counts ``num_*`` last).

  Returns:
    The table as text (no trailing newline).
  """
  names = []
  for col in columns.values():
    for k in col or {}:
      if k not in names:
        names.append(k)
  order = list(order or [])

  def key(n):
    if n.startswith("recall@") and n[7:].isdigit():
      return (0, int(n[7:]), n)
    if n in order:
      return (1, order.index(n), n)
    return (2 if not n.startswith("num_") else 3, 0, n)

  names.sort(key=key)
  width = max([len(n) for n in names] + [6])
  cols = list(columns)
  cw = [max(10, len(c)) for c in cols]
  lines = [" ".join([f"{'metric':<{width}}"] +
                    [f"{c:>{w}}" for c, w in zip(cols, cw)])]
  for n in names:
    cells = [f"{format_value(n, (columns[c] or {}).get(n)):>{w}}"
             for c, w in zip(cols, cw)]
    lines.append(" ".join([f"{n:<{width}}"] + cells))
  return "\n".join(lines)


class LogReporter:
  """Reports to the absl log at INFO (no bar, nothing on stdout)."""

  def start(self, *, total: int, initial: int, description: str) -> None:
    logging.info("%s: steps %d -> %d", description, initial, total)

  def advance(self, done: int) -> None:
    """Called after every step; must stay cheap (no device sync)."""
    del done

  def stats(self, done: int, total: int, *, loss: float,
            steps_per_sec: float, images_per_sec: float) -> None:
    eta = (total - done) / max(steps_per_sec, 1e-9)
    logging.info("step %d/%d  loss %.4f  %.2f steps/s  %.0f images/s  ETA %s",
                 done, total, loss, steps_per_sec, images_per_sec,
                 format_duration(eta))

  def note(self, message: str) -> None:
    logging.info("%s", message)

  def finish(self) -> None:
    pass

  def result(self, text: str) -> None:
    logging.info("\n%s", text)


def is_bar_terminal(stream) -> bool:
  """Whether a progress bar can be drawn on ``stream``.

  A terminal, and one whose width is known: a pseudo-terminal of size 0x0
  (e.g. ``script`` or ``docker exec -t`` without a size) would show tqdm's
  dynamic-width bar as empty lines, so it gets the plain progress lines.
  """
  if not getattr(stream, "isatty", lambda: False)():
    return False
  try:
    return os.get_terminal_size(stream.fileno()).columns > 0
  except (AttributeError, OSError, ValueError):
    return True   # a terminal whose size cannot be read: let tqdm decide


class ConsoleReporter(LogReporter):
  """A live progress bar on stderr and the result on stdout.

  Args:
    err: where progress and notes go (default ``sys.stderr``).
    out: where the result goes (default ``sys.stdout``).
    bar: draw a tqdm bar; default: when ``err`` is a terminal with a known
      width (:func:`is_bar_terminal`). Without a bar, :meth:`stats` prints
      one line per logging interval instead.
  """

  def __init__(self, *, err: Optional[TextIO] = None,
               out: Optional[TextIO] = None, bar: Optional[bool] = None):
    self.err = err or sys.stderr
    self.out = out or sys.stdout
    if bar is None:
      bar = is_bar_terminal(self.err)
    self.use_bar = bar
    self._bar = None
    self._last = 0

  def _print(self, message: str) -> None:
    if self._bar is not None:
      self._bar.clear()
      print(message, file=self.err, flush=True)
      self._bar.refresh()
    else:
      print(message, file=self.err, flush=True)

  def start(self, *, total: int, initial: int, description: str) -> None:
    if not self.use_bar:
      return
    import tqdm  # pylint: disable=g-import-not-at-top
    self._bar = tqdm.tqdm(
        total=total, initial=initial, desc=description, unit="step",
        file=self.err, dynamic_ncols=True, leave=True, smoothing=0.1,
        bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {rate_fmt} "
                   "ETA {remaining}{postfix}")
    self._last = initial

  def advance(self, done: int) -> None:
    if self._bar is not None and done > self._last:
      self._bar.update(done - self._last)
      self._last = done

  def stats(self, done: int, total: int, *, loss: float,
            steps_per_sec: float, images_per_sec: float) -> None:
    if self._bar is not None:
      self._bar.set_postfix_str(
          f"loss {loss:.4f}, {images_per_sec:.0f} images/s", refresh=True)
      return
    eta = (total - done) / max(steps_per_sec, 1e-9)
    self._print(f"step {done}/{total}  loss {loss:.4f}  {steps_per_sec:.2f} "
                f"steps/s  {images_per_sec:.0f} images/s  ETA "
                f"{format_duration(eta)}")

  def note(self, message: str) -> None:
    self._print(message)

  def finish(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def result(self, text: str) -> None:
    self.finish()
    print(text, file=self.out, flush=True)


def resume_command(argv: Sequence[str], module: str) -> str:
  """The shell command that reruns ``python -m module`` with ``argv[1:]``."""
  return shlex.join(["python", "-m", module] + list(argv[1:]))


def run_tool(fn: Callable[[], object], *, verbose: bool,
             err: Optional[TextIO] = None,
             on_interrupt: Optional[Callable[[BaseException], str]] = None
             ) -> int:
  """Runs a command-line tool's body; returns its exit status.

  Args:
    fn: the tool's work.
    verbose: print tracebacks (and the whole message of user errors).
    err: where messages go (default ``sys.stderr``).
    on_interrupt: builds the message printed on Ctrl-C from the exception
      (e.g. the last saved step and the command that resumes).

  Returns:
    0 on success, 1 after a :class:`UserError` (one line, ``error: ...``),
    130 after Ctrl-C, the exception's ``exit_status`` for interruptions that
    carry one (75 for a preempted training run). Any other exception propagates with its traceback.
  """
  err = err or sys.stderr
  try:
    fn()
    return 0
  except KeyboardInterrupt as e:
    if verbose:
      traceback.print_exc(file=err)
    message = on_interrupt(e) if on_interrupt else "Interrupted."
    print(message, file=err, flush=True)
    # Ctrl-C: 130 (128 + SIGINT); a preempted run says its own status.
    return getattr(e, "exit_status", 130)
  except UserError as e:
    if verbose:
      traceback.print_exc(file=err)
      print(f"error: {e}", file=err, flush=True)
      return 1
    lines = str(e).splitlines() or [type(e).__name__]
    more = "  (--verbose for details)" if len(lines) > 1 else ""
    print(f"error: {lines[0]}{more}", file=err, flush=True)
    return 1
