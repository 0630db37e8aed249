"""Where checkpoints are, which step is the latest, and the resume order.

Only complete checkpoints count: orbax writes a step under a tmp name and
renames it when every item is written, so `finalized_steps` never lists a
half-written one.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from grpo_jax.errors import CheckpointError, UnwritableDirectoryError

PathLike = str | os.PathLike
CHECKPOINT_SUBDIR = "checkpoints"


# ----------------------------------------------------------------------------
# Paths.
# ----------------------------------------------------------------------------

def abs_path(path: PathLike) -> epath.Path:
  """Orbax wants absolute paths; cloud URLs (gs://...) are already absolute."""
  text = os.fspath(path)
  return epath.Path(text if "://" in text else os.path.abspath(text))


def checkpoint_dir(workdir: PathLike) -> epath.Path:
  """Where a run keeps its checkpoints: `<workdir>/checkpoints`."""
  return abs_path(workdir) / CHECKPOINT_SUBDIR


def check_writable(directory: PathLike) -> epath.Path:
  """Creates `directory` if needed and proves this process can write there.

  Called first thing, so a bad --workdir fails before anything compiles.
  """
  path = abs_path(directory)
  probe = path / f".write_probe.{os.getpid()}.{jax.process_index()}"
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    raise UnwritableDirectoryError(
        f"cannot write to {path}: {e.strerror or e}. Choose a --workdir this "
        "user can write, or fix its permissions; nothing was written.") from e
  return path


def finalized_steps(directory: PathLike) -> list[int]:
  """The complete checkpoints in a checkpoint directory, oldest first."""
  path = abs_path(directory)
  return sorted(ocp.step.checkpoint_steps(path)) if path.is_dir() else []


def locate(source: PathLike) -> tuple[epath.Path, Optional[int]]:
  """(checkpoint directory, step or None) from a workdir, its checkpoints
  directory or one step directory; raises if no complete checkpoint is there."""
  path = abs_path(source)
  if (path / CHECKPOINT_SUBDIR).is_dir():
    path = path / CHECKPOINT_SUBDIR
  if path.name.isdigit() and int(path.name) in finalized_steps(path.parent):
    return path.parent, int(path.name)
  if not finalized_steps(path):
    raise CheckpointError(f"no complete checkpoint at {source} (looked for "
                          f"step directories in {path})")
  return path, None


def latest_step(directory: PathLike) -> Optional[int]:
  """The newest complete step in a checkpoint directory, or None: the one
  place that decides which checkpoint is the latest."""
  steps = finalized_steps(directory)
  return steps[-1] if steps else None


def find_step(source: PathLike, step: Optional[int] = None) -> tuple[epath.Path, int]:
  """(checkpoint directory, step) for a workdir, checkpoints dir or step dir;
  `step` None means the step dir's step, else the latest complete one."""
  directory, found = locate(source)
  steps = finalized_steps(directory)
  step = step if step is not None else (found if found is not None
                                        else latest_step(directory))
  if step not in steps:
    raise CheckpointError(f"no complete checkpoint step {step} in {directory}; "
                          f"steps there: {steps}")
  return directory, step


def latest_checkpoint(workdir: PathLike) -> Optional[str]:
  """The newest complete step directory of a run, or None (for run records)."""
  step = latest_step(checkpoint_dir(workdir))
  return None if step is None else str(checkpoint_dir(workdir) / str(step))


# ----------------------------------------------------------------------------
# The resume order.
# ----------------------------------------------------------------------------

def resolve_init(workdir: PathLike, init_from: Optional[PathLike] = None,
                 pretrained_source: Optional[str] = None
                 ) -> tuple[str, Any]:
  """Where a run's initial state comes from. The resume order:

  1. this run's own latest complete checkpoint in `<workdir>/checkpoints`
     -> ("resume", step): a pre-empted or crashed run continues exactly where
     it stopped, and its init fields are ignored (they were used already);
  2. else `config.init_from`, another run's checkpoint (workdir, checkpoints
     dir or step dir) -> ("init_from", step directory path): fresh optimizer,
     step 0, that checkpoint's params (`load_params`);
  3. else the pretrained weights -> ("pretrained", source) for
     `grpo_jax.models.load_pretrained`.

  Half-written checkpoints (orbax tmp directories) are never chosen.
  """
  step = latest_step(checkpoint_dir(workdir))
  if step is not None:
    return "resume", step
  if init_from:
    directory, step = find_step(init_from)
    return "init_from", str(directory / str(step))
  if pretrained_source:
    return "pretrained", pretrained_source
  raise ValueError(f"{workdir} has no checkpoint and neither init_from nor "
                   "pretrained weights are set: nothing to start from")

