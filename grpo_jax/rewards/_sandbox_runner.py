"""The trusted first half of a sandboxed run (`sandbox.py`): it limits and
locks down its own process, then executes the model's code and the tests.

Run as `python -I _sandbox_runner.py WORKDIR LIMITS_JSON` with the run's
secret token on stdin. Prints `<token> <passed> <total>` as its last act;
a program that exits early (`sys.exit(0)`, `os._exit(0)`) never prints the
token and so never passes. Never imported by the trainer.
"""
import json
import os
import resource
import stat
import sys

NOBODY = 65534


def limit_resources(limits):
  """CPU seconds, address space, file size, open files, processes, no core."""
  cpu = int(limits["cpu_seconds"])
  memory = int(limits["memory_mb"]) * 2**20
  for name, value in (("RLIMIT_CPU", cpu), ("RLIMIT_AS", memory),
                      ("RLIMIT_FSIZE", int(limits["file_mb"]) * 2**20),
                      ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0),
                      ("RLIMIT_NPROC", int(limits["processes"]))):
    resource.setrlimit(getattr(resource, name), (value, value))


def others_can_run_python():
  """Whether an unprivileged user could still import the standard library."""
  path = os.path.dirname(os.__file__)
  while True:
    if not os.stat(path).st_mode & stat.S_IXOTH:
      return False
    parent = os.path.dirname(path)
    if parent == path:
      return True
    path = parent


def drop_privileges(workdir):
  """root -> nobody: the process limit then applies, root's files are safe."""
  if os.geteuid() != 0 or not others_can_run_python():
    return
  os.chown(workdir, NOBODY, NOBODY)
  os.setgroups([])
  os.setgid(NOBODY)
  os.setuid(NOBODY)


def _blocked(*args, **kwargs):
  raise PermissionError("not allowed in the sandbox")


def block_escapes():
  """No sockets, no new processes, no signals to others, no ctypes.

  The kernel-level guards (network namespace, process limit) come first
  when the host allows them; this covers hosts where it does not.
  """
  import _posixsubprocess  # pylint: disable=g-import-not-at-top
  import _socket  # pylint: disable=g-import-not-at-top
  import posix  # pylint: disable=g-import-not-at-top
  import socket  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  for module in (socket, _socket):
    for name in ("socket", "socketpair", "create_connection", "getaddrinfo",
                 "create_server", "fromfd"):
      if hasattr(module, name):
        setattr(module, name, _blocked)
  for module in (os, posix):
    for name in ("fork", "forkpty", "system", "popen", "kill", "killpg",
                 "posix_spawn", "posix_spawnp", "execv", "execve", "execl",
                 "execle", "execlp", "execlpe", "execvp", "execvpe",
                 "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv",
                 "spawnve", "spawnvp", "spawnvpe", "register_at_fork"):
      if hasattr(module, name):
        setattr(module, name, _blocked)
  _posixsubprocess.fork_exec = _blocked
  subprocess.Popen = _blocked
  for name in ("ctypes", "_ctypes", "multiprocessing"):
    sys.modules[name] = None


def run_tests(solution, tests):
  """Executes the solution, then each test in its namespace; # passed."""
  namespace = {"__name__": "solution"}  # Not "__main__": no main() runs.
  try:
    exec(compile(solution, "solution.py", "exec"), namespace)  # pylint: disable=exec-used
  except BaseException:  # pylint: disable=broad-except
    return 0
  passed = 0
  for i, test in enumerate(tests):
    try:
      exec(compile(test, f"test_{i}.py", "exec"), namespace)  # pylint: disable=exec-used
      passed += 1
    except BaseException:  # pylint: disable=broad-except
      pass
  return passed


def main():
  workdir, limits = sys.argv[1], json.loads(sys.argv[2])
  token = sys.stdin.readline().strip()
  sys.stdin.close()
  os.close(0)
  result_fd = os.dup(1)
  with open(os.path.join(workdir, "solution.py")) as f:
    solution = f.read()
  with open(os.path.join(workdir, "tests.json")) as f:
    tests = json.load(f)
  for name in ("solution.py", "tests.json"):  # The code must not read its tests.
    os.remove(os.path.join(workdir, name))
  drop_privileges(workdir)
  limit_resources(limits)
  block_escapes()
  passed = run_tests(solution, tests)
  os.write(result_fd, f"\n{token} {passed} {len(tests)}\n".encode())
  os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
  main()
