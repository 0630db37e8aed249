"""Fixtures shared by the test files."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_sharding_checks(script: str, meshes, timeout: int = 600) -> None:
  """Runs tests/<script> (a `*_sharding_checks.py` script) on 8 fake CPU
  devices in a subprocess (the device count is fixed before JAX starts)
  and fails unless it reports every mesh in `meshes` ("data,fsdp,tensor"
  strings), in order, each ok."""
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
