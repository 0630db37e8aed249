"""The code reward and its sandbox: outcomes, the trusted-side test checks,
and one regression test per escape or reward hack found against the old
sandbox (issues 18 and 30). Every probe is harmless when it succeeds: markers go to
this test's tmp_path, listeners are this test's own on 127.0.0.1, and the
process it would write into is this test's own sleeping child.

The module runs as whoever runs the tests (root in CI) and, when that is
root, once more as uid 65534 (`test_as_an_unprivileged_caller`)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest

from grpo_jax.rewards import _checker, _code_checks, code, sandbox

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
QUICK = sandbox.Limits(timeout=5.0)
CORRECT = "def add(a, b):\n  return a + b"
WRONG = "def add(a, b):\n  return a - b + 7"  # Fails both ADD_TESTS.


def _fenced(program: str) -> str:
  return f"Here is my solution:\n```python\n{program}\n```\nDone."


def _reward(programs: list[str], tests=None, **kwargs) -> list[float]:
  tests = ADD_TESTS if tests is None else tests
  kwargs.setdefault("timeout", 5.0)
  got = code.code_reward(None, [_fenced(p) for p in programs],
                         [tests] * len(programs), np.ones(len(programs)),
                         **kwargs)
  return got.tolist()


def _probe(program: str, *expressions: str, limits=QUICK, label: str = ""):
  """The values of `expressions` after `program`, straight from the sandbox."""
  run = sandbox.run_calls(program, [("", e) for e in expressions], limits,
                          label=label)
  assert run.setup_error is None, run.setup_error
  return run.values


# ---------------------------------------------------------------- outcomes

@pytest.mark.parametrize("name,program,passed", [
    ("correct", CORRECT, 2),
    ("wrong", "def add(a, b):\n  return a - b", 1),
    ("syntax_error", "def add(a, b) return a + b", 0),
    ("exit_zero_early", "import sys\nsys.exit(0)", 0),
    ("os_exit_zero", "import os\nos._exit(0)", 0),
    ("fork_bomb", "import os\nwhile True:\n  os.fork()", 0),
    ("subprocess", "import subprocess\nsubprocess.run(['true'])\n" + CORRECT, 0),
    ("network", "import socket\nsocket.create_connection(('1.1.1.1', 80), 1)\n"
                + CORRECT, 0),
    ("memory_bomb", "x = bytearray(64 * 2**30)\n" + CORRECT, 0),
    ("output_flood", "while True:\n  print('x' * 100000)", 0),
    ("fake_result_lines", "print('{\"i\": 0, \"v\": {\"i\": \"3\"}}')\n" + WRONG, 0),
    ("nul_byte", "def add(a, b):\n  return a + b\x00", 0),
    ("writes_its_cwd", "open('scratch.txt', 'w').write('ok')\n" + CORRECT, 2),
    ("main_guard_not_run", CORRECT + "\nif __name__ == '__main__':\n"
                                     "  raise SystemExit(1)", 2),
])
def test_run_tests_outcomes(name, program, passed):
  del name
  result = code.run_tests(program, ADD_TESTS, sandbox.Limits(timeout=3.0))
  assert (result.passed, result.total) == (passed, 2)


def test_a_checker_that_ended_while_idle_is_replaced_not_used():
  """A checker process that is gone (killed, or retired after a big check)
  never decides a completion: the next one gets a live checker, and a
  correct program still scores."""
  tests = ADD_TESTS
  assert code.run_tests(CORRECT, tests, sandbox.Limits(timeout=3.0)).passed == 2
  for checker in list(_checker._idle):
    checker.proc.kill()
    checker.proc.wait()
  assert code.run_tests(CORRECT, tests, sandbox.Limits(timeout=3.0)).passed == 2
  assert all(c.alive for c in _checker._idle)


def test_an_infinite_loop_is_killed_and_earlier_results_still_count():
  program = CORRECT + "\ndef spin():\n  while True:\n    pass"
  values = _probe(program, "add(1, 2)", "spin()", "add(2, 2)",
                  limits=sandbox.Limits(timeout=1.5))
  assert values == (3, sandbox.NOT_RUN, sandbox.NOT_RUN)


def test_a_run_writing_too_many_results_is_stopped():
  """A call's value over `result_mb` is refused inside; results over it in
  all stop the run."""
  run = sandbox.run_calls("big = 'x' * (3 << 20)\nhalf = 'x' * (600 << 10)",
                          [("", e) for e in ("1", "big", "half", "half", "2")],
                          sandbox.Limits(timeout=30.0, result_mb=1))
  assert run.values[:3] == (1, sandbox.Raised("ResultTooLarge"),
                            "x" * (600 << 10))
  assert run.values[3:] == (sandbox.NOT_RUN,) * 2 and run.timed_out


def test_code_reward_all_or_nothing_and_fraction():
  completions = [_fenced(CORRECT), _fenced("def add(a, b):\n  return a - b"),
                 _fenced("def add(a, b):\n  return a - b"), "I cannot."]
  answers = ["\n".join(ADD_TESTS), "\n".join(ADD_TESTS), ADD_TESTS, ADD_TESTS]
  got = code.code_reward(None, completions, answers, np.ones(4), timeout=5.0)
  np.testing.assert_array_equal(got, [1.0, 0.0, 0.5, 0.0])


DOUBLE = "import sys\nfor line in sys.stdin:\n  print(int(line) * 2)"


@pytest.mark.parametrize("program,passed", [
    (DOUBLE, 3),
    ("print(int(input()) * 2)", 2),  # Reads only the first line.
    ("import sys\nprint(int(input()) * 2)\nsys.exit(3)", 0),  # Exit status.
    ("print(4)", 1),
    ("while True:\n  pass", 0),
])
def test_io_cases_compare_printed_output_here(program, passed):
  tests = [{"input": "2\n", "output": "4"},
           {"input": "5\n", "output": "10  \n\n"},  # Trailing space, blanks.
           {"input": "1\n2\n", "output": "2\n4\n"}]
  result = code.run_tests(program, tests, sandbox.Limits(timeout=2.0))
  assert (result.passed, result.total) == (passed, 3)


def test_io_cases_and_asserts_mix_in_one_answer():
  answers = [[{"input": "2", "output": "4"}, "assert double(3) == 6"],
             {"input": "2", "output": "4"}]
  program = "def double(x):\n  return 2 * x\nif __name__ == '__main__':\n" \
            "  print(double(int(input())))"
  got = code.code_reward(None, [_fenced(program)] * 2, answers, np.ones(2),
                         timeout=5.0)
  np.testing.assert_array_equal(got, [1.0, 1.0])
  # Issue 45: a test that is neither decidable nor an I/O case is refused when
  # the data is loaded, naming it (it used to score 0).
  with pytest.raises(code.UnevaluableTest, match="input"):
    code.code_reward(None, [_fenced(program)], [{"input": "2"}], np.ones(1), timeout=5.0)


def test_extract_code_takes_the_last_python_block():
  text = "```python\nx = 1\n```\nbetter:\n```python\nx = 2\n```\n```\nplain\n```"
  assert code.extract_code(text).strip() == "x = 2"
  assert code.extract_code("```\ny = 3\n```").strip() == "y = 3"
  assert code.extract_code("no code here") is None


def test_values_come_back_as_exact_plain_data():
  program = ("import collections\n"
             "def data():\n  return [1, -2**80, 0.1, float('inf'), 1j, 'π', "
             "b'\\x00', (1,), {2}, frozenset([3]), {'a': [None, True]}]\n"
             "def counter():\n  return collections.Counter('aab')\n"
             "def obj():\n  return object()\n")
  values = _probe(program, "data()", "counter()", "obj()", "1 / 0")
  assert values[:2] == ([1, -2**80, 0.1, float("inf"), 1j, "π", b"\x00", (1,),
                         {2}, frozenset([3]), {"a": [None, True]}],
                        {"a": 2, "b": 1})
  assert values[2:] == (sandbox.Raised("TypeError"),
                        sandbox.Raised("ZeroDivisionError"))


# ---------------------------------------------------------------- test checks

@pytest.mark.parametrize("test,program,passes", [
    ("assert add(1, 2) == 3", CORRECT, True),
    ("assert add(1, 2) == 4", CORRECT, False),
    ("assert add(1, 2) != 4\nassert -add(1, 2) == -3", CORRECT, True),
    ("assert add(0.1, 0.2) == 0.3", CORRECT, False),
    ("import math\nassert math.isclose(add(0.1, 0.2), 0.3)", CORRECT, True),
    ("from math import isclose\nassert isclose(add(0.1, 0.2), 0.3)", CORRECT,
     True),
    ("assert abs(add(0.1, 0.2) - 0.3) < 1e-9", CORRECT, True),
    ("assert set(add([1, 2], [2])) == {1, 2}", CORRECT, True),
    ("assert sorted(add([3], [1])) == [1, 3]", CORRECT, True),
    ("assert add(1, 1)", "def add(a, b): return a - b", False),
    ("assert not add(1, 1)", "def add(a, b): return a - b", True),
    ("assert add(1, 2) is None", "def add(a, b): return None", True),
    ("x = [1, 2]\nassert add(x, [3]) == x + [3]", CORRECT, True),
    ("y = add(1, 2)\nassert y == 3", CORRECT, True),
    ("expected = 3\nassert add(1, 2) == expected", CORRECT, True),
    ("expected = 3\nassert add(1, 2) == expected",
     "def add(a, b): return globals().get('expected')", False),
    ("assert add('a', 'b') == 'ab', 'message'", CORRECT, True),
    ("assert 3 == add(1, 2) == 3", CORRECT, True),
    ("assert all(x > 0 for x in [add(1, 2)])", CORRECT, False),  # Unsplittable.
    ("def check(f):\n  assert f(1, 2) == 3\ncheck(add)", CORRECT, False),
    ("for i in range(3):\n  assert add(i, 0) == i", CORRECT, False),
    ("assert add(2, 3) ** add(10**6, 0) == 1", CORRECT, False),  # Too large.
    ("assert add(2**5000, 0) ** 5000 == 1", CORRECT, False),
    ("assert add('x', 'y') * 10**6 * 10**6 == ''", CORRECT, False),
    ("assert add(1, 0) << add(10**9, 0) == 1", CORRECT, False),
    ("assert add(3, 0) ** 2 * 2 == 18", CORRECT, True),
    ("assert list(add(1, 2)) == [0, 1, 2]", "def add(a, b): return range(a + b)",
     True),
    ("assert add(1, 2) == [0, 1, 2]", "def add(a, b): return range(a + b)",
     False),
    ("assert sorted(add(1, 2)) == [0, 2, 4]",
     "def add(a, b): return (2 * i for i in range(a + b))", True),
])
def test_tests_are_decided_outside_the_sandbox(test, program, passes):
  result = code.run_tests(program, [test], QUICK)
  assert result.passed == int(passes)


def test_the_sandbox_gets_the_calls_and_inputs_never_the_expected_values():
  test = _code_checks.parse("import math\nassert add(1, 2) == 3\n"
                            "assert math.isclose(area(2), 12.56, rel_tol=0.1)"
                            "\nassert not f([1, 2])")
  assert test.calls == (("import math", "add(1, 2)"), ("import math", "area(2)"),
                        ("import math", "f([1, 2])"))
  test = _code_checks.parse("x = [3, 1]\nexpected = [1, 3]\ny = f(x)\n"
                            "assert y == expected\nassert g(x) == expected")
  assert test.calls == (("x = [3, 1]\ny = f(x)", "y"), ("x = [3, 1]", "g(x)"))


@pytest.mark.parametrize("text", [
    "assert all(f(i) == i for i in range(3))", "assert (lambda: f() == 1)()",
    "print(f(1))\nassert f(1) == 2", "not python (", "x = 1",
    "x = f(1) == 2\nassert x"])
def test_unsplittable_tests_are_refused(text):
  with pytest.raises(_code_checks.Unsplittable):
    _code_checks.parse(text)


# ---------------------------------------------------------------- host escapes

PROBES = r'''
import ctypes, os, socket, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)

def outcome(fn):
  try:
    return "done: " + repr(fn())[:200]
  except BaseException as e:
    return "failed: " + type(e).__name__

def pids():
  return [p for p in os.listdir('/proc') if p.isdigit()]

def write_through_proc_root(path):
  hits = []
  for pid in pids():
    try:
      with open(f'/proc/{pid}/root{path}', 'w') as f:
        f.write('escaped')
      hits.append(pid)
    except OSError:
      pass
  try:
    open(path, 'w').write('escaped')
    hits.append('direct')
  except OSError:
    pass
  return hits

def remount_and_write(marker):
  results = []
  for target in (b'/', b'/usr'):
    results.append(libc.mount(None, target, None, 32 | 4096, None))  # MS_REMOUNT|MS_BIND
  try:
    open(marker, 'w').write('x')
    results.append('wrote')
  except OSError:
    pass
  return results

def environ_hits(secret):
  hits = []
  for pid in pids():
    try:
      if secret.encode() in open(f'/proc/{pid}/environ', 'rb').read():
        hits.append(pid)
    except OSError:
      pass
  return hits

def setns_then_connect(port):
  joined = []
  for pid in pids():
    try:
      fd = os.open(f'/proc/{pid}/ns/net', os.O_RDONLY)
      if libc.setns(fd, 0x40000000) == 0:
        joined.append(pid)
    except OSError:
      pass
  return joined, outcome(lambda: socket.create_connection(('127.0.0.1', port), 1))

def unix_connect(address):
  s = socket.socket(socket.AF_UNIX)
  s.settimeout(1)
  s.connect(address)
  return 'connected'

def open_memory(pid):  # Opening for writing is the hole; nothing is written.
  with open(f'/proc/{pid}/mem', 'r+b'):
    return 'opened'

def shm(name):
  open('/dev/shm/' + name, 'w').write('x')
  return sorted(os.listdir('/dev/shm'))

def fork_count(n):
  sys.modules.pop('posix', None)
  import posix
  children = 0
  for _ in range(n):
    try:
      if posix.fork() == 0:
        import time
        time.sleep(3)
        posix._exit(0)
      children += 1
    except OSError:
      break
  return children

def capabilities():
  status = open('/proc/self/status').read()
  return [line.split()[1] for line in status.splitlines()
          if line.startswith(('CapEff', 'CapPrm', 'CapBnd'))]

def host_uid():
  return int(open('/proc/self/uid_map').read().split()[1])

def nested_namespace():
  return libc.unshare(0x10000000), libc.unshare(0x00020000)

def ptrace(pid):  # PTRACE_TRACEME (harmless), then PTRACE_ATTACH to `pid`
  return libc.ptrace(0, 0, None, None), libc.ptrace(16, pid, None, None)

def disk_bytes(limit_mb):  # Stops at 4x the limit, then deletes its files.
  total, names = 0, []
  try:
    for i in range(4 * limit_mb):
      names.append(f'f{i}')
      with open(names[-1], 'wb') as f:
        f.write(b'x' * (1 << 20))
      total += 1 << 20
  except OSError:
    pass
  for name in names:
    if os.path.exists(name):
      os.remove(name)
  return total
'''


@pytest.fixture(name="listener")
def fixture_listener():
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen()
  server.settimeout(0.0)
  yield server
  server.close()


def _accepted(server: socket.socket) -> bool:
  try:
    server.accept()[0].close()
    return True
  except BlockingIOError:
    return False


def test_no_file_is_written_on_the_host(tmp_path):
  marker = tmp_path / "escaped"
  values = _probe(PROBES, f"write_through_proc_root({str(marker)!r})",
                  f"remount_and_write({str(marker)!r})")
  assert values[0] == [] and not marker.exists()
  assert values[1] == [-1, -1]


def test_host_files_environment_and_processes_are_invisible(tmp_path,
                                                             monkeypatch):
  secret = tmp_path / "secret"
  secret.write_text("hunter2")
  secret.chmod(0o600)
  monkeypatch.setenv("GRPO_JAX_TEST_SECRET", "env-hunter2")
  helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ})
  try:
    values = _probe(PROBES, f"outcome(lambda: open({str(secret)!r}).read())",
                    "environ_hits('env-hunter2')", "pids()",
                    f"outcome(lambda: open_memory({helper.pid}))",
                    "outcome(lambda: open_memory(1))", f"ptrace({helper.pid})")
    assert helper.poll() is None
  finally:
    helper.kill()
    helper.wait()
  assert values[0] == "failed: FileNotFoundError"
  assert values[1] == []
  assert len(values[2]) == 4  # Its init, the worker, the relay (issue 45) and itself.
  assert sorted(values[2], key=int)[:2] == ["1", "2"]
  assert values[3].startswith("failed:") and values[4].startswith("failed:")
  assert values[5] == (-1, -1)


def test_no_network_even_after_setns_nor_unix_sockets(tmp_path, listener):
  path = str(tmp_path / "unix.sock")
  unix_server = socket.socket(socket.AF_UNIX)
  unix_server.bind(path)
  unix_server.listen()
  abstract = socket.socket(socket.AF_UNIX)
  abstract.bind(b"\0grpo_jax_test_" + os.urandom(4).hex().encode())
  abstract.listen()
  try:
    port = listener.getsockname()[1]
    values = _probe(PROBES, f"setns_then_connect({port})",
                    f"outcome(lambda: unix_connect({path!r}))",
                    f"outcome(lambda: unix_connect({abstract.getsockname()!r}))")
  finally:
    unix_server.close()
    abstract.close()
  joined, connected = values[0]
  assert joined == [] and connected.startswith("failed:")
  assert values[1].startswith("failed:") and values[2].startswith("failed:")
  assert not _accepted(listener)


SOCKETS = r"""
import ctypes, errno, socket, time
FAMILIES = {name: getattr(socket, name) for name in (
    "AF_UNIX", "AF_INET", "AF_INET6", "AF_VSOCK", "AF_NETLINK", "AF_PACKET",
    "AF_ALG", "AF_KEY", "AF_TIPC", "AF_CAN", "AF_RDS", "AF_BLUETOOTH", "AF_QIPCRTR")
    if hasattr(socket, name)}
FAMILIES.update(AF_XDP=44, AF_SMC=43, AF_MCTP=45)

def opened(family):
  try:
    kind = socket.SOCK_STREAM if family != socket.AF_PACKET else socket.SOCK_RAW
    socket.socket(family, kind).close()
    return "opened"
  except OSError as e:
    return errno.errorcode.get(e.errno, str(e.errno))

def families():
  return {name: opened(family) for name, family in FAMILIES.items()}

def vsock_bind(port):  # Then, renamed, holds whatever it got for 1 s.
  try:
    s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    s.bind((socket.VMADDR_CID_ANY, port))
    outcome = "bound"
  except OSError as e:
    outcome = errno.errorcode.get(e.errno, str(e.errno))
  ctypes.CDLL(None).prctl(15, b"vsock_tried", 0, 0, 0)  # PR_SET_NAME
  time.sleep(1)
  return outcome
"""


def _free_vsock_port() -> tuple[int | None, str]:
  try:
    with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as s:
      s.bind((socket.VMADDR_CID_ANY, socket.VMADDR_PORT_ANY))
      return s.getsockname()[1], ""
  except (OSError, AttributeError) as e:
    return None, f"this host cannot bind AF_VSOCK itself ({e})"


def _renamed(label: str, name: str) -> list[str]:
  found = []
  for pid in _labelled_processes(label):
    try:
      with open(f"/proc/{pid}/comm", encoding="ascii") as f:
        if f.read().strip() == name:
          found.append(pid)
    except OSError:
      pass
  return found


def test_only_unix_and_ip_sockets_and_vsock_stays_outside():
  """Every other family fails as if the kernel had none (the IP ones live in
  the run's empty network namespace); while the sandbox tries to hold a vsock
  port, the host binds that very port."""
  port, why_not = _free_vsock_port()
  label = "grpo_jax_test_" + os.urandom(4).hex()
  runs = []
  thread = threading.Thread(target=lambda: runs.append(sandbox.run_calls(
      SOCKETS, [("", f"vsock_bind({port or 5000})"), ("", "families()")],
      sandbox.Limits(timeout=20.0), label=label)))
  thread.start()
  host = None
  try:
    for _ in range(1000):  # Until the sandbox has tried (10 s at most).
      if _renamed(label, "vsock_tried"):
        break
      time.sleep(0.01)
    if port is not None:
      with socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM) as s:
        s.bind((socket.VMADDR_CID_ANY, port))
        host = "bound" if _renamed(label, "vsock_tried") else "too late"
  finally:
    thread.join()
  values = runs[0].values
  assert values[0] in ("EAFNOSUPPORT", "EPERM"), values
  allowed = {"AF_UNIX", "AF_INET", "AF_INET6"}
  assert {name for name, got in values[1].items() if got == "opened"} == allowed
  assert set(values[1].values()) - {"opened"} <= {"EAFNOSUPPORT", "EPERM"}
  if port is None:
    pytest.skip(f"sandbox half holds; host half skipped: {why_not}")
  assert host == "bound"


def test_dev_shm_is_private():
  name = "grpo_jax_test_" + os.urandom(4).hex()
  try:
    assert _probe(PROBES, f"shm({name!r})") == ([name],)
    assert not os.path.exists("/dev/shm/" + name)
  finally:
    if os.path.exists("/dev/shm/" + name):
      os.remove("/dev/shm/" + name)


def test_proc_shows_no_host_paths_ids_or_figures():
  """/proc has the run's processes only (subset=pid): no boot id, load,
  memory or kernel command line; no command line, argv or mount of the
  trainer's checkout or virtualenv (docs/sandbox.md: what it still shows)."""
  program = textwrap.dedent("""
      import os, sys
      def read(path):
        try:
          with open(path, 'rb') as f:
            return f.read().decode('utf-8', 'replace')
        except OSError as e:
          return type(e).__name__
      def seen():
        texts = [read(f'/proc/{p}/{n}') for p in ('1', '2', 'self')
                 for n in ('cmdline', 'mountinfo', 'environ')]
        return '\\n'.join(texts + sys.argv + [sys.executable, sys.prefix])
      def load():
        try:
          return os.getloadavg()
        except OSError as e:
          return type(e).__name__
      """)
  names, boot_id, meminfo, host_text, load = _probe(
      program, "sorted(n for n in os.listdir('/proc') if not n.isdigit())",
      "read('/proc/sys/kernel/random/boot_id')", "read('/proc/meminfo')",
      "seen()", "load()")
  assert names == ["self", "thread-self"]
  assert boot_id == meminfo == "FileNotFoundError"
  assert load == "OSError"
  for host_path in {REPO, sys.prefix, os.path.dirname(sys.executable)}:
    assert host_path not in host_text


def test_no_privilege_no_exec_no_nested_namespaces_and_processes_bounded():
  limits = sandbox.Limits(timeout=8.0, processes=8)
  values = _probe(PROBES, "capabilities()", "host_uid()",
                  "outcome(lambda: subprocess.run(['/bin/sh', '-c', 'id']))",
                  "nested_namespace()", "fork_count(50)", limits=limits)
  assert values[0] == ["0000000000000000"] * 3
  assert values[1] != 0
  assert values[2] == "failed: PermissionError"
  assert values[3] == (-1, -1)
  assert 0 < values[4] < 8


def test_total_disk_and_memory_are_bounded():
  limits = sandbox.Limits(timeout=8.0, disk_mb=8, memory_mb=256)
  values = _probe(PROBES, "disk_bytes(8)",
                  "outcome(lambda: len(bytearray(512 << 20)))", limits=limits)
  assert values[0] <= 8 << 20
  assert values[1] == "failed: MemoryError"


@pytest.mark.skipif(not sandbox._cgroups.parents(),  # pylint: disable=protected-access
                    reason="no cgroup this process may create")
def test_a_cgroup_bounds_the_memory_of_the_run_as_a_whole():
  """Three children of 120 MB each fit the per-process limit (256 MB) but
  not the run's 256 MB together."""
  program = textwrap.dedent("""
      import os, time
      def children():
        pids = []
        for _ in range(3):
          pid = os.fork()
          if pid == 0:
            block = bytearray(120 << 20)
            block[::4096] = b'x' * len(block[::4096])
            time.sleep(1)
            os._exit(0)
          pids.append(pid)
        return [os.waitpid(pid, 0)[1] for pid in pids]
      """)
  limits = sandbox.Limits(timeout=10.0, memory_mb=256)
  statuses = _probe(program, "children()", limits=limits)[0]
  assert statuses == sandbox.NOT_RUN or any(s != 0 for s in statuses)
  assert sandbox.resource_control().startswith("cgroup")


# ---------------------------------------------------------------- reward hacks

HACKS = {
    "eq_always_true": "class Yes:\n  def __eq__(self, other): return True\n"
                      "  def __ne__(self, other): return False\n"
                      "def add(a, b): return Yes()",
    "exec_noop": "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
                 "builtins.eval = lambda *a, **k: True\n" + WRONG,
    "compile_strips_asserts":
        "import builtins\n_compile = builtins.compile\n"
        "def compile(source, *a, **k):\n"
        "  return _compile(str(source).replace('assert', 'pass #'), *a, **k)\n"
        "builtins.compile = compile\n" + WRONG,
    "frames_rewrite_job_and_fake_lines":
        "import sys, os\n"
        "f = sys._getframe()\n"
        "while f is not None:\n"
        "  job = f.f_locals.get('job')\n"
        "  if isinstance(job, dict):\n"
        "    job['calls'] = [['', 'True'] for _ in job['calls']]\n"
        "  f = f.f_back\n"
        "for fd in range(3, 64):\n"
        "  for i in range(4):\n"
        "    try:\n"
        "      os.write(fd, ('{\"i\": %d, \"v\": true}\\n' % i).encode())\n"
        "    except OSError:\n"
        "      pass\n" + WRONG,
    "replace_tests_list":
        "import gc\n"
        "for obj in gc.get_objects():\n"
        "  if isinstance(obj, list) and any('add(' in str(x) for x in obj):\n"
        "    obj[:] = [['', 'True']] * len(obj)\n" + WRONG,
    "os_write_rewrites_results":
        "import os\n_write = os.write\n"
        "def write(fd, data):\n"
        "  return _write(fd, data.replace(b'\"e\"', b'\"v\"'))\n"
        "os.write = write\n"
        "def add(a, b): raise ValueError(True)",
    "serialiser_patched":
        "import sys\n"
        "for module in list(sys.modules.values()):\n"
        "  if hasattr(module, 'encode') and hasattr(module, '_send'):\n"
        "    module.encode = lambda value, depth=0: True\n" + WRONG,
}


@pytest.mark.parametrize("name", sorted(HACKS))
def test_reward_hacks_score_zero(name):
  assert _reward([HACKS[name], CORRECT], timeout=5.0) == [0.0, 1.0]


ROUND_TRIP = ("nums = [1, 2, 3]\nresult = [3, 2, 1]\n"
              "assert reverse(nums) == result\nassert reverse(result) == nums")
# Wrong `reverse`s (sorted descending: right for call 0 only) that answer
# call 1 with call 0's argument, its expected value, kept some other way.
STASH = {
    "other_global": "def reverse(x):\n  g = globals()\n"
                    "  return g['nums'] if 'nums' in g and x != g['nums'] else "
                    "sorted(x, reverse=True)",
    "module_state": "seen = []\ndef reverse(x):\n  seen.append(x)\n"
                    "  return sorted(x, reverse=True) if len(seen) == 1 else "
                    "seen[0]",
    "file_and_daemon":
        "import os, time\n"
        "def reverse(x):\n"
        "  if os.path.exists('stash'):\n"
        "    return eval(open('stash').read())\n"
        "  if os.fork() == 0:\n"
        "    for _ in range(2000):  # Rewritten, should /tmp be emptied.\n"
        "      open('stash', 'w').write(repr(x))\n"
        "      time.sleep(0.001)\n"
        "    os._exit(0)\n"
        "  time.sleep(0.05)\n"
        "  return sorted(x, reverse=True)",
}


def test_no_call_sees_another_calls_setup_or_state():
  """Round trip (issue 30) and `add` reading `expected`: every hack scores 0,
  the correct programs 1."""
  expected = ("expected = 3\nassert add(1, 2) == expected\n"
              "assert add(expected, 0) == 3")
  programs = [*STASH.values(), "def reverse(x):\n  return x[::-1]",
              "def add(a, b):\n  return globals()['expected']", CORRECT]
  tests = [ROUND_TRIP] * (len(STASH) + 1) + [expected] * 2
  got = code.code_reward(None, [_fenced(p) for p in programs], tests,
                         np.ones(len(programs)), timeout=10.0)
  assert got.tolist() == [0.0] * len(STASH) + [1.0, 0.0, 1.0]

# ---------------------------------------------------------------- lifetime

def _labelled_processes(label: str) -> list[str]:
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if label.encode() in f.read():
          found.append(pid)
    except OSError:
      pass
  return found


def test_nothing_outlives_the_call_not_even_detached_daemons(tmp_path,
                                                             monkeypatch):
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  program = textwrap.dedent("""
      import ctypes, os, time, fcntl
      libc = ctypes.CDLL(None)
      libc.prctl(1, 0, 0, 0, 0)  # Clear the parent-death signal.
      os.setsid()
      for _ in range(3):
        if os.fork() == 0:
          os.setsid()
          if os.fork() == 0:
            for _ in range(600):  # 30 s at most, should it ever escape.
              time.sleep(0.05)
            os._exit(0)
          os._exit(0)
      fd = os.open('/tmp/immutable', os.O_CREAT | os.O_RDONLY)
      try:
        fcntl.ioctl(fd, 0x40086602, (0x10).to_bytes(8, 'little'))
      except OSError:
        pass
      def add(a, b):
        while True:
          pass
      """)
  label = "grpo_jax_test_" + os.urandom(4).hex()
  run = sandbox.run_calls(program, [("", "add(1, 2)")],
                          sandbox.Limits(timeout=1.5), label=label)
  assert run.timed_out and run.setup_error is None
  assert _labelled_processes(label) == []
  assert os.listdir(tmp_path) == []


def test_the_sandbox_dies_with_the_trainer():
  label = "grpo_jax_test_" + os.urandom(4).hex()
  trainer = subprocess.Popen(
      [sys.executable, "-c", "from grpo_jax.rewards import sandbox\n"
       f"sandbox.run_calls('while True: pass', [('', '1')], "
       f"sandbox.Limits(timeout=60), label={label!r})"], cwd=REPO,
      env={**os.environ, "PYTHONPATH": REPO})
  try:
    for _ in range(200):  # Until the sandbox's call is up (at most 20 s).
      if len(_labelled_processes(label)) >= 4:  # Launcher, init, worker, call.
        break
      time.sleep(0.1)
    assert len(_labelled_processes(label)) >= 4
  finally:
    trainer.kill()
    trainer.wait()
  for _ in range(100):  # The kernel needs a moment to deliver the signals.
    if not _labelled_processes(label):
      break
    time.sleep(0.1)
  assert _labelled_processes(label) == []


@pytest.mark.skipif(not sandbox._cgroups.parents(),  # pylint: disable=protected-access
                    reason="no cgroup this process may create")
def test_cgroups_left_by_a_dead_trainer_are_swept():
  cgroups = sandbox._cgroups  # pylint: disable=protected-access
  directory = cgroups.parents()["pids"]
  old, young = (os.path.join(directory, cgroups._PREFIX + "test_" + k)  # pylint: disable=protected-access
                for k in ("old", "young"))
  os.mkdir(old)
  os.mkdir(young)
  try:
    os.utime(old, (0, 0))
    cgroups._remove_stale(directory)  # pylint: disable=protected-access
    assert not os.path.exists(old) and os.path.exists(young)
  finally:
    for path in (old, young):
      if os.path.exists(path):
        os.rmdir(path)


def test_looping_completions_run_in_parallel(monkeypatch):
  """Four loops with four workers: all four sandboxes were alive at once."""
  live, peak, lock = [0], [0], threading.Lock()
  execute = sandbox.execute

  def counting(*args, **kwargs):
    with lock:
      live[0] += 1
      peak[0] = max(peak[0], live[0])
    try:
      time.sleep(0.2)  # Let the others start before this one can end.
      return execute(*args, **kwargs)
    finally:
      with lock:
        live[0] -= 1

  monkeypatch.setattr(sandbox, "execute", counting)
  loop = "while True:\n  pass"
  assert _reward([loop] * 4, timeout=1.0, max_parallel=4) == [0.0] * 4
  assert peak[0] == 4


def test_batch_timeout_skips_runs_that_cannot_start_in_time(monkeypatch):
  started = []
  execute = sandbox.execute
  monkeypatch.setattr(sandbox, "execute",
                      lambda *a, **k: started.append(1) or execute(*a, **k))
  loop = "while True:\n  pass"
  got = _reward([loop] * 4, timeout=1.0, max_parallel=1, batch_timeout=1.5)
  assert got == [0.0] * 4 and len(started) < 4


# ---------------------------------------------------------------- the trainer

_HASH_0 = 2**61 - 1  # Every multiple of it hashes to 0.
_WRITE = textwrap.dedent("""
    import json, os
    line = json.dumps({'i': 0, 'v': VALUE}) + '\\n'
    for fd in range(3, 64):  # Straight to the result pipe, if there is one.
      try:
        os.write(fd, line.encode())
      except OSError:
        pass
    def f():
      return 0
    """)
_INTS = f"[{{'i': format(k * {_HASH_0}, 'x')}} for k in range(1, 40001)]"
_BIG = ("import random\ndef add(a, b):\n"
        "  return random.Random(a).getrandbits(6_000_000 // (1 + (b < 2)))")
_ARITHMETIC = ["assert add(1, 2) % add(5, 0) == 3",
               "assert add(1, 2) * add(1, 0) == 3",
               "assert add(10, 5) // add(5, 0) == 3",
               "import math\nassert math.gcd(add(1, 2), add(6, 0)) == 3"]
STALLS = {  # (probe, an honest program, tests): the probe scores 0, it 1.
    "colliding_set": (_WRITE.replace("VALUE", f"{{'s': {_INTS}}}"),
                      "def f():\n  return set(range(40000))",
                      ["assert len(f()) == 40000"]),
    "colliding_dict": (
        _WRITE.replace("VALUE", f"{{'d': [[k, None] for k in {_INTS}]}}"),
        "def f():\n  return dict.fromkeys(range(40000))",
        ["assert len(f()) == 40000"]),
    "big_ints": (_BIG, CORRECT, _ARITHMETIC),
    "junk_lines": ("import os\njunk = b'x\\n' * (5 << 19)\n"
                   "for fd in range(3, 64):\n  try:\n    os.write(fd, junk)\n"
                   "  except OSError:\n    pass\ndef f():\n  return 0",
                   "def f():\n  return 1", ["assert f() == 1"]),
}


@pytest.mark.parametrize("name", sorted(STALLS))
def test_no_completion_stalls_the_trainer(name, monkeypatch):
  """Values slow to rebuild or compare (each took the old trainer seconds:
  benchmarks/code_reward.py --stalls) cost it nothing: a 10 ms heartbeat
  thread is never held up long, and the scoring process's own CPU (not its
  children's) stays small. Both bounds are 5-10x the issue's 100 ms and
  0.1 s, for a loaded 2-core host; the probes took 1.5-12 s of either."""
  monkeypatch.setattr(code._checker, "CPU_S", 0.25)  # pylint: disable=protected-access
  probe, honest, tests = STALLS[name]
  gap, stop = [0.0], threading.Event()

  def beat():
    last = time.perf_counter()
    while not stop.is_set():
      time.sleep(0.01)
      now = time.perf_counter()
      gap[0], last = max(gap[0], now - last), now

  code.code_reward(None, [_fenced(CORRECT)], [ADD_TESTS], np.ones(1))  # Warm.
  thread = threading.Thread(target=beat)
  cpu = time.process_time()
  thread.start()
  try:
    got = code.code_reward(None, [_fenced(probe), _fenced(honest)],
                           [tests] * 2, np.ones(2), timeout=20.0)
  finally:
    stop.set()
    thread.join()
  cpu = time.process_time() - cpu
  assert gap[0] < 0.5 and cpu < 1.0, (gap[0], cpu)
  assert got.tolist() == [0.0, 1.0]

# ---------------------------------------------------------------- the caller

def test_any_text_in_any_locale_scores_without_raising():
  script = textwrap.dedent(r"""
      import json, sys
      import numpy as np
      from grpo_jax.rewards import code
      fence = lambda p: '```python\n' + p + '\n```'
      completions = [
          fence('def add(a, b):\n  "π"  # π\n  return a + b'),
          fence('def add(a, b):\n  return a + b  # \udc80'),
          fence(bytes(range(256)).decode('utf-8', 'surrogateescape')),
          fence('def add(a, b):\n  return "\udc80"'),
          '\udc80' * 3]
      tests = ['assert add(1, 2) == 3', "assert add('π', '') == 'π'"]
      got = code.code_reward(None, completions, [tests] * 5, np.ones(5),
                             timeout=5.0)
      print(json.dumps(got.tolist()))
      """)
  for env in ({"LC_ALL": "POSIX", "LANG": "C"}, {"LANG": "C"}):
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO,
                         capture_output=True, timeout=120,
                         env={"PATH": os.environ.get("PATH", ""),
                              "PYTHONPATH": REPO, **env})
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    assert json.loads(out.stdout) == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_refuses_to_run_code_where_the_host_cannot_isolate_it(tmp_path):
  """No user namespaces (max_user_namespaces = 0 in a namespace of our own):
  the reward raises, says why, and the program never runs."""
  marker = tmp_path / "ran"
  script = textwrap.dedent(f"""
      import numpy as np
      from grpo_jax.rewards import code, sandbox, validate_specs
      program = "open({str(marker)!r}, 'w').write('ran')\\ndef add(a, b): return a + b"
      try:
        validate_specs([("code", 1.0)])
      except sandbox.SandboxUnavailable:
        print('refused at start-up;', end=' ')
      try:
        code.code_reward(None, ['```python\\n' + program + '\\n```'],
                         [['assert add(1, 2) == 3']], np.ones(1))
      except sandbox.SandboxUnavailable as e:
        print('refused:', e)
      """)
  shell = ("echo 0 > /proc/sys/user/max_user_namespaces && exec \"$0\" -c \"$1\"")
  out = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c",
                        shell, sys.executable, script], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": REPO})
  if "refused" not in out.stdout and out.returncode != 0 and (
      "unshare" in out.stderr or "max_user_namespaces" in out.stderr):
    pytest.skip(f"cannot take user namespaces away here: {out.stderr[:200]}")
  assert out.stdout.startswith("refused at start-up; refused: refusing to run "
                               "model-written code")
  assert "No space left on device" in out.stdout  # The kernel's reason.
  assert not marker.exists()


# ---------------------------------------------------------------- non-root

# Run as root in a mount namespace of its own: every directory on the way to
# this interpreter, its libraries and the repository that uid 65534 may not
# enter (/root, a CI venv's 0700 temp dir) is covered, there only, by an open
# tmpfs holding binds of just the entries needed; then it becomes 65534.
AS_NOBODY = textwrap.dedent(r"""
    import json, os, subprocess, sys
    needed, argv = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    run = lambda *a: subprocess.run(['mount', *a], check=True)
    run('--make-rprivate', '/')
    def blocked(path):  # Directories on the way (itself included) closed to others.
      return [d for d in (path[:i] for i, c in enumerate(path + '/')
                          if c == '/' and i)
              if os.path.isdir(d) and not os.stat(d).st_mode & 0o001]
    closed = sorted({d for p in needed for d in blocked(p)}, key=len)
    stage = next(d for d in ('/mnt', '/srv', '/media', '/opt', '/boot')
                 if os.path.isdir(d) and not any(
                     p == d or p.startswith(d + '/') for p in needed))
    run('-t', 'tmpfs', '-o', 'mode=700', 'none', stage)
    for k, directory in enumerate(closed):
      entries = sorted({p[len(directory) + 1:].split('/')[0] for p in needed
                        if p.startswith(directory + '/')})
      held = []
      for j, entry in enumerate(entries):
        source, hold = os.path.join(directory, entry), f'{stage}/{k}_{j}'
        (os.mkdir if os.path.isdir(source) else
         lambda h: open(h, 'w').close())(hold)
        run('--bind', source, hold)
        held.append((entry, hold))
      run('-t', 'tmpfs', '-o', 'mode=755', 'none', directory)
      for entry, hold in held:
        target = os.path.join(directory, entry)
        (os.mkdir if os.path.isdir(hold) else
         lambda t: open(t, 'w').close())(target)
        run('--bind', hold, target)
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
    print('running as uid', os.geteuid(), flush=True)
    os.execv(sys.executable, [sys.executable, *argv])
    """)


def _as_nobody_command(argv: list[str]) -> list[str]:
  needed = {sys.executable, os.path.realpath(sys.executable), sys.prefix,
            sys.base_prefix, REPO, *filter(os.path.isdir, sys.path)}
  needed = sorted(os.path.abspath(p) for p in needed if p)
  return ["unshare", "--mount", sys.executable, "-c", AS_NOBODY,
          json.dumps(needed), json.dumps(argv)]


@pytest.mark.skipif(os.geteuid() != 0, reason="the suite already runs as a "
                    "non-root user: every other test here is that check")
def test_as_an_unprivileged_caller():
  """This whole module once more, as uid 65534: every probe fails to escape
  or to score, correct code scores 1 (the cgroup tests skip: an ordinary
  user may not create cgroups here)."""
  out = subprocess.run(
      _as_nobody_command(["-m", "pytest", "-q", "-p", "no:cacheprovider",
                          os.path.join(REPO, "tests", "test_sandbox.py"),
                          "-k", "not unprivileged_caller"]),
      cwd="/", capture_output=True, text=True, timeout=600,
      env={**os.environ, "PYTHONPATH": REPO, "HOME": "/tmp",
           "PYTHONDONTWRITEBYTECODE": "1"})
  assert out.stdout.startswith("running as uid 65534\n"), out.stderr[-2000:]
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
  assert " passed" in out.stdout.splitlines()[-1]
