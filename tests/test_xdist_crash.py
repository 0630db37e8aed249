"""A worker that dies mid-run fails its test and the run still ends.

tests/conftest.py mends xdist's file scheduler (`pytest_xdist_make_scheduler`):
unmended, a worker crash after it had finished a file stalls the run until
the time limit. This runs a small suite in a subprocess with two workers,
`--dist loadfile` as the README command has it, where one test aborts its
worker the first time it runs.
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFTEST = f"""
import importlib.util
_spec = importlib.util.spec_from_file_location(
    "grpo_jax_tests_conftest", {os.path.join(ROOT, "tests", "conftest.py")!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
pytest_xdist_make_scheduler = _module.pytest_xdist_make_scheduler
"""

CRASHING = """
import os
def test_1(): pass
def test_2():
  if not os.path.exists({marker!r}):
    open({marker!r}, "w").close()
    os.abort()
def test_3(): pass
"""


def test_a_crashed_worker_fails_its_test_and_the_run_ends(tmp_path):
  suite = tmp_path / "suite"
  suite.mkdir()
  (suite / "conftest.py").write_text(CONFTEST)
  for i in range(12):
    (suite / f"test_f{i:02d}.py").write_text(
        "def test_1(): pass\ndef test_2(): pass\ndef test_3(): pass\n")
  # The 9th file: both workers have finished files by the time it runs.
  (suite / "test_f08.py").write_text(
      CRASHING.format(marker=str(tmp_path / "crashed")))
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
       "--no-loadscope-reorder", "-p", "no:cacheprovider", "-m", "",
       str(suite)],
      cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
      env={**os.environ, "PYTHONFAULTHANDLER": ""})
  summary = proc.stdout.strip().splitlines()[-1]
  assert proc.returncode == 1, proc.stdout[-3000:]
  # 36 tests; the crashed one reported failed and then run again.
  assert "1 failed, 36 passed" in summary, proc.stdout[-3000:]
  assert "FAILED suite/test_f08.py::test_2 - worker" in proc.stdout
