"""Running model-written Python, isolated from the host, and reading back values.

`execute(program, calls, stdin=...)` runs, in one fresh sandbox, for each
call `program` and then that call's setup and expression, each in a fresh
process, and returns the result lines: the values serialised to plain data,
or the names of the exceptions raised; for I/O-style tasks it runs the
program as a script on each given stdin and returns what it printed. It
never tells the sandbox what the values or outputs should be: the caller
compares. `run_calls` also rebuilds the values here (`parse_results`), for
trusted programs: for the model's, the code reward does that where a hard
time and memory bound applies (`_checker.py`). docs/sandbox.md has the
measurements.

The isolation (`_sandbox_runner.py`) is the kernel's, whoever the caller is:

  * new user, mount, PID, network, IPC, UTS and cgroup namespaces; the code
    runs as an unprivileged uid inside, mapped to the caller's uid, or, for a
    root caller, to a random unprivileged host uid: never host root;
  * a new root on a tmpfs: read-only /usr, /lib* and standard library, a
    fresh /proc of its own PID namespace, a /dev of five harmless devices, no
    /sys, no /home, /root, /etc (but ld.so.cache), and a private tmpfs /tmp
    (also /dev/shm) of `disk_mb`;
  * no capabilities, no new privileges, a seccomp filter on x86_64 (no
    execve, ptrace, mount, setns, unshare, bpf, io_uring, keyctl, sysinfo,
    SysV IPC, ...; sockets of the unix and IP families only: the network
    namespace is empty, and vsock, netlink, packet, ... would reach
    outside it);
  * rlimits, which bind because the sandbox's host uid is not root: CPU
    seconds, address space per process, file size, processes and threads;
  * where this process may create cgroups (v2, else v1; `_cgroups.py`), one
    per run caps its total memory (`memory_mb`, tmpfs included) and tasks;
  * the wall-clock timeout kills the PID namespace's init, so every process
    the run started is gone, and nothing was ever written to the host's disk,
    when `run_calls` returns. If the trainer dies, the sandbox dies with it.

Without cgroups (an unprivileged caller, usually) `memory_mb` bounds each
process only: a run's total is bounded by `processes` x `memory_mb`, plus
the tmpfs size. `resource_control()` says which applies here.

Where the host cannot build this (no user namespaces, a masked kernel),
`require()` raises `SandboxUnavailable` naming the reason, and logs it once:
the code reward refuses to run code rather than run it with less.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import secrets
import selectors
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

from grpo_jax.rewards import _cgroups
from grpo_jax.rewards._results import NOT_RUN, READY, Raised, parse_results  # pylint: disable=unused-import

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "_sandbox_runner.py")
_EXIT_TIMEOUT, _EXIT_SETUP = 3, 70
_GRACE = 5.0  # Seconds past the timeout before the launcher itself is killed.


@dataclasses.dataclass(frozen=True)
class Limits:
  timeout: float = 10.0  # Wall-clock seconds for the whole run.
  memory_mb: int = 1024  # Per process; per run only where a cgroup is made
  # (else a run may use `processes` x `memory_mb`; `resource_control()`).
  disk_mb: int = 64  # All files together (the tmpfs /tmp).
  processes: int = 16  # Processes and threads, the first one included.
  result_mb: int = 8  # Results read back; a run writing more is stopped.
  cpus: float = 1.0  # Cores a run's processes share, where a cgroup CPU
  # controller is available (`resource_control()`); else rlimits only.


class SandboxUnavailable(RuntimeError):
  """This host cannot isolate model code; it is not run at all."""


@dataclasses.dataclass(frozen=True)
class Run:
  values: tuple[Any, ...]  # One per call: plain data, `Iterated`, `Raised`.
  timed_out: bool = False
  setup_error: str | None = None  # The sandbox could not be built.
  outputs: tuple[str | Raised, ...] = ()  # stdout per stdin, or `Raised`.


# The runner's source comes first on its stdin: no path of this checkout (nor
# the virtualenv's: the interpreter is the real one, -S needs no site) is on
# its command line, in its code objects or its sys.argv.
# Read with os.read, exactly: a buffered reader would read ahead into the
# job, and the launcher (and every process forked from it) would hold calls
# that only the child running each may read (issue 45).
_BOOT = ("import os\n"
         "def take(n):\n"
         " data = b''\n"
         " while len(data) < n:\n"
         "  chunk = os.read(0, n - len(data))\n"
         "  if not chunk: break\n"
         "  data += chunk\n"
         " return data\n"
         "head = b''\n"
         "while not head.endswith(b'\\n') and len(head) < 20: head += take(1) or b'\\n'\n"
         "exec(compile(take(int(head)), 'sandbox', 'exec'))")


def _frame(data: bytes) -> bytes:
  return b"%d\n" % len(data) + data


@functools.lru_cache(maxsize=1)
def _runner_source() -> bytes:
  with open(_RUNNER, "rb") as f:
    return _frame(f.read())


def _job(program: str, calls: Sequence[tuple[str, str]], stdin: Sequence[str],
         limits: Limits) -> bytes:
  """The runner, a header frame (program, limits, counts), then one frame per
  stdin and one per call, each read only by the child that runs it."""
  dump = lambda obj: _frame(json.dumps(obj, ensure_ascii=True).encode("ascii"))
  header = {"program": program, "limits": dataclasses.asdict(limits),
            "num_stdin": len(stdin), "num_calls": len(calls)}
  return b"".join([_runner_source(), dump(header), *map(dump, stdin),
                   *(dump(list(c)) for c in calls)])


def _command(label: str) -> list[str]:
  return [os.path.realpath(sys.executable), "-I", "-S", "-B", "-c", _BOOT,
          label]


def _communicate(proc: subprocess.Popen, job: bytes, deadline: float,
                 result_bytes: int) -> tuple[bytes, bytes]:
  """Sends the job as the sandbox reads it (each call's frame only when its
  child reads it); reads results and diagnostics until the launcher's pipes
  close (it exits only after every sandboxed process is gone) or `deadline`."""
  out, err = bytearray(), bytearray()
  buffers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
  caps = {proc.stdout.fileno(): result_bytes, proc.stderr.fileno(): 65536}
  pending, stdin_fd = memoryview(job), proc.stdin.fileno()
  os.set_blocking(stdin_fd, False)
  with selectors.DefaultSelector() as selector:
    for fd in buffers:
      selector.register(fd, selectors.EVENT_READ)
    selector.register(stdin_fd, selectors.EVENT_WRITE)
    while len(selector.get_map()) > (1 if pending is not None else 0):
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        break
      for key, _ in selector.select(remaining):
        if key.fd == stdin_fd:
          pending = _write_some(proc, selector, pending)
          continue
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
          selector.unregister(key.fd)
          continue
        buffer = buffers[key.fd]
        if len(buffer) + len(chunk) > caps[key.fd]:
          if key.fd == proc.stdout.fileno() and len(buffer) < caps[key.fd]:
            proc.send_signal(signal.SIGTERM)  # The launcher kills the run.
          chunk = chunk[:max(0, caps[key.fd] - len(buffer))]
        buffer += chunk
  return bytes(out), bytes(err)


def _write_some(proc: subprocess.Popen, selector, pending):
  """Writes what the pipe takes now; at the end (or if the run is gone)
  closes stdin and returns None."""
  try:
    pending = pending[os.write(proc.stdin.fileno(), pending):]
  except BlockingIOError:
    return pending
  except OSError:
    pending = pending[:0]  # It died early; its stderr says why.
  if len(pending):
    return pending
  selector.unregister(proc.stdin.fileno())
  proc.stdin.close()
  return None


@dataclasses.dataclass(frozen=True)
class Output:
  """A run's result lines as written, not decoded (see `parse_results`)."""
  results: bytes
  timed_out: bool = False
  setup_error: str | None = None  # The sandbox could not be built.


def execute(program: str, calls: Sequence[tuple[str, str]],
            limits: Limits = Limits(), *, stdin: Sequence[str] = (),
            label: str = "") -> Output:
  """In one fresh sandbox: first, for each text in `stdin`, `program` as a
  script (`__main__`) on that input, in a process of its own, capturing its
  stdout (1 MiB at most; a non-zero exit is `Raised`); then, for each (setup
  statements, expression) in `calls`, in a process of its own, `program` as
  a module, the setup and the expression. `label` goes on the sandbox's
  command line (to find its processes)."""
  job = _job(program, calls, stdin, limits)
  deadline = time.monotonic() + limits.timeout + _GRACE
  cgroup = _cgroups.RunCgroup(limits.memory_mb * 2**20, limits.processes + 4, limits.cpus)
  try:
    proc = subprocess.Popen(
        _command(label or secrets.token_hex(8)), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
        env={"PATH": "/usr/bin:/bin"}, start_new_session=True)
  except OSError as e:
    cgroup.close()
    return Output(b"", setup_error=f"cannot start: {e}")
  try:
    cgroup.add(proc.pid)  # Before it reads its job: nothing forked yet.
    if cgroup.error is not None:
      _say_once(logging.WARNING, f"{cgroup.error}; this run has rlimits only")
    out, err = _communicate(proc, job, deadline, limits.result_mb * 2**20)
  finally:
    if proc.poll() is None:  # Only past the grace period: a stuck launcher.
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
      stream.close()
    cgroup.close()
  timed_out = proc.returncode in (_EXIT_TIMEOUT, -signal.SIGKILL)
  if out.partition(b"\n")[0] != READY:
    reason = err.decode("utf-8", "replace").strip() or (
        f"the launcher exited with status {proc.returncode}")
    return Output(out, timed_out, reason)
  return Output(out, timed_out)


def run_calls(program: str, calls: Sequence[tuple[str, str]],
              limits: Limits = Limits(), *, stdin: Sequence[str] = (),
              label: str = "") -> Run:
  """`execute`, its values decoded here: for programs the caller trusts not
  to return adversarial data (the probe below, tests); the code reward
  decodes and compares where a hard time and memory bound applies."""
  output = execute(program, calls, limits, stdin=stdin, label=label)
  results = (None if output.setup_error is not None else
             parse_results(output.results, len(calls), len(stdin)))
  if results is None:
    return Run((NOT_RUN,) * len(calls), output.timed_out,
               setup_error=output.setup_error or "no results",
               outputs=(NOT_RUN,) * len(stdin))
  return Run(results[0], output.timed_out, outputs=results[1])


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
  """Why this host cannot run the sandbox, or None; found by trying it once,
  including that the code's uid is not host root."""
  calls = [("", "x + 1"), ("", "open('/proc/self/uid_map').read().split()")]
  for _ in range(2):  # A second try, in case the first met a passing shortage.
    run = run_calls("x = 41", calls, Limits(timeout=30.0))
    if run.setup_error is None:
      break
  if run.setup_error is not None:
    return run.setup_error
  if run.values[0] != 42 or not isinstance(run.values[1], list):
    return f"the probe program returned {run.values!r}"
  inside, host, _ = run.values[1]
  if _host_root() and host == "0":
    return f"the sandbox's uid {inside} is host root"
  return None


def _host_root() -> bool:
  """Whether this process is root of the host's user namespace."""
  try:
    with open("/proc/self/uid_map", "rb") as f:
      full = f.read().split()[:3] == [b"0", b"0", b"4294967295"]
  except OSError:
    full = False
  return os.geteuid() == 0 and full


def resource_control() -> str:
  """Which limits a run gets on this host, in words."""
  return _cgroups.describe()


_said: set[str] = set()


def _say_once(level: int, message: str) -> None:
  if message not in _said and len(_said) < 20:
    _said.add(message)
    logging.log(level, "code reward sandbox: %s", message)


def require() -> None:
  """Raises `SandboxUnavailable` (logging it the first time) where model
  code cannot be isolated on this host."""
  reason = unavailable_reason()
  if reason is None:
    _say_once(logging.INFO if _cgroups.parents() else logging.WARNING,
              f"namespaces, seccomp; {resource_control()}")
    return
  message = (f"refusing to run model-written code: this host cannot isolate it "
             f"({reason}). The sandbox needs unprivileged user namespaces "
             "(sysctl user.max_user_namespaces > 0, and on Debian/Ubuntu "
             "kernel.unprivileged_userns_clone=1 / no AppArmor userns "
             "restriction) with mount, PID and network namespaces.")
  _say_once(logging.ERROR, message)
  raise SandboxUnavailable(message)
