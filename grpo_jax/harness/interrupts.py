"""SIGTERM and Ctrl-C: save at the next step boundary, then stop non-zero.

What a run does on a signal (single process; on several hosts JAX's
pre-emption sync point, orbax `reached_preemption`, plays the same role):

  during start-up (model load, compile)  stops at once: nothing to save yet
  SIGTERM or the first Ctrl-C            finishes the step, saves a
                                         checkpoint, raises `Preempted`
                                         (exit status 143 / 130; the run
                                         store records "preempted")
  a second Ctrl-C (or SIGTERM)           aborts at once (`Aborted`, a
                                         KeyboardInterrupt; exit status
                                         130 / 143, recorded "killed")

A loop marks the end of its start-up and its step boundaries:

    interrupts.defer_to_step_boundary()
    for step in ...:
      ...
      stop = interrupts.stop_requested()
      ckpt.save(step + 1, ..., force=last or stop)
      if ckpt.preempted or stop:
        interrupts.mark_preempted(step + 1)
        break

and runs inside `handle_signals()` (`experiment.guarded` wraps a loop's
`run` in it, with the workdir lock), which raises `Preempted` once the loop
has returned.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from typing import Any, Iterator, Optional

_HANDLED = (signal.SIGTERM, signal.SIGINT)


class Preempted(BaseException):
  """The run stopped on a signal or a pre-emption notice (after saving a
  checkpoint unless it was still starting). A BaseException, like
  KeyboardInterrupt, so that `except Exception` (a sweep going on past a
  failing point) does not swallow it."""

  def __init__(self, reason: str, step: Optional[int] = None,
               checkpoint: Optional[str] = None, signum: Optional[int] = None,
               after_steps: bool = False):
    self.reason, self.step, self.checkpoint = reason, step, checkpoint
    self.exit_code = 128 + (signum or signal.SIGTERM)
    if after_steps:
      what = ("after the last step (the final evaluation or write-out), whose "
              "checkpoint is saved: run the same command again to finish")
    elif step is None:
      what = "during start-up, before the first step: nothing to save"
    else:
      where = f" at {checkpoint}" if checkpoint else ""
      what = (f"at step {step}; checkpoint saved{where}. Run the same command "
              "again to resume from it")
    super().__init__(f"stopped by {reason} {what}")


class Aborted(KeyboardInterrupt):
  """A second signal: the run stops at once, without saving."""

  def __init__(self, signum: int):
    self.exit_code = 128 + signum
    super().__init__(f"{signal.Signals(signum).name} again: aborted without "
                     "saving")


class _Stop:
  """The signal state of one guarded run."""

  def __init__(self):
    self.signum: Optional[int] = None
    self.reason: Optional[str] = None
    self.step: Optional[int] = None
    self.checkpoint: Optional[str] = None
    self.deferring = False
    self._previous: dict[int, Any] = {}
    self._previous_hook: Optional[Any] = None

  def install(self):
    for signum in _HANDLED:
      self._previous[signum] = signal.signal(signum, self._on_signal)
    self._previous_hook = sys.unraisablehook
    sys.unraisablehook = self._on_unraisable

  def uninstall(self):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    self._previous.clear()
    if self._previous_hook is not None:
      sys.unraisablehook, self._previous_hook = self._previous_hook, None

  def _on_unraisable(self, unraisable):
    """A signal that lands inside a garbage-collector callback or a `__del__`
    raises where Python cannot propagate: it prints "Exception ignored" with a
    traceback and goes on. The stop is recorded all the same (`signum`,
    `reason`), and the run stops at the end of start-up or at its step
    boundary, so that print is noise: keep it quiet."""
    if isinstance(unraisable.exc_value, (Preempted, Aborted)):
      return
    self._previous_hook(unraisable)

  def _on_signal(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.signum is not None:   # asked twice: stop waiting
      raise Aborted(signum)
    self.signum, self.reason = signum, name
    if not self.deferring:
      raise Preempted(name, signum=signum)
    logging.warning("%s: saving a checkpoint at the end of this step, then "
                    "exiting (%s again aborts without saving)", name,
                    "Ctrl-C" if signum == signal.SIGINT else "SIGTERM")


_ACTIVE: Optional[_Stop] = None


@contextlib.contextmanager
def handle_signals(install: bool = True) -> Iterator[_Stop]:
  """Tracks stop requests for the body, and installs the signal handlers
  where `install` (a single-process run: several hosts must agree on the
  step, which the checkpointer's pre-emption notice does) and this is the
  main thread. Nested uses share the outer one. Raises `Preempted` after a
  body that returned once a stop was requested."""
  global _ACTIVE
  if _ACTIVE is not None:
    yield _ACTIVE
    _raise_if_stopped(_ACTIVE)
    return
  stop = _ACTIVE = _Stop()
  if install and threading.current_thread() is threading.main_thread():
    stop.install()
  try:
    yield stop
    _raise_if_stopped(stop)
  finally:
    stop.uninstall()
    _ACTIVE = None


def _raise_if_stopped(stop: _Stop) -> None:
  if stop.reason is not None:
    raise Preempted(stop.reason, stop.step, stop.checkpoint, stop.signum,
                    after_steps=stop.step is None and stop.deferring)


def defer_to_step_boundary() -> None:
  """Start-up is over: from now on a first signal waits for the step's end.
  A start-up signal whose `Preempted` could not propagate (it landed in a
  garbage-collector callback) stops the run here."""
  if _ACTIVE is None:
    return
  if _ACTIVE.reason is not None and not _ACTIVE.deferring:
    raise Preempted(_ACTIVE.reason, signum=_ACTIVE.signum)
  _ACTIVE.deferring = True


def stop_requested() -> bool:
  """Whether a signal asked the run to stop (check at step boundaries)."""
  return _ACTIVE is not None and _ACTIVE.reason is not None


def mark_preempted(step: int, checkpoint: Optional[str] = None,
                   reason: str = "a pre-emption notice") -> None:
  """The loop saved `step` and is leaving because of a stop request (or the
  checkpointer's multi-host pre-emption notice); the guard raises
  `Preempted` once the loop returns."""
  if _ACTIVE is None:
    return
  if _ACTIVE.reason is None:
    _ACTIVE.reason = reason
  _ACTIVE.step = step
  _ACTIVE.checkpoint = checkpoint
