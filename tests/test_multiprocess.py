"""Two CPU processes joined by jax.distributed train like one process.

tests/multiprocess_worker.py runs configs/tiny.py for 2 steps three times at
once: alone (1 process, 1 device) and as processes 0 and 1 of a 2-process
run on 127.0.0.1 (1 device each, mesh data=2: each host feeds its half of
every batch, gradients are all-reduced across processes with gloo; the
sampler's rows are split over the two processes and gathered for the
rewards). The last step's loss, the rewards and the final parameters must
agree, and the shared workdir's metrics are written once (by process 0).
Bounded in time; every process is killed on failure.
"""
import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from grpo_jax.harness import metrics
from grpo_jax.models import get_preset, init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
TIMEOUT_S = 480


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(tmp_path, name: str, args: list, devices: int = 1
           ) -> subprocess.Popen:
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS",
                      "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  if devices > 1:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  with open(tmp_path / f"{name}.log", "w", encoding="utf-8") as log:
    return subprocess.Popen(
        [sys.executable, WORKER, *map(str, args[:4]),
         str(tmp_path / f"{name}.npz"), *map(str, args[4:])],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)


def _wait_all(procs: dict, tmp_path) -> dict:
  """{name: last JSON line} once all exit 0; raises on error or timeout."""
  deadline = time.monotonic() + TIMEOUT_S
  out = {}
  for name, proc in procs.items():
    try:
      stdout, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
      pytest.fail(f"{name} still running after {TIMEOUT_S}s")
    log = (tmp_path / f"{name}.log").read_text(encoding="utf-8")
    assert proc.returncode == 0, (
        f"{name} exited {proc.returncode}:\n{log[-4000:]}")
    out[name] = json.loads([l for l in stdout.splitlines()
                            if l.startswith("{")][-1])
  return out


def _single_and_pair(tmp_path, extra=(), devices=(1, 1)):
  """Starts the one-process run ("single", devices[0] devices) and the
  two-process pair ("p0", "p1", devices[1] each) at once; returns their last
  JSON lines, final parameters and tmp_path. Kills them all on failure."""
  port = _free_port()
  procs = {}
  try:
    procs["single"] = _start(tmp_path, "single",
                             [tmp_path / "single", 1, 0, 0, *extra],
                             devices[0])
    for pid in (0, 1):
      procs[f"p{pid}"] = _start(tmp_path, f"p{pid}",
                                [tmp_path / "pair", 2, pid, port, *extra],
                                devices[1])
    results = _wait_all(procs, tmp_path)
  finally:
    for proc in procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
  params = {name: dict(np.load(tmp_path / f"{name}.npz")) for name in procs}
  return results, params, tmp_path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  return _single_and_pair(tmp_path_factory.mktemp("multiprocess"))


def test_two_processes_form_one_two_device_mesh(runs):
  results, _, _ = runs
  assert results["single"]["processes"] == 1
  assert results["single"]["devices"] == 1
  for name in ("p0", "p1"):
    assert results[name]["processes"] == 2 and results[name]["devices"] == 2
  assert {results["p0"]["process"], results["p1"]["process"]} == {0, 1}


def test_two_processes_train_like_one(runs):
  results, params, _ = runs
  single = results["single"]
  assert abs(single["loss"]) > 1e-5, single   # a loss worth comparing
  for name in ("p0", "p1"):
    assert results[name]["reward"] == single["reward"]   # same samples
    np.testing.assert_allclose(results[name]["loss"], single["loss"],
                               rtol=1e-4, atol=1e-7)
    assert params[name].keys() == params["single"].keys()
    for leaf, want in params["single"].items():
      np.testing.assert_allclose(params[name][leaf], want, rtol=1e-5,
                                 atol=1e-6, err_msg=f"{name} {leaf}")


def test_training_moved_the_parameters(runs):
  _, params, _ = runs
  init = init_params(get_preset("tiny"), jax.random.key(0))
  moved = max(float(np.abs(params["single"]["['embed']"]
                           - np.asarray(init["embed"])).max()),
              float(np.abs(params["single"]["['layers']['wq']"]
                           - np.asarray(init["layers"]["wq"])).max()))
  assert moved > 1e-4, moved


def test_only_process_zero_writes_the_metrics(runs):
  """Both processes share the workdir: each step's row appears once (two
  writers would append every row twice)."""
  _, _, tmp_path = runs
  steps = lambda d: [r["step"] for r in metrics.read_jsonl(
      tmp_path / d / "metrics.jsonl")]
  assert steps("pair") == steps("single") == [1, 2]


def _assert_k1_pair_like_single(results, params, tmp_path):
  """A k = 1 pair's metrics show one stale step, and both processes end
  with the single process's samples, loss and parameters."""
  rows = metrics.read_jsonl(tmp_path / "pair" / "metrics.jsonl")
  assert [r["staleness/max"] for r in rows] == [0, 1]
  single = results["single"]
  for name in ("p0", "p1"):
    assert results[name]["reward"] == single["reward"]   # same samples
    np.testing.assert_allclose(results[name]["loss"], single["loss"],
                               rtol=1e-4, atol=1e-7)
    for leaf, want in params["single"].items():
      np.testing.assert_allclose(params[name][leaf], want, rtol=1e-5,
                                 atol=1e-6, err_msg=f"{name} {leaf}")


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory):
  """k = 1 on a split: one process with 4 devices (2 train, 2 sample)
  against two processes with 2 each (on each host 1 trains, 1 samples):
  the same mesh shapes on both sides."""
  return _single_and_pair(tmp_path_factory.mktemp("multiprocess_async"),
                          ("async",), devices=(4, 2))


@pytest.mark.slow
def test_two_processes_train_asynchronously_like_one(async_runs):
  results, params, tmp_path = async_runs
  assert results["single"]["devices"] == 4
  assert results["p0"]["devices"] == results["p1"]["devices"] == 4
  _assert_k1_pair_like_single(results, params, tmp_path)


@pytest.fixture(scope="module")
def uneven_runs(tmp_path_factory):
  """k = 1 with rollout.sampler_devices = 3 on two hosts of 3 devices: the
  hosts give 2 and 1 (weight_sync.host_shares), against one process of 6
  devices giving 3: the same mesh shapes (3 + 3)."""
  return _single_and_pair(tmp_path_factory.mktemp("multiprocess_uneven"),
                          ("async3",), devices=(6, 3))


@pytest.mark.slow
def test_uneven_host_shares_train_like_one_process(uneven_runs):
  results, params, tmp_path = uneven_runs
  assert results["p0"]["devices"] == results["p1"]["devices"] == 6
  _assert_k1_pair_like_single(results, params, tmp_path)
