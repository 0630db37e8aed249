"""Fixtures shared by the test files."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The test files that take longest, longest first (seconds of one
# `--durations=0` run of the default suite with -n 2 on 2 busy cores,
# 2026-12-01; only the order matters). xdist gives each worker one whole
# file at a time (`--dist loadfile`, pyproject.toml); handing these out
# first and the many short files last keeps both workers busy to the end
# (longest-processing-time-first). Left to xdist, files with the most tests
# go first, so a 1-test file of several minutes (test_resume.py) came last
# and one worker finished alone.
LONGEST_FILES = (
    "test_blockwise.py", "test_resume.py", "test_notebooks.py",
    "test_sharding.py", "test_bad_input.py", "test_process.py",
    "test_multiprocess.py", "test_train.py", "test_continuous.py",
    "test_loading.py", "test_policy_losses.py", "test_lora.py",
    "test_sampling.py", "test_paged.py", "test_aot.py")


def pytest_xdist_make_scheduler(config, log):
  """xdist's file scheduler, mended so that a crashed worker cannot stall the
  run (pytest-xdist 3.8.0).

  xdist keeps every file it ever gave a worker in `assigned_work`, finished
  ones included, and when the worker dies it puts all of them back in the
  queue. A finished file handed out again sends the next worker no tests;
  nothing then completes to ask for more work, the workers wait for a
  shutdown that never comes, and the run hangs until CI's time limit (a
  worker that aborted inside XLA at 78% of one CI run left it stalled at 99%
  for over an hour). Here only files with tests left go back: the crashed
  test is reported failed and run again, the rest of its file and the files
  queued for that worker run on the replacement, and the run ends
  (tests/test_xdist_crash.py)."""
  if config.getoption("dist", None) != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=import-outside-toplevel

  class _LoadFileScheduling(LoadFileScheduling):

    def remove_node(self, node):
      work = self.assigned_work.get(node, {})
      for scope in [s for s, unit in work.items() if all(unit.values())]:
        del work[scope]
      return super().remove_node(node)

  return _LoadFileScheduling(config, log)


def pytest_collection_modifyitems(items):
  """Files in LONGEST_FILES order first, the rest as collected (a stable
  sort: the tests inside a file keep their order)."""
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _run_sharding_checks(script: str, meshes, timeout: int = 1200) -> None:
  """Runs tests/<script> (a `*_sharding_checks.py` script) on 8 fake CPU
  devices in a subprocess (the device count is fixed before JAX starts)
  and fails unless it reports every mesh in `meshes` ("data,fsdp,tensor"
  strings), in order, each ok. The limit is generous: the 8-device Gemma
  check passes in about 5 min alone and took over 10 at load 8."""
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tests", script), *meshes],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
      check=False)
  results = [json.loads(line) for line in proc.stdout.splitlines()
             if line.startswith("{")]
  assert [r["mesh"] for r in results] == [
      [int(v) for v in m.split(",")] for m in meshes], proc.stderr[-4000:]
  for r in results:
    assert r["ok"], r["error"]
  assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture
def run_sharding_checks():
  """`_run_sharding_checks`: (script, meshes) -> None, failing the test."""
  return _run_sharding_checks
