"""The code reward's verdicts, taken in processes the kernel bounds.

A sandbox's result lines are the model's data. Rebuilding them is not
bounded by their size (a set of 40,000 ints that all hash alike takes
seconds, quadratically more for more), nor is applying a test's operators
to them (`%`, `//`, `*`, `gcd` on multi-million-bit ints). Neither runs in
the trainer: `count_passed` hands the undecoded lines and the tests to a
checker process (a few, started on first use and kept: the standard library
and these reward files only, never the trainer's imports). A checker runs
each check under RLIMIT_AS, a CPU-time timer and a wall-clock timer whose
default action ends the process: the kernel stops a check that runs past
them (nothing in it has to cooperate), that completion scores 0 and the
next check starts a fresh checker. The trainer's share is writing the bytes
to a pipe and reading one line.
"""
from __future__ import annotations

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

CPU_S = 2.0  # CPU seconds a check may take: milliseconds, ~0.5 s at 8 MiB.
WALL_S = 20.0  # Wall-clock seconds, however loaded the host.
MEMORY_MB = 1024  # Address space of a checker (results are 8 MiB at most).
# As many checkers as cores (issue 45): a slow check (a model's value that is
# costly to rebuild) then never queues its batch neighbours' checks behind it.
MAX_CHECKERS = max(2, os.cpu_count() or 1)

_REWARDS = os.path.dirname(os.path.abspath(__file__))
# Empty parent packages: importing grpo_jax itself would import JAX.
_BOOT = """import sys, types
for name, path in (("grpo_jax", sys.argv[2]),
                   ("grpo_jax.rewards", sys.argv[1])):
  sys.modules[name] = types.ModuleType(name)
  sys.modules[name].__path__ = [path]
from grpo_jax.rewards import _checker
_checker.serve()
"""
_HEADER = struct.Struct("<IIdd")  # len(meta), len(results), cpu, wall


# ---------------------------------------------------------------- a checker

def _read_exactly(fd: int, n: int) -> bytes | None:
  chunks, left = [], n
  while left:
    chunk = os.read(fd, min(left, 1 << 20))
    if not chunk:
      return None
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


def serve() -> None:
  """Checks jobs from stdin until EOF (the trainer is gone), one at a time,
  each under the timers; answers one line each on stdout."""
  from grpo_jax.rewards import _code_checks  # pylint: disable=import-outside-toplevel
  for signum in (signal.SIGPROF, signal.SIGALRM):
    signal.signal(signum, signal.SIG_DFL)  # Its default action ends us.
  resource.setrlimit(resource.RLIMIT_AS, (MEMORY_MB << 20, MEMORY_MB << 20))
  while True:
    header = _read_exactly(0, _HEADER.size)
    if header is None:
      return
    meta_len, results_len, cpu, wall = _HEADER.unpack(header)
    meta, results = _read_exactly(0, meta_len), _read_exactly(0, results_len)
    if meta is None or results is None:
      return
    signal.setitimer(signal.ITIMER_PROF, cpu)
    signal.setitimer(signal.ITIMER_REAL, wall)
    try:
      passed = _code_checks.count_passed(json.loads(meta), results)
    except Exception:  # pylint: disable=broad-except
      passed = None  # MemoryError, say: this check fails, the next runs.
    signal.setitimer(signal.ITIMER_PROF, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    del meta, results
    # A big check: the next gets a fresh heap. Said in the answer, so the
    # trainer never sends a job to a checker that is leaving.
    retire = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10 > (
        MEMORY_MB // 4)
    os.write(1, json.dumps([passed, retire]).encode() + b"\n")
    if retire:
      return


# ---------------------------------------------------------------- the trainer

class _Checker:
  """One checker process, used by one thread at a time."""

  def __init__(self):
    self.proc = subprocess.Popen(
        [os.path.realpath(sys.executable), "-I", "-S", "-B", "-c", _BOOT,
         _REWARDS, os.path.dirname(_REWARDS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/",
        env={"PATH": "/usr/bin:/bin"})

  def check(self, meta: bytes, results: bytes, cpu: float, wall: float
            ) -> int | None:
    """Its answer; None, and the process gone, if it died or hung."""
    try:
      self.proc.stdin.write(_HEADER.pack(len(meta), len(results), cpu, wall)
                            + meta)
      self.proc.stdin.write(results)
      self.proc.stdin.flush()
      if select.select([self.proc.stdout], [], [], wall + 5.0)[0]:
        line = self.proc.stdout.readline()  # b"" once it has died.
        if line:
          passed, retire = json.loads(line)
          if retire:
            self.close()
          return passed if isinstance(passed, int) and not isinstance(
              passed, bool) else None
    except (OSError, ValueError, TypeError):
      pass
    self.close()
    return None

  @property
  def alive(self) -> bool:
    return self.proc.poll() is None

  def close(self) -> None:
    self.proc.kill()
    self.proc.wait()
    for stream in (self.proc.stdin, self.proc.stdout):
      try:
        stream.close()
      except OSError:  # unsent bytes to a process that is gone
        pass


_idle: list[_Checker] = []
_started = [0]  # Checkers alive or being used.
_available = threading.Condition()


def _take() -> _Checker | None:
  with _available:
    while True:
      while _idle:
        checker = _idle.pop()
        if checker.alive:
          return checker
        checker.close()   # ended while idle (killed from outside)
        _started[0] -= 1
      if _started[0] < MAX_CHECKERS:
        break
      _available.wait()
    _started[0] += 1
  try:
    return _Checker()
  except OSError:
    _give_back(None)
    return None


def _give_back(checker: _Checker | None) -> None:
  with _available:
    if checker is not None and checker.alive:
      _idle.append(checker)
    else:
      _started[0] -= 1
    _available.notify()


def count_passed(tests: Sequence[Any], results: bytes) -> int | None:
  """`_code_checks.count_passed(tests, results)` in a checker, or None if
  it ran past `CPU_S` / `WALL_S` seconds or `MEMORY_MB`, or could not run."""
  meta = json.dumps(list(tests), ensure_ascii=True).encode("ascii")
  checker = _take()
  if checker is None:
    return None
  try:
    return checker.check(meta, results, CPU_S, WALL_S)
  finally:
    _give_back(checker)
