"""Output directories that are never overwritten by accident.

`export.py --out=DIR` into a folder that already holds a model would mix the
two (stale weight shards beside a new config.json). `check_empty` refuses a
non-empty directory unless told to overwrite; `staged` writes the new
content into a temporary directory beside the target and swaps it in only
once complete, so a failed export leaves the old directory as it was; a
killed export's staging directory is removed by the next one.

A directory that holds a run (`holds_run`: a workdir's lock, metrics or
checkpoints, a run store, a checkpoint directory or step) is never
replaced, whatever --overwrite says, and nothing is written inside a
checkpoint directory (`check_not_a_run`).

`check_writable` is what every entry point calls on what it will write
(a workdir, an output or run-store directory) before it does any work.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

from grpo_jax.errors import OutputExistsError, UnwritableDirectoryError
from grpo_jax.harness import workdir_lock


def check_writable(path: os.PathLike, what: str = "--workdir",
                   advice: str = "choose another; nothing was written") -> None:
  """Raises UnwritableDirectoryError unless `path` is a directory this
  process can write, or one it can create; creates nothing. `what` names it
  in the message (a flag), `advice` ends it. Remote paths (gs://...) are
  not checked."""
  if "://" in os.fspath(path):
    return
  path = Path(path).absolute()
  existing = path
  while not existing.exists() and existing != existing.parent:
    existing = existing.parent
  if not existing.is_dir():
    where = "is a file" if existing == path else f"is under {existing}, which is a file"
    raise UnwritableDirectoryError(f"{what} {path} {where}, not a directory: {advice}")
  if not os.access(existing, os.W_OK | os.X_OK):
    where = "" if existing == path else f" ({existing} is not writable)"
    raise UnwritableDirectoryError(f"cannot write to {what} {path}{where}: {advice}")


# What only a run leaves: a workdir's lock and metrics, its checkpoints,
# the run store, orbax's per-step metadata.
RUN_MARKERS = (".lock", "metrics.jsonl", "checkpoints", "runs.sqlite",
               "_CHECKPOINT_METADATA")
# Entries `holds_run` looks at before it gives up (and calls the tree a run's:
# an export never needs to replace a directory that large).
_MAX_ENTRIES = 10_000


def holds_run(path: os.PathLike) -> str | None:
  """The first run marker (`RUN_MARKERS`) at or under `path`, or above it up
  to a checkpoint directory: why replacing or writing into `path` would
  lose a run's work; None when there is none."""
  path = Path(path).absolute()
  for above in [path, *path.parents]:
    if _is_checkpoints(above):
      return f"{above} is a run's checkpoint directory"
  if not path.is_dir():
    return None
  seen = 0
  for root, dirs, files in os.walk(path):
    for name in (*dirs, *files):
      seen += 1
      if name in RUN_MARKERS:
        return f"{Path(root) / name} belongs to a run"
      if seen > _MAX_ENTRIES:
        return f"it holds more than {_MAX_ENTRIES} entries (too many to check for a run's files)"
  return None


def _is_checkpoints(path: Path) -> bool:
  """A run's checkpoint directory, or one step of it."""
  if (path / "_CHECKPOINT_METADATA").exists():
    return True
  if path.name != "checkpoints" or not path.is_dir():
    return False
  return (any((path.parent / m).exists() for m in (".lock", "metrics.jsonl"))
          or any(p.name.isdigit() for p in path.iterdir()))


def check_not_a_run(out: os.PathLike, what: str = "--out") -> None:
  """Raises OutputExistsError if `out` holds a run or is inside a checkpoint
  directory (`holds_run`): never replaced, whatever --overwrite says."""
  why = holds_run(out)
  if why:
    raise OutputExistsError(
        f"{what} {out} holds a run's work ({why}); it is never replaced or "
        "written into, whatever --overwrite says: choose a new directory; "
        "nothing was written")


def check_empty(out: os.PathLike, overwrite: bool, flag: str = "--overwrite",
                what: str = "--out") -> None:
  """Raises OutputExistsError if `out` is a file, holds a run
  (`check_not_a_run`), or is a non-empty directory and not `overwrite`;
  UnwritableDirectoryError if it cannot be written."""
  out = Path(os.path.expanduser(out))
  check_not_a_run(out, what)
  if out.exists() and not out.is_dir():
    raise OutputExistsError(f"{out} is a file, not a directory: choose another output "
                            "directory; nothing was written")
  entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
  if entries and not overwrite:
    shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
    raise OutputExistsError(
        f"{out} is not empty ({shown}); nothing was written. Choose an empty or new "
        f"directory, or pass {flag} to replace its whole content (the new one is "
        "written beside it and swapped in once complete).")
  check_writable(out, what)


def _staging_prefix(out: Path, kind: str) -> str:
  """`.<name>.<kind>-<host>-<pid>-`: whose staging directory it is."""
  return f".{out.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"


def remove_stale_staging(out: Path) -> list[Path]:
  """Removes the staging directories beside `out` that a killed export left
  (`.<name>.new-...`, `.<name>.old-...`, ~ the model's size each); a live
  export's, or another host's, are kept. Returns those removed."""
  removed, host = [], socket.gethostname()
  for kind in ("new", "old"):
    for path in out.parent.glob(f".{out.name}.{kind}-*"):
      owner = path.name[len(f".{out.name}.{kind}-"):].rsplit("-", 2)
      if len(owner) == 3 and owner[1].isdigit():   # host-pid-random
        if owner[0] != host or workdir_lock.pid_alive(int(owner[1])):
          continue
      shutil.rmtree(path, ignore_errors=True)   # (unnamed: an older export's)
      logging.warning("removed %s, the staging directory of an export that was "
                      "killed", path)
      removed.append(path)
  return removed


@contextlib.contextmanager
def staged(out: os.PathLike) -> Iterator[Path]:
  """A fresh directory beside `out` to write into; on success it replaces
  `out` (the old content is deleted after the swap), on failure it is
  removed and `out` is untouched. A killed export's staging directories
  beside `out` are removed first (`remove_stale_staging`)."""
  out = Path(out).absolute()
  check_not_a_run(out)   # again: a run may have started there meanwhile
  out.parent.mkdir(parents=True, exist_ok=True)
  remove_stale_staging(out)
  tmp = Path(tempfile.mkdtemp(prefix=_staging_prefix(out, "new"), dir=out.parent))
  try:
    yield tmp
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  old = None
  try:
    check_not_a_run(out)
  except OutputExistsError:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if out.exists():
    old = Path(tempfile.mkdtemp(prefix=_staging_prefix(out, "old"), dir=out.parent))
    os.replace(out, old / out.name)
  os.replace(tmp, out)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)
