"""The code reward's verdicts, taken in a process the kernel bounds.

A sandbox's result lines are the model's data. Rebuilding them is not
bounded by their size (a set of 40,000 ints that all hash alike takes
seconds, quadratically more for more), nor is applying a test's operators
to them (`%`, `//`, `*`, `gcd` on multi-million-bit ints). Neither runs in
the trainer: `count_passed` hands the undecoded lines and the tests to a
checker server (one per trainer, started on first use: the standard library
and these reward files only, never the trainer's imports), which forks a
child per check under RLIMIT_AS, a CPU-time timer and a wall-clock timer.
The kernel ends a child that runs past them (nothing in it has to
cooperate), the server answers None for it and the completion scores 0.
The trainer's share is writing the bytes to a pipe and reading one line.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
from typing import Any, Sequence

CPU_S = 2.0  # CPU seconds a check may take; it needs milliseconds.
WALL_S = 20.0  # Wall-clock seconds, however loaded the host.
MEMORY_MB = 1024  # Address space of a check (the results are 8 MiB at most).

_REWARDS = os.path.dirname(os.path.abspath(__file__))
# Empty parent packages: importing grpo_jax itself would import JAX.
_BOOT = """import sys, types
for name, path in (("grpo_jax", sys.argv[2]), ("grpo_jax.rewards", sys.argv[1])):
  sys.modules[name] = types.ModuleType(name)
  sys.modules[name].__path__ = [path]
from grpo_jax.rewards import _checker
_checker.serve()
"""
_HEADER = struct.Struct("<IIIdd")  # job id, len(meta), len(results), cpu, wall


# ---------------------------------------------------------------- the server

def _read_exactly(fd: int, n: int) -> bytes | None:
  chunks, left = [], n
  while left:
    chunk = os.read(fd, min(left, 1 << 20))
    if not chunk:
      return None
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


def _answer(job_id: int, passed: int | None) -> None:
  os.write(1, json.dumps({"id": job_id, "passed": passed}).encode() + b"\n")


def _check(job_id: int, meta: bytes, results: bytes, cpu: float, wall: float
           ) -> None:
  """In the forked child: bounded first, then the untrusted work."""
  os.close(0)
  for signum in (signal.SIGPROF, signal.SIGALRM, signal.SIGXCPU):
    signal.signal(signum, signal.SIG_DFL)  # The default action ends it.
  resource.setrlimit(resource.RLIMIT_AS, (MEMORY_MB << 20, MEMORY_MB << 20))
  signal.setitimer(signal.ITIMER_PROF, cpu)
  signal.setitimer(signal.ITIMER_REAL, wall)
  try:
    from grpo_jax.rewards import _code_checks  # pylint: disable=import-outside-toplevel
    passed = _code_checks.count_passed(json.loads(meta), results)
  except BaseException:  # pylint: disable=broad-except
    passed = None
  _answer(job_id, passed)
  os._exit(0)


def serve() -> None:
  """Reads jobs on stdin until EOF (the trainer is gone); one child each."""
  from grpo_jax.rewards import _code_checks  # pylint: disable=import-outside-toplevel,unused-import
  children: dict[int, int] = {}  # pid -> job id
  while True:
    ready = select.select([0], [], [], 0.05 if children else None)[0]
    if ready:
      header = _read_exactly(0, _HEADER.size)
      if header is None:
        os._exit(0)
      job_id, meta_len, results_len, cpu, wall = _HEADER.unpack(header)
      meta, results = _read_exactly(0, meta_len), _read_exactly(0, results_len)
      if meta is None or results is None:
        os._exit(0)
      pid = os.fork()
      if pid == 0:
        _check(job_id, meta, results, cpu, wall)
      children[pid] = job_id
      del meta, results
    while children:  # Reap; a child that did not exit cleanly answers None.
      pid, status = os.waitpid(-1, os.WNOHANG)
      if pid == 0:
        break
      job_id = children.pop(pid, None)
      if job_id is not None and status != 0:
        _answer(job_id, None)


# ---------------------------------------------------------------- the trainer

class _Server:
  """One checker process, its pending checks, and the thread reading its
  answers (it only waits)."""

  def __init__(self):
    self.proc = subprocess.Popen(
        [os.path.realpath(sys.executable), "-I", "-S", "-B", "-c", _BOOT,
         _REWARDS, os.path.dirname(_REWARDS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/",
        env={"PATH": "/usr/bin:/bin"})
    self.pending: dict[int, concurrent.futures.Future] = {}
    self.ids = itertools.count()
    self.write_lock = threading.Lock()
    self.alive = True
    threading.Thread(target=self._read, daemon=True,
                     name="code-reward-checker").start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      try:
        answer = json.loads(line)
        future = self.pending.pop(answer["id"], None)
        if future is not None:
          future.set_result(answer["passed"])
      except (ValueError, KeyError, TypeError, concurrent.futures.InvalidStateError):
        continue
    self.alive = False  # It died: every pending check fails.
    for job_id in list(self.pending):
      future = self.pending.pop(job_id, None)
      if future is not None and not future.done():
        future.set_result(None)

  def check(self, meta: bytes, results: bytes, cpu: float, wall: float
            ) -> int | None:
    future = concurrent.futures.Future()
    with self.write_lock:
      job_id = next(self.ids)
      self.pending[job_id] = future
      try:
        self.proc.stdin.write(_HEADER.pack(job_id, len(meta), len(results),
                                           cpu, wall) + meta)
        self.proc.stdin.write(results)
        self.proc.stdin.flush()
      except (OSError, ValueError):
        self.pending.pop(job_id, None)
        self.alive = False
        return None
    try:
      return future.result(timeout=wall + 5.0)
    except concurrent.futures.TimeoutError:
      return None
    finally:
      self.pending.pop(job_id, None)


_server: _Server | None = None
_server_lock = threading.Lock()


def count_passed(tests: Sequence[Any], results: bytes) -> int | None:
  """`_code_checks.count_passed(tests, results)` in the checker, or None if
  it ran past `CPU_S` / `WALL_S` seconds or `MEMORY_MB`, or could not run."""
  global _server
  cpu, wall = CPU_S, WALL_S
  meta = json.dumps(list(tests), ensure_ascii=True).encode("ascii")
  with _server_lock:
    if _server is None or not _server.alive or _server.proc.poll() is not None:
      if _server is not None:  # Dead: reap it.
        _server.proc.kill()
        _server.proc.wait()
      try:
        _server = _Server()
      except OSError:
        return None
    server = _server
  passed = server.check(meta, results, cpu, wall)
  return passed if isinstance(passed, int) else None
