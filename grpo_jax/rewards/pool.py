"""A pool of worker processes with a hard wall-clock timeout on every task.

Why not `multiprocessing.Pool` or `concurrent.futures`: neither can kill the
one worker that is stuck inside a C call (sympy computing 10^(10^10)), and a
worker that crashes breaks the whole executor. Here each worker is a plain
subprocess speaking JSON lines (`_worker.py`); the parent waits on the pipes
with `select`, kills a worker whose task runs past its deadline, replaces any
worker that died, and answers None for that task. Workers are started with
`subprocess` (fork + exec), never by forking the trainer, which holds JAX's
threads, and they never import the trainer's `__main__`.

The pool only ever returns; a task that times out, crashes its worker or
raises yields None.
"""
from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

from grpo_jax.rewards import _worker

_BOOT = ("import sys; sys.path[:] = sys.argv[1:]; "
         "from grpo_jax.rewards import _worker; _worker.main()")
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_SOFT_FRACTION = 0.8  # The worker gives up by itself first and stays alive.
_MAX_START_FAILURES = 3

log = logging.getLogger(__name__)


def _worker_argv() -> list[str]:
  """The worker's command line: the parent's import path, made absolute."""
  paths = [_PACKAGE_ROOT] + [os.path.abspath(p) for p in sys.path if p]
  return [sys.executable, "-c", _BOOT] + list(dict.fromkeys(paths))


def _worker_env(memory_mb: int) -> dict[str, str]:
  env = dict(os.environ)
  env[_worker.MEMORY_ENV] = str(memory_mb)
  # One thread per worker: BLAS thread pools would multiply the address
  # space that the memory cap counts and fight the trainer for cores.
  env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
  return env


class _Worker:
  """One worker subprocess and the task it is running, if any."""

  def __init__(self, argv: list[str], env: dict[str, str]):
    self.proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, env=env, close_fds=True,
        start_new_session=True)  # Own process group: kill it whole, no Ctrl-C.
    self.buffer = b""
    self.ready = False
    self.born = time.monotonic()
    self.task: int | None = None
    self.deadline = float("inf")

  def fileno(self) -> int:
    return self.proc.stdout.fileno()

  def send(self, message: dict[str, Any]) -> bool:
    """Writes one line; False if the worker is gone."""
    try:
      self.proc.stdin.write((json.dumps(message) + "\n").encode())
      self.proc.stdin.flush()
      return True
    except (BrokenPipeError, OSError, ValueError):
      return False

  def read_lines(self) -> list[bytes] | None:
    """The complete lines available now; None at EOF (the worker died)."""
    chunk = os.read(self.fileno(), 1 << 16)
    if not chunk:
      return None
    self.buffer += chunk
    *lines, self.buffer = self.buffer.split(b"\n")
    return lines

  def kill(self) -> None:
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    for stream in (self.proc.stdin, self.proc.stdout):
      try:
        stream.close()
      except OSError:
        pass
    self.proc.wait()


class WorkerPool:
  """`num_workers` verifier processes; `run` maps a task over many inputs.

  Thread-safe (one `run` at a time). Workers start lazily on the first `run`
  and live until `close()` or interpreter exit.
  """

  def __init__(self, num_workers: int | None = None, memory_mb: int = 2048,
               startup_timeout: float = 60.0):
    cpus = os.cpu_count() or 1
    self.num_workers = num_workers or max(1, min(16, cpus))
    self.memory_mb = memory_mb
    self.startup_timeout = startup_timeout
    self.workers: list[_Worker] = []
    self._lock = threading.Lock()
    self.start_failures = 0  # Consecutive workers that died before ready.
    self.restarts = 0  # Workers replaced after a timeout or crash.
    atexit.register(self.close)

  def _spawn(self) -> _Worker:
    return _Worker(_worker_argv(), _worker_env(self.memory_mb))

  def replace(self, worker: _Worker) -> None:
    """Kills `worker` and puts a fresh one in its slot."""
    worker.kill()
    self.workers[self.workers.index(worker)] = self._spawn()
    self.restarts += 1

  def run(self, task: str, args: Sequence[Sequence[Any]],
          timeout: float) -> list[Any]:
    """Runs `task(*a)` for each `a` in parallel; results in input order.

    Each result is what the task returned, or None if it raised, ran past
    `timeout` seconds of wall-clock time (counted from when a worker took it),
    or killed its worker.
    """
    if not args:
      return []
    with self._lock:
      # Start workers as batches need them: a 4-pair batch on a 64-core
      # host should not pay for 16 sympy imports.
      while len(self.workers) < min(self.num_workers, len(args)):
        self.workers.append(self._spawn())
      return _Dispatch(self, task, args, timeout).loop()

  def close(self) -> None:
    """Kills every worker. The next `run` starts fresh ones."""
    with self._lock:
      for worker in self.workers:
        worker.kill()
      self.workers = []


class _Dispatch:
  """The state of one `WorkerPool.run` call: queue, results, the select loop."""

  def __init__(self, pool: WorkerPool, task: str, args: Sequence[Sequence[Any]],
               timeout: float):
    self.pool, self.task, self.args, self.timeout = pool, task, args, timeout
    self.results: list[Any] = [None] * len(args)
    self.queue = collections.deque(range(len(args)))
    self.pending = len(args)

  def finish(self, worker: _Worker, value: Any) -> None:
    self.results[worker.task] = value
    self.pending -= 1
    worker.task, worker.deadline = None, float("inf")

  def assign(self) -> None:
    """Gives queued tasks to idle, ready workers."""
    for worker in list(self.pool.workers):
      if not self.queue:
        return
      if not worker.ready or worker.task is not None:
        continue
      index = self.queue.popleft()
      message = {"id": index, "task": self.task, "args": list(self.args[index]),
                 "soft_timeout": self.timeout * _SOFT_FRACTION}
      if worker.send(message):
        worker.task, worker.deadline = index, time.monotonic() + self.timeout
      else:  # Died while idle: requeue the task, replace the worker.
        self.queue.appendleft(index)
        self.pool.replace(worker)

  def reap(self) -> None:
    """Kills workers past their deadline and workers that never got ready."""
    now = time.monotonic()
    pool = self.pool
    for worker in list(pool.workers):
      if worker.task is not None and now >= worker.deadline:
        self.finish(worker, None)
        pool.replace(worker)
      elif not worker.ready and now - worker.born > pool.startup_timeout:
        self.on_start_failure(worker)

  def on_start_failure(self, worker: _Worker) -> None:
    pool = self.pool
    pool.start_failures += 1
    pool.replace(worker)

  def on_line(self, worker: _Worker, line: bytes) -> None:
    try:
      message = json.loads(line)
    except ValueError:
      return
    if not isinstance(message, dict):
      return
    if message.get("ready") is True:
      worker.ready = True
      self.pool.start_failures = 0
    elif worker.task is not None and message.get("id") == worker.task:
      self.finish(worker, message.get("value"))

  def on_readable(self, worker: _Worker) -> None:
    lines = worker.read_lines()
    if lines is None:  # EOF: the worker crashed.
      if worker.task is not None:
        self.finish(worker, None)
      if not worker.ready:
        self.on_start_failure(worker)
      else:
        self.pool.replace(worker)
      return
    for line in lines:
      self.on_line(worker, line)

  def wait_time(self) -> float:
    now = time.monotonic()
    ends = [w.deadline for w in self.pool.workers if w.task is not None]
    ends += [w.born + self.pool.startup_timeout
             for w in self.pool.workers if not w.ready]
    return max(0.0, min(ends, default=now + 1.0) - now)

  def loop(self) -> list[Any]:
    pool = self.pool
    while self.pending:
      if pool.start_failures >= _MAX_START_FAILURES * pool.num_workers:
        log.error("verifier workers fail to start; answering None for %d tasks",
                  self.pending)
        for worker in list(pool.workers):
          if worker.task is not None:
            pool.replace(worker)
        break
      self.assign()
      readable, _, _ = select.select(pool.workers, [], [], self.wait_time())
      for worker in readable:
        if worker in pool.workers:
          self.on_readable(worker)
      self.reap()
    return self.results
