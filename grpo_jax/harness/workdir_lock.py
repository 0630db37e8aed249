"""One writer per workdir: an advisory lock on `<workdir>/.lock`.

Two runs writing one workdir interleave their metrics.jsonl rows, race on
the same checkpoint steps and both record "finished". The run that writes a
workdir holds `fcntl.flock` on `<workdir>/.lock` for its whole life and
writes who it is there (pid, host, command, start time); a second run is
refused at once with those details. The kernel drops the lock when the
holder exits, however it exits (SIGKILL included), so a stale `.lock` file
never blocks anyone, and tells whether its last holder is still alive
(`holder`, `pid_alive`: `runs.py list` shows a run whose process died as
"died").

    with workdir_lock.hold(workdir):
      ...   # train

Remote workdirs (gs://...) are not locked: flock needs a local file system.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Iterator, Optional

from grpo_jax.errors import WorkdirLockedError

LOCK_NAME = ".lock"


def _holder(path: str) -> str:
  """'pid 12 on host h since T: command' from the lock file, as best it can."""
  try:
    with open(path, encoding="utf-8") as f:
      who = json.load(f)
    return (f"pid {who['pid']} on host {who['host']} (started {who['started']}): "
            f"{who['command']}")
  except (OSError, ValueError, KeyError, TypeError):
    return "another process (its details are unreadable)"


def _identity() -> dict:
  return {"pid": os.getpid(), "host": socket.gethostname(),
          "command": " ".join(sys.argv) or sys.executable,
          "started": datetime.datetime.now().isoformat(timespec="seconds"),
          "since": time.time()}


def holder(workdir: str) -> Optional[dict]:
  """Who holds, or last held, `workdir`'s lock ({pid, host, command,
  started, since}); None when there is no readable lock file."""
  try:
    with open(os.path.join(workdir, LOCK_NAME), encoding="utf-8") as f:
      who = json.load(f)
  except (OSError, ValueError):
    return None
  return who if isinstance(who, dict) and isinstance(who.get("pid"), int) else None


def pid_alive(pid: int) -> bool:
  """Whether process `pid` of this host exists."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:   # another user's live process
    return True
  return True


def acquire(workdir: str) -> int | None:
  """Takes the lock (returns its file descriptor) or raises WorkdirLockedError
  naming the holder; None for a remote workdir (not locked)."""
  if "://" in os.fspath(workdir):
    return None
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, LOCK_NAME)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    os.close(fd)
    if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
      raise
    raise WorkdirLockedError(
        f"workdir {workdir} is in use by {_holder(path)}. Two runs writing one "
        "workdir would mix their metrics and checkpoints: wait for that run to "
        "end (or stop it: kill -TERM <pid> saves a checkpoint first), or give "
        "this run another --workdir.") from None
  os.ftruncate(fd, 0)
  os.write(fd, json.dumps(_identity()).encode())
  return fd


def release(fd: int | None) -> None:
  if fd is not None:
    os.close(fd)   # closing drops the flock


@contextlib.contextmanager
def hold(workdir: str, enabled: bool = True) -> Iterator[None]:
  """The lock on `workdir` for the body (nothing where not `enabled`: the
  processes other than 0 of a multi-host run, which write no host files)."""
  fd = acquire(workdir) if enabled else None
  try:
    yield
  finally:
    release(fd)
