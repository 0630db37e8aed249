"""Issue 45, item 4: a code test's expected side is never computed where the model's code runs.

Each wrong program below rewrites, inside the sandbox, what the expected side
of its test would compute there (`range`, `sorted`, `math.factorial`,
`str.upper`, `list`): before issue 45 each scored 1.0, because the expected
side was a leaf evaluated in the program's own process. The checker now
evaluates it (`_trusted.py`), so each scores 0, and the right program 1. A
test whose expected side the checker cannot evaluate is refused when the data
is loaded (`code.check_tests`), naming the test.
"""
from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from configs import tiny
from grpo_jax import errors
from grpo_jax.harness import experiment
from grpo_jax.rewards import _code_checks, code, sandbox

QUICK = sandbox.Limits(timeout=5.0)
_PATCH = "import builtins, math\n"
# (test, right program, wrong program that rewrites the expected side in the sandbox)
CASES = [
    ("assert squares(4) == [i * i for i in range(4)]",
     "def squares(n):\n  return [i * i for i in range(n)]",
     _PATCH + "builtins.range = lambda *a: iter([7, 7, 7])\n"
     "def squares(n):\n  return [49, 49, 49]"),
    ("assert count(3) == list(range(3))",
     "def count(n):\n  return list(range(n))",
     _PATCH + "builtins.range = lambda *a: [9]\ndef count(n):\n  return [9]"),
    ("assert order([3, 1, 2]) == sorted([3, 1, 2], key=lambda v: -v)",
     "def order(xs):\n  return sorted(xs, reverse=True)",
     _PATCH + "builtins.sorted = lambda *a, **k: [0]\ndef order(xs):\n  return [0]"),
    ("assert fact() == math.factorial(5)",
     "def fact():\n  return 120",
     _PATCH + "math.factorial = lambda n: 1\ndef fact():\n  return 1"),
    ("assert shout('hi') == 'hi'.upper()",
     "def shout(s):\n  return s.upper()",
     "class S(str):\n  def upper(self):\n    return 'no'\n"
     "import builtins\nbuiltins.str = S\ndef shout(s):\n  return 'no'"),
    ("from collections import Counter\nassert tally('aab') == Counter('aab')",
     "from collections import Counter\ndef tally(s):\n  return Counter(s)",
     "import collections\ncollections.Counter = lambda s: {'z': 1}\n"
     "def tally(s):\n  return {'z': 1}"),
]


def _fenced(program: str) -> str:
  return f"```python\n{program}\n```"


@pytest.mark.parametrize("test,right,wrong", CASES, ids=[c[0][:30] for c in CASES])
def test_expected_side_is_evaluated_by_the_checker(test, right, wrong):
  assert code.run_tests(right, [test], QUICK).passed == 1
  assert code.run_tests(wrong, [test], QUICK).passed == 0


def test_the_sandbox_never_receives_the_expected_side():
  for test, _, _ in CASES:
    calls = _code_checks.parse(test).calls
    assert all("range" not in leaf and "sorted" not in leaf and "factorial" not in leaf
               and "upper" not in leaf and "Counter" not in leaf for _, leaf in calls), calls


@pytest.mark.parametrize("test", [
    "import numpy as np\nassert f() == np.zeros(3)",
    "import numpy as np\nexpected = np.zeros(3)\nassert f() == expected",
    "assert f() == 'a'.__class__",
    "assert f() == math.frexp(2.0)",
])
def test_an_unevaluable_expected_side_is_refused_at_load_naming_the_test(test):
  with pytest.raises(code.UnevaluableTest, match="code test refused") as refused:
    code.check_tests([[test, "assert f() == 1"]])
  assert repr(test)[:40].strip("'") in str(refused.value) or "f()" in str(refused.value)
  with pytest.raises(code.UnevaluableTest):
    code.code_reward(None, [_fenced("def f():\n  return 1")], [test], np.ones(1))


def test_model_side_calls_still_go_to_the_sandbox():
  test = _code_checks.parse("assert sorted(f(3), key=lambda v: -v) == [2, 1, 0]")
  assert len(test.calls) == 1 and "f(3)" in test.calls[0][1]
  code.check_tests([["assert f(1) == 1", {"input": "1\n", "output": "1\n"}]])


_SHARED_INODES = """
import ctypes, errno, fcntl, os
def probe():
  libc = ctypes.CDLL(None, use_errno=True)
  out = []
  try:
    os.memfd_create('x')
    out.append('memfd')
  except OSError as e:
    out.append(e.errno)
  with open('/tmp/f', 'w') as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX)
      out.append('flock')
    except OSError as e:
      out.append(e.errno)
  out.append(libc.inotify_init() if libc.inotify_init() >= 0 else -ctypes.get_errno())
  out.append(libc.fanotify_init(0, 0) if libc.fanotify_init(0, 0) >= 0 else -ctypes.get_errno())
  return out
"""


def test_flock_inotify_fanotify_and_memfd_are_refused_by_the_filter():
  """Issue 45, item 5: each fails with EPERM inside the sandbox (x86_64)."""
  run = sandbox.run_calls(_SHARED_INODES, [("", "probe()")], QUICK)
  eperm = 1
  assert run.values[0] == [eperm, eperm, -eperm, -eperm], run


_LEAK = r"""
import gc, re, sys
def leak():
  found, pattern = set(), re.compile('tok_[a-z0-9]{16}')
  def scan(obj, depth=0):
    if isinstance(obj, str):
      found.update(pattern.findall(obj))
    elif isinstance(obj, (bytes, bytearray)):
      found.update(m.decode() for m in re.findall(rb'tok_[a-z0-9]{16}', obj))
    elif depth < 6 and isinstance(obj, dict):
      for value in list(obj.values()):
        scan(value, depth + 1)
    elif depth < 6 and isinstance(obj, (list, tuple)):
      for value in obj:
        scan(value, depth + 1)
  for obj in gc.get_objects():
    scan(obj)
  frame = sys._getframe()
  while frame is not None:  # The frames this child was forked inside.
    scan(frame.f_locals)
    frame = frame.f_back
  return sorted(found)
if __name__ == '__main__':
  sys.stdin.read()
  print(leak())
"""


def test_each_call_starts_from_a_zygote_that_never_held_another_calls_input():
  """Issue 45, item 4: a child reads only its own call (or stdin) from the
  job pipe; the process it is forked from never read any. A program that
  scans every object and frame it inherited finds no other call's setup and
  no other stdin (raw memory, /proc/self/mem, is closed: not dumpable)."""
  import secrets  # pylint: disable=import-outside-toplevel
  tokens = [f"tok_{secrets.token_hex(8)}" for _ in range(3)]
  run = sandbox.run_calls(_LEAK, [("", "leak()"), (f"t = {tokens[0]!r}", "len(t)")], QUICK,
                          stdin=["first", tokens[1]])
  assert run.values[1] == len(tokens[0]), run
  assert not set(tokens) & set(run.values[0]), run.values[0]
  assert tokens[1] not in run.outputs[0], run.outputs[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="already an unprivileged caller")
def test_as_an_unprivileged_caller():
  """This module once more as uid 65534 (test_sandbox.py's mechanism)."""
  from tests import test_sandbox  # pylint: disable=import-outside-toplevel
  out = subprocess.run(
      test_sandbox._as_nobody_command(["-m", "pytest", "-q", "-p", "no:cacheprovider",  # pylint: disable=protected-access
                                       os.path.abspath(__file__), "-k", "not unprivileged_caller"]),
      cwd="/", capture_output=True, text=True, timeout=600,
      env={**os.environ, "PYTHONPATH": test_sandbox.REPO, "HOME": "/tmp",
           "PYTHONDONTWRITEBYTECODE": "1"})
  assert out.stdout.startswith("running as uid 65534\n"), out.stderr[-2000:]
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_a_run_is_bounded_to_its_cores_where_a_cgroup_cpu_controller_exists():
  """Issue 45, item 5: cpu.max (v2) or cfs_quota_us (v1) = `cpus` cores per run;
  where no CPU controller is delegated the documented fallback is rlimits only."""
  from grpo_jax.rewards import _cgroups, _checker  # pylint: disable=import-outside-toplevel
  assert _checker.MAX_CHECKERS >= (os.cpu_count() or 1)
  if "cpu" not in _cgroups.parents():
    pytest.skip(f"no cgroup CPU controller here: {_cgroups.describe()}")
  run = _cgroups.RunCgroup(2**30, 20, cpus=1.5)
  try:
    assert run.error is None, run.error
    cpu = next(d for d in run.dirs if d.startswith(_cgroups.parents()["cpu"]))
    if os.path.exists(os.path.join(cpu, "cpu.max")):
      assert open(os.path.join(cpu, "cpu.max"), encoding="ascii").read().split() == ["150000", "100000"]
    else:
      assert open(os.path.join(cpu, "cpu.cfs_quota_us"), encoding="ascii").read().strip() == "150000"
  finally:
    run.close()
  assert "CPU" in _cgroups.describe()


_PACKAGES = """
import glob, os, sys
def installed():
  dirs = [os.path.join(p, s) for p in sys.path + glob.glob('/usr/lib/python3*')
          + glob.glob('/usr/local/lib/python3*') for s in ('site-packages', 'dist-packages')]
  return sorted((d, len(os.listdir(d))) for d in set(dirs) if os.path.isdir(d))
"""


def test_the_standard_library_is_bound_without_installed_packages():
  """Issue 45, item 5: every site-packages / dist-packages the sandbox can
  reach is an empty directory (the interpreter's own included)."""
  run = sandbox.run_calls(_PACKAGES, [("", "installed()")], QUICK)
  assert run.values[0] and all(count == 0 for _, count in run.values[0]), run


def test_an_unevaluable_test_in_the_data_is_refused_when_it_loads_naming_the_example(tmp_path):
  rows = [{"question": "Write f.", "answer": "assert f() == 1"},
          {"question": "Write f.", "answer": "import numpy as np\nassert f() == np.zeros(3)"}]
  path = tmp_path / "code.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  config = tiny.get_config()
  config.rewards = {"code": 1.0}
  config.data.source = "jsonl"
  config.data.kwargs = dict(path=str(path), layout="question_answer")
  config.data.eval_kwargs = dict(path=str(path), layout="question_answer")
  with pytest.raises(errors.DataError, match=r"example 1 of data.source = 'jsonl': code test refused"):
    experiment.load_examples(config)
  config.rewards = {"last_number": 1.0}   # no code reward: the tests are not read
  assert len(experiment.load_examples(config)[0]) == 2
