"""What the experiments/*.py commands share: flag errors that name the config
field, user errors printed as one message instead of a traceback, and quiet
logs (below --verbosity=1 no library INFO: orbax logs ~50 lines a checkpoint).

    app.run(main, flags_parser=cli.parse_flags)

    def main(argv):
      with cli.user_errors(workdir):
        ...

A user error is an `errors.UserError` (a bad config, a checkpoint that
cannot be used, a bad model or data file, a workdir another run holds, an
unreadable run store, an output directory that is not empty), a full disk,
or a run stopped by a signal (interrupts.Preempted, interrupts.Aborted: the
message says how to resume).
Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import contextlib
import errno
import importlib.util
import logging
import os
import sys
import threading
import traceback
from typing import Any, Iterator, Optional, Sequence

from absl import flags
from absl import logging as absl_logging

from grpo_jax import errors


def load_config(spec: str) -> Any:
  """`get_config(arg)` of a `file.py[:arg]` config spec, as config_flags does."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("_grpo_jax_cli_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def override_error(config: Any, path: str) -> Optional[str]:
  """Why `--config.<path>=...` cannot be applied to `config` (None: it can):
  the first unknown part and the nearest field names."""
  from grpo_jax.validation import unknown_field  # pylint: disable=import-outside-toplevel
  node, parts = config, path.split(".")
  for depth, part in enumerate(parts):
    where = ".".join(parts[:depth])
    if not hasattr(node, "keys"):
      return f"config field {where!r} is a value, not a group: --config.{path} cannot be set"
    if part not in node:
      message = unknown_field(".".join(parts[:depth + 1]), sorted(node.keys()))
      if where in _OPEN_GROUPS:
        message += (f" {where} is a free-form dict: replace it whole, e.g. "
                    f"--config.{where}='{{\"{part}\": ...}}' (with the other keys "
                    "it needs)")
      return message
    node = node[part]
  return None


# Config groups whose keys are free (keyword arguments, reward names).
_OPEN_GROUPS = ("data.kwargs", "data.eval_kwargs", "rewards", "reward_kwargs")


def _config_spec(argv: Sequence[str]) -> Optional[str]:
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _describe_flag_error(argv: Sequence[str], error: Exception) -> str:
  """A one-line reason for a failed `--config...` parse."""
  spec = _config_spec(argv)
  if spec is not None:
    try:
      config = load_config(spec)
    except Exception as e:   # pylint: disable=broad-except
      return f"--config={spec}: {e}"
    for arg in argv:
      if arg.startswith("--config.") and "=" in arg:
        reason = override_error(config, arg[len("--config."):].split("=", 1)[0])
        if reason:
          return reason
  return f"{type(error).__name__}: {error}"


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing (for `app.run(main, flags_parser=...)`), with a
  config error reported as one line naming the field and the nearest names
  instead of ml_collections' traceback."""
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    text = str(e)
    if "Traceback (most recent call last)" in text:   # config_flags embeds one
      text = text.splitlines()[0].rstrip(":") + ": " + [
          line for line in text.splitlines() if line.strip()][-1]
    sys.exit(f"error: {text}\nPass --help to see the flags.")
  except Exception as e:   # pylint: disable=broad-except
    sys.exit(f"error: {_describe_flag_error(argv, e)}")
  check_config_files(flags.FLAGS)
  expand_user_paths(flags.FLAGS)
  return rest


def check_config_files(flag_values) -> None:
  """A config-file flag whose file could not be loaded (missing, or its
  get_config failed) is one line now, not ml_collections' deferred
  traceback at the config's first use."""
  for name in ("config",):
    if name not in flag_values or not flag_values[name].present:
      continue
    try:
      flag_values[name].value.keys()
    except (OSError, ImportError) as e:
      lines = [line.strip() for line in str(e).splitlines() if line.strip()]
      sys.exit(f"error: flag --{name}={flag_values[name].config_filename}: "
               f"{lines[-1] if lines else type(e).__name__}")


# Path flags of the entry points; `~` in them is the home directory (the
# shell leaves `--workdir=~/x` unexpanded, which made a directory named `~`).
PATH_FLAGS = ("workdir", "out", "checkpoint", "root", "base")


def expand_user_paths(flag_values) -> None:
  """Expands a leading `~` in the `PATH_FLAGS` that `flag_values` has."""
  for name in PATH_FLAGS:
    if name in flag_values:
      value = flag_values[name].value
      if isinstance(value, str) and value.startswith("~"):
        flag_values[name].value = os.path.expanduser(value)


# ----------------------------------------------------------------------------
# User errors.
# ----------------------------------------------------------------------------

def _chain(error: BaseException) -> Iterator[BaseException]:
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


# However the OS says the disk (or the user's quota, or the file size limit)
# is full, and the messages they print when only the text survives.
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "File too large")


def disk_full(error: BaseException) -> Optional[str]:
  """How the OS said that a full disk is behind `error` ("No space left on
  device", "Disk quota exceeded", "File too large": ENOSPC, EDQUOT, EFBIG),
  None when it is not; orbax and asyncio wrap the OSError, sometimes only
  in the message."""
  for e in _chain(error):
    if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
      return os.strerror(e.errno)
    for text in _FULL_TEXTS:
      if text in str(e):
        return text
  return None


def _last_good(workdir: Optional[str]) -> str:
  """'the last good checkpoint is <path>' of a run's workdir, or that there
  is none yet."""
  last = None
  if workdir:
    from grpo_jax import checkpoint  # pylint: disable=import-outside-toplevel
    last = checkpoint.latest_checkpoint(workdir)
  return (f"the last good checkpoint is {last}" if last else
          "there is no complete checkpoint yet")


def describe(error: BaseException, workdir: Optional[str] = None) -> Optional[str]:
  """The message for a user error, None for anything else."""
  full = disk_full(error)
  if full:
    where = f" under {workdir}" if workdir else ""
    return (f"disk full ({full}) while writing{where}; "
            f"{_last_good(workdir)}. Free space (old checkpoints: "
            "--config.train.keep_checkpoints) and run the same command again "
            "to resume.")
  interrupts = sys.modules.get("grpo_jax.harness.interrupts")
  if interrupts and isinstance(error, interrupts.Aborted):
    return (f"stopped by {error}; {_last_good(workdir)}: run the same command "
            "again to resume from it.")
  if isinstance(error, errors.UserError) or (
      interrupts and isinstance(error, interrupts.Preempted)):
    return str(error)
  return None


class _NoLibraryTracebacks(logging.Filter):
  """Keeps the one-line message of a library's error log and drops its
  traceback (orbax logs a disk-full error with ~300 lines of them); the
  user error that follows says what happened. --verbosity=1 keeps them."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.exc_info and not ours(record.pathname):
      if absl_logging.get_verbosity() < absl_logging.DEBUG:
        record.exc_info, record.exc_text = None, None
        record.msg = f"{record.msg} (traceback hidden: --verbosity=1 shows it)"
    return True


class _NoLibraryInfo(logging.Filter):
  """Drops the INFO and DEBUG records of libraries (orbax logs ~50 lines
  per checkpoint: its options, handler registrations, each thread's
  progress); this project's own lines and every library's warnings and
  errors stay. --verbosity=1 keeps them all."""

  def filter(self, record: logging.LogRecord) -> bool:
    return (record.levelno >= logging.WARNING or ours(record.pathname)
            or absl_logging.get_verbosity() >= absl_logging.DEBUG)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOT = os.path.dirname(_PACKAGE)


def ours(pathname: str) -> bool:
  """Whether a log record's source file is this project's (grpo_jax/,
  experiments/, benchmarks/), not an installed library's. (orbax logs
  through absl, so the logger's name does not tell.)"""
  path = os.path.abspath(pathname)
  if path.startswith(_PACKAGE + os.sep):
    return True
  installed = {"site-packages", "dist-packages"} & set(path.split(os.sep))
  return path.startswith(_ROOT + os.sep) and not installed


def _closed_loop_callback(unraisable) -> bool:
  """Whether an unraisable exception is asyncio's "Event loop is closed"
  raised inside `call_soon_threadsafe`: a tensorstore write finishing after
  orbax gave up on a failed save and closed the event loop that awaited it
  (tensorstore reports it from its own thread with PyErr_WriteUnraisable).
  The save's failure itself is raised and described."""
  if not (isinstance(unraisable.exc_value, RuntimeError)
          and str(unraisable.exc_value) == "Event loop is closed"):
    return False
  frames = traceback.extract_tb(unraisable.exc_traceback)
  return any(f.name == "call_soon_threadsafe" for f in frames)


def _quiet_unraisablehook(previous):
  def hook(unraisable):
    if (_closed_loop_callback(unraisable)
        and absl_logging.get_verbosity() < absl_logging.DEBUG):
      return
    previous(unraisable)
  hook.grpo_jax_quiet = True
  return hook


def _add_filter(kind: type[logging.Filter]) -> None:
  for handler in logging.getLogger().handlers:
    if not any(isinstance(f, kind) for f in handler.filters):
      handler.addFilter(kind())


def hide_library_info() -> None:
  """Installs `_NoLibraryInfo` on the root logger's handlers (absl's among
  them): no library INFO below --verbosity=1."""
  _add_filter(_NoLibraryInfo)


def hide_library_tracebacks() -> None:
  """Installs `_NoLibraryTracebacks` on the root logger's handlers, and an
  unraisable-exception hook that drops the "Event loop is closed" tracebacks
  a failed asynchronous checkpoint leaves behind (one per write still in
  flight; a full disk printed up to 35)."""
  _add_filter(_NoLibraryTracebacks)
  if not getattr(sys.unraisablehook, "grpo_jax_quiet", False):
    sys.unraisablehook = _quiet_unraisablehook(sys.unraisablehook)


def exit_now(code: int) -> None:
  """Flushes the logs and the standard streams, then ends the process with
  `code` without the interpreter's teardown (`os._exit`). A signal during
  start-up stops the main thread while XLA's compile threads, orbax's
  writers or the sampler thread still run; tearing the interpreter down
  under them segfaulted on exit (2 runs of 3). Everything a stopped run
  records is written before this: the run store's row, the checkpoint
  (closed by the loop), metrics; the kernel drops the workdir lock."""
  logging.shutdown()
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):
      stream.flush()
  os._exit(code)   # pylint: disable=protected-access


@contextlib.contextmanager
def user_errors(workdir: Optional[str] = None, exit_hard: bool = False) -> Iterator[None]:
  """Exits with the message of a user error (status 1; a pre-empted run
  128 + the signal) and no traceback; anything else propagates. Library
  INFO lines and tracebacks are hidden below --verbosity=1. `exit_hard`
  (the entry points' main): a run stopped by a signal ends with
  `exit_now`, not the interpreter's teardown."""
  hide_library_info()
  hide_library_tracebacks()
  try:
    yield
  except BaseException as e:   # pylint: disable=broad-except
    message = describe(e, workdir)
    if message is None:
      raise
    from grpo_jax.harness import interrupts  # pylint: disable=import-outside-toplevel
    stopped = isinstance(e, (interrupts.Preempted, interrupts.Aborted))
    # The message closes the run: a failed asynchronous save leaves
    # background threads (orbax's metadata writer) and asyncio tasks
    # (collected at exit: "Task exception was never retrieved") that report
    # the same failure after it, with tracebacks; the message already says
    # what failed, so nothing is logged or printed for threads after it. (A
    # stop by signal has no failed save behind it: left as it is.)
    if not stopped:
      logging.disable(logging.CRITICAL)
      threading.excepthook = lambda args: None
    print(message if stopped else f"error: {message}", file=sys.stderr)
    if stopped and exit_hard:
      exit_now(e.exit_code)
    sys.exit(e.exit_code if stopped else 1)
