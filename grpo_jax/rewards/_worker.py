"""The loop that runs inside each verifier worker process (see `pool.py`).

Protocol: one JSON object per line. The parent writes
`{"id": int, "task": str, "args": [...], "soft_timeout": float}` to stdin; the
worker answers `{"id": int, "value": ...}` on its private copy of stdout
(`value` is null when the task raised or ran past its soft timeout). The first
line a worker writes is `{"ready": true}`, once its imports are done.

JSON rather than pickle in both directions: a worker handles model text, and a
worker that a crafted string had subverted must not be able to run code in the
trainer by answering with a malicious pickle.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import resource
import signal
import sys
import time
from typing import Any, Callable

# Task name -> "module:function". Workers only run what is listed here.
TASKS = {
    "math": "grpo_jax.rewards.symbolic:equivalent",
    "decide": "grpo_jax.rewards.contract:decide",
    "probe": "grpo_jax.rewards._worker:probe",
}
MEMORY_ENV = "GRPO_JAX_WORKER_MEMORY_MB"


class SoftTimeout(BaseException):
  """Raised by SIGALRM inside a task.

  A BaseException so that the broad `except Exception` handlers inside sympy
  and math-verify do not swallow it and carry on computing.
  """


def probe(kind: str, arg: Any = None) -> Any:
  """Health check and test hook for the pool: echo, sleep, spin, or crash.

  "spin" loops inside one C call that never checks for signals, so only the
  parent's hard kill can end it; "crash" dies the way a segfault would.
  """
  if kind == "echo":
    return arg
  if kind == "sleep":
    time.sleep(float(arg))
    return True
  if kind == "spin":
    return sum(range(10**12))
  if kind == "crash":
    os.abort()
  raise ValueError(f"unknown probe {kind!r}")


def _resolve(spec: str) -> Callable[..., Any]:
  module, name = spec.split(":")
  return getattr(importlib.import_module(module), name)


def _limit_memory() -> None:
  """Caps the address space so that e.g. 10^{10^{10}} fails fast with MemoryError."""
  megabytes = int(os.environ.get(MEMORY_ENV, "0"))
  if megabytes > 0:
    limit = megabytes * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _on_alarm(signum, frame):
  del signum, frame
  raise SoftTimeout()


def _run_one(fns: dict[str, Callable[..., Any]], msg: dict[str, Any]) -> Any:
  """Runs one task under a soft SIGALRM deadline; None on error or timeout."""
  signal.setitimer(signal.ITIMER_REAL, max(float(msg["soft_timeout"]), 1e-3))
  try:
    return fns[msg["task"]](*msg["args"])
  except (Exception, SoftTimeout, RecursionError, MemoryError):  # pylint: disable=broad-except
    return None
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
  """Serves tasks from stdin until EOF (the parent closed the pipe or died)."""
  # Private protocol channel; fd 1 goes to /dev/null so stray prints from
  # libraries cannot corrupt it.
  proto = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
  sys.setrecursionlimit(10_000)
  logging.disable(logging.CRITICAL)
  _limit_memory()
  signal.signal(signal.SIGALRM, _on_alarm)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's business.
  fns = {name: _resolve(spec) for name, spec in TASKS.items()}
  proto.write('{"ready": true}\n')
  for line in sys.stdin.buffer:
    msg = None
    try:
      msg = json.loads(line)
      out = json.dumps({"id": msg["id"], "value": _run_one(fns, msg)})
    except (Exception, SoftTimeout):  # pylint: disable=broad-except
      task_id = msg.get("id") if isinstance(msg, dict) else None
      out = json.dumps({"id": task_id, "value": None})
    proto.write(out + "\n")
