"""Running model-written Python against unit tests, isolated from the trainer.

Layers, outermost first:
  * a fresh process (never a fork of the trainer) in its own session, killed
    with its whole process group at the wall-clock timeout;
  * where the host allows it, `unshare` puts it in new network, PID and
    mount namespaces: no network at all, every process it starts dies with
    it, and the whole file system but its working directory is read-only;
  * in the process (`_sandbox_runner.py`, before any model code runs):
    rlimits on CPU seconds, address space, file size, open files and process
    count, root dropped to `nobody` where the interpreter stays readable,
    sockets / fork / exec / kill / ctypes replaced by functions that raise;
  * a temporary working directory, deleted afterwards; output goes to files
    there, so the file-size limit also caps what it can print;
  * a secret token that only the runner prints, after the tests: exiting
    early with status 0 is not a pass.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile

_RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "_sandbox_runner.py")


@dataclasses.dataclass(frozen=True)
class Limits:
  timeout: float = 10.0  # Wall-clock seconds.
  memory_mb: int = 1024
  file_mb: int = 16
  processes: int = 16


@dataclasses.dataclass(frozen=True)
class Result:
  passed: int
  total: int
  timed_out: bool = False

  @property
  def fraction(self) -> float:
    return self.passed / self.total if self.total else 0.0


# Runs inside the new mount namespace as root of it: the working directory
# stays writable, every other mount (but /proc, /sys, /dev) is remounted
# read-only, and the script refuses to go on if "/" is still writable.
_READONLY_FS = r"""
mount --bind "$1" "$1" || exit 111
for m in $(awk '{print $2}' /proc/self/mounts); do
  case "$m" in "$1"|/proc|/proc/*|/sys|/sys/*|/dev|/dev/*) ;;
    *) mount -o remount,bind,ro "$m" 2>/dev/null ;;
  esac
done
if touch /.grpo_jax_sandbox_probe 2>/dev/null; then exit 112; fi
cd "$1" || exit 113  # The old cwd still points into the read-only mount.
shift
exec "$@"
"""


def _namespace_args() -> tuple[str, ...]:
  unshare = shutil.which("unshare")
  if unshare is None:
    return ()
  user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
  return (unshare, *user, "--net", "--pid", "--fork", "--kill-child")


def _wrap(mode: str, workdir: str, argv: list[str]) -> list[str]:
  """`argv` inside the isolation `mode`: "readonly", "namespaces" or "none"."""
  if mode == "readonly":
    return [*_namespace_args(), "--mount", "--", "sh", "-c", _READONLY_FS,
            "sh", workdir, *argv]
  if mode == "namespaces":
    return [*_namespace_args(), "--", *argv]
  return list(argv)


@functools.lru_cache(maxsize=1)
def isolation_mode() -> str:
  """The strongest isolation this host allows, found by trying it once.

  "readonly": new network, PID and mount namespaces with a read-only file
  system but for the working directory; "namespaces": the first two only;
  "none": just the in-process guards.
  """
  if not _namespace_args():
    return "none"
  probe_dir = tempfile.mkdtemp(prefix="grpo_jax_sandbox_")
  try:
    for mode in ("readonly", "namespaces"):
      if mode == "readonly" and not (shutil.which("mount") and shutil.which("awk")):
        continue
      try:  # A relative path: the code must be able to write in its cwd.
        subprocess.run(_wrap(mode, probe_dir, ["touch", mode]), cwd=probe_dir,
                       capture_output=True, timeout=10, check=True)
      except (OSError, subprocess.SubprocessError):
        continue
      if os.path.exists(os.path.join(probe_dir, mode)):
        return mode
    return "none"
  finally:
    shutil.rmtree(probe_dir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def _command(workdir: str, limits: Limits) -> list[str]:
  runner_limits = {"cpu_seconds": int(limits.timeout) + 1,
                   "memory_mb": limits.memory_mb, "file_mb": limits.file_mb,
                   "processes": limits.processes}
  return _wrap(isolation_mode(), workdir, [
      sys.executable, "-I", _RUNNER, workdir, json.dumps(runner_limits)])


def _read_result(path: str, token: str, total: int) -> Result:
  """Parses the runner's last line; anything else is zero passes."""
  with open(path, "rb") as f:
    f.seek(max(0, os.path.getsize(path) - 256))
    tail = f.read().decode(errors="replace").strip().splitlines()
  fields = tail[-1].split() if tail else []
  if len(fields) == 3 and fields[0] == token and fields[1].isdigit():
    return Result(min(int(fields[1]), total), total)
  return Result(0, total)


def run_tests(solution: str, tests: list[str], limits: Limits = Limits()
              ) -> Result:
  """Runs `solution` then each test (assert statements) in a sandbox."""
  workdir = tempfile.mkdtemp(prefix="grpo_jax_sandbox_")
  try:
    with open(os.path.join(workdir, "solution.py"), "w") as f:
      f.write(solution)
    with open(os.path.join(workdir, "tests.json"), "w") as f:
      json.dump(list(tests), f)
    out_path = os.path.join(workdir, "stdout")
    token = secrets.token_hex(16)
    with open(out_path, "wb") as out:
      proc = subprocess.Popen(
          _command(workdir, limits), cwd=workdir, stdin=subprocess.PIPE,
          stdout=out, stderr=subprocess.DEVNULL, start_new_session=True,
          env={"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"})
      try:
        proc.communicate((token + "\n").encode(), timeout=limits.timeout)
      except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.wait()
        return Result(0, len(tests), timed_out=True)
      finally:
        _kill_group(proc)  # Anything it left running in the background.
    return _read_result(out_path, token, len(tests))
  except OSError:
    return Result(0, len(tests))
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
