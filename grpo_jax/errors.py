"""The errors a user can cause, in one module at the bottom of the package.

Each names its field, file or process, and `harness.cli.user_errors` prints it
as one line without a traceback: every subclass of `UserError` is bad input,
anything else is a bug and keeps its traceback. Each also subclasses the
builtin a caller would expect (a bad value is a ValueError, an existing
output directory a FileExistsError).
"""


class UserError(Exception):
  """Bad input or state the user can fix; the message says how."""


class ConfigError(UserError, ValueError):
  """A config field is unknown, of the wrong kind or out of range."""


class DataError(UserError, ValueError):
  """A data file or dataset is unusable; the message names the file and field."""


class WeightsError(UserError, ValueError):
  """Model weights that cannot be loaded; the message names the file/tensor."""


class CheckpointError(UserError, RuntimeError):
  """A run's checkpoint cannot be written or used; the message says what to do."""


class CorruptCheckpointError(CheckpointError):
  """A finalised checkpoint whose files are damaged or truncated."""


class IncompatibleCheckpointError(CheckpointError):
  """A checkpoint whose arrays do not match the state being restored."""


class UnsafeResumeError(CheckpointError):
  """The config changed since the checkpoint in fields that make resuming unsafe."""


class UnwritableDirectoryError(CheckpointError):
  """A workdir or checkpoint directory this process cannot write."""


class RunStoreError(UserError, RuntimeError):
  """The run store is missing (when reading) or is not a SQLite database."""


class WorkdirLockedError(UserError, RuntimeError):
  """Another live process holds the workdir's lock."""


class ArgumentError(UserError, ValueError):
  """A command-line argument names nothing that exists (a metric key, a run)."""


class OutputExistsError(UserError, FileExistsError):
  """The output directory is not empty and overwriting was not asked for."""


class NonFiniteError(UserError, FloatingPointError):
  """A NaN or inf where a number belongs: a config value (validation), an
  update's loss, gradient norm or parameters (not applied; the run stops), or
  a state the checkpointer refuses to save."""
