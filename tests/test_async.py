"""Asynchronous rollouts (rl/async_rollouts.py): the schedule, the weight
sync, failures, and k = 0 against the synchronous loop bit for bit."""
import json
import os
import subprocess
import sys
import threading
import types

import async_checks
import jax
import numpy as np
import pytest

from grpo_jax import checkpoint, sharding, validation
from grpo_jax.errors import ConfigError
from grpo_jax.generate import rollout
from grpo_jax.harness import metrics as metrics_lib
from grpo_jax.models import get_preset, init_params
from grpo_jax.rl import async_rollouts, train, weight_sync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _settings(k, n=1, **kw):
  return async_rollouts.RolloutSettings(max_staleness=k, sync_every=n, **kw)


@pytest.mark.parametrize("k,n,want", [
    (0, 1, [0, 1, 2, 3, 4, 5]), (1, 1, [0, 0, 1, 2, 3, 4]),
    (2, 1, [0, 0, 0, 1, 2, 3]), (1, 2, [0, 0, 2, 2, 4, 4]),
    (3, 2, [0, 0, 0, 0, 2, 2])])
def test_schedule_uses_the_staleness_bound(k, n, want):
  s = _settings(k, n)
  assert [s.version(u) for u in range(6)] == want
  assert all(0 <= u - v <= k for u, v in enumerate(want))
  # the steps a checkpoint of version 2 keeps: sampled before version 2
  last = s.last_below(2, 6)
  assert [u for u in range(2, 6) if want[u] < 2] == list(range(2, last + 1))


def test_rollout_fields_are_checked_at_start():
  c = async_checks.config()
  c.rollout.sync_every = 2
  with pytest.raises(ConfigError, match="'rollout.sync_every' = 2"):
    validation.validate(c)
  c = async_checks.config()
  c.rollout.max_staleness = 1    # stale rows, no correction: refused
  with pytest.raises(ConfigError, match="rollout.max_staleness.*old_logp="
                     "recompute"):
    validation.validate(c)
  validation.validate(async_checks.stale(async_checks.config()))
  c.rollout.sampler_devices = -1
  with pytest.raises(ConfigError, match="'rollout.sampler_devices' = -1"):
    validation.validate(c)


def test_each_host_gives_its_last_devices_to_the_sampler():
  devices = [types.SimpleNamespace(id=i, process_index=i // 4)
             for i in range(8)]
  train_d, sample_d = weight_sync.split_devices(
      _settings(0, sampler_devices=2), devices)
  assert [d.id for d in train_d] == [0, 1, 2, 4, 5, 6]
  assert [d.id for d in sample_d] == [3, 7]
  # Hosts that do not divide it: the first host gives one more.
  train_d, sample_d = weight_sync.split_devices(
      _settings(0, sampler_devices=3), devices)
  assert [d.id for d in train_d] == [0, 1, 4, 5, 6]
  assert [d.id for d in sample_d] == [2, 3, 7]
  for bad in (1, 7, 8):   # a host with no sampler or no trainer device
    with pytest.raises(ConfigError, match="'rollout.sampler_devices'"):
      weight_sync.split_devices(_settings(0, sampler_devices=bad), devices)


def test_the_sampler_mesh_defaults_to_the_trainers():
  """rollout.sampler_mesh = () (the default) is mesh.shape: a 32B config's
  sampler split FSDP x tensor like its trainer, not replicated per chip."""
  c = async_checks.config()
  c.mesh.shape = (-1, 2, 2)
  assert async_rollouts.RolloutSettings.from_config(c).sampler_mesh == (
      -1, 2, 2)
  c.rollout.sampler_mesh = (-1, 1, 4)
  assert async_rollouts.RolloutSettings.from_config(c).sampler_mesh == (
      -1, 1, 4)
  c.rollout.sampler_mesh = (-1, 4)
  with pytest.raises(ConfigError, match="'rollout.sampler_mesh' = "):
    validation.validate(c)


def test_stale_rows_on_several_hosts_need_a_split(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ConfigError, match="'rollout.max_staleness' = 1 on 2 "
                     "processes needs rollout.sampler_devices > 0"):
    weight_sync.split_devices(_settings(1), [])


def test_a_batch_survives_the_host_state_bit_for_bit():
  rng = np.random.default_rng(0)
  prompts = np.empty((2,), object)
  prompts[:] = [(5, 6, 7), (8,)]
  groups = rollout.Groups(
      prompts, rng.integers(0, 256, (2, 3, 4)).astype(np.int32),
      rng.standard_normal((2, 3, 4)).astype(np.float32),
      rng.random((2, 3, 4)) > 0.5, np.array([[1, 2, 3], [4, 4, 0]], np.int32),
      np.zeros((2, 3), bool), rng.random((2, 3)).astype(np.float32),
      np.ones((2, 3), bool))
  batch = async_rollouts.Batch(3, 2, groups, {"reward/mean": 0.1 + 0.2},
                               {"position": 7}, np.arange(2, dtype=np.uint32))
  back = async_rollouts.decode(checkpoint.integrity.to_json(
      async_rollouts.encode(batch), "host_state"))
  assert (back.step, back.version, back.metrics, back.data_after) == (
      3, 2, batch.metrics, batch.data_after)
  for a, b in zip(batch.groups, back.groups):
    if a is None:   # an optional field (observation_bgt without an env)
      assert b is None
      continue
    assert a.dtype == b.dtype and a.shape == b.shape
    assert all(x == y for x, y in zip(a.ravel(), b.ravel()))


def _sync(store):
  c = async_checks.config()
  model_config = get_preset("tiny")
  layout = sharding.Layout(sharding.make_mesh(c.mesh),
                           sharding.logical_rules(c.mesh))
  return weight_sync.WeightSync(
      (c.sampling.compute_dtype or c.model.compute_dtype, ""), model_config,
      layout,
      store, None, None)


def test_a_failed_sync_never_reaches_the_sampler(monkeypatch):
  """A copy that fails part-way (here the third leaf): the sampler keeps
  the version it had, whole; the run gets a SamplerError naming the
  version."""
  store = weight_sync.WeightStore()
  sync = _sync(store)
  params = init_params(get_preset("tiny"), jax.random.key(0))
  metrics = sync.publish(0, params)
  assert metrics["sync/bytes"] == sum(x.nbytes for x in jax.tree.leaves(params))
  before = [np.asarray(x) for x in jax.tree.leaves(store.get(0))]
  real, calls = weight_sync._put, []

  def failing_put(x, s):
    calls.append(1)
    if len(calls) == 3:
      raise RuntimeError("link down")
    return real(x, s)

  monkeypatch.setattr(weight_sync, "_put", failing_put)
  newer = jax.tree.map(lambda x: x + 1, params)
  rollouts = async_rollouts.Threaded.__new__(async_rollouts.Threaded)
  rollouts.settings, rollouts.steps = _settings(0), 4
  rollouts._start, rollouts._sync, rollouts._store = 0, sync, store
  with pytest.raises(async_rollouts.SamplerError,
                     match=r"weight sync of policy version 1 .*link down.*"
                     r"kept version\(s\) \[0\]"):
    rollouts.publish(1, newer)
  assert store.versions() == [0]
  for a, b in zip(before, jax.tree.leaves(store.get(0))):
    np.testing.assert_array_equal(a, b)


def _rows_params(workdir, summary):
  return (async_checks.run_metrics(workdir),
          async_checks.leaves(summary["state"].params))


@pytest.mark.slow   # two training runs (~50 s of CPU)
def test_k0_sampler_thread_equals_the_synchronous_loop(tmp_path, monkeypatch):
  """Colocated, k = 0: the sampler thread, its weight copies and the
  published versions give the synchronous loop's metrics and parameters bit
  for bit (dynamic sampling and KL on)."""
  sync_rows, sync_params = _rows_params(
      tmp_path / "sync", train.run(async_checks.config(), str(tmp_path / "sync")))
  monkeypatch.setattr(async_rollouts, "use_thread", lambda settings: True)
  rows, params = _rows_params(
      tmp_path / "thread",
      train.run(async_checks.config(), str(tmp_path / "thread")))
  assert any(r["dynamic/num_gen_batches"] > 1 for r in sync_rows)  # refills
  assert async_checks.without_async_keys(rows) == sync_rows
  assert [r["staleness/max"] for r in rows] == [0, 0, 0]
  assert all(r["staleness/rows_0"] == 8 for r in rows)
  assert sync_params.keys() == params.keys()
  for name, want in sync_params.items():
    np.testing.assert_array_equal(params[name], want, err_msg=name)


@pytest.mark.slow
def test_k1_trains_on_rows_one_version_old(tmp_path):
  summary = train.run(async_checks.stale(async_checks.config(steps=4)),
                      str(tmp_path))
  rows = async_checks.run_metrics(tmp_path)
  assert [r["rollout/version"] for r in rows] == [0, 0, 1, 2]
  assert [r["staleness/max"] for r in rows] == [0, 1, 1, 1]
  assert [r["staleness/rows_1"] for r in rows] == [0, 8, 8, 8]
  assert all(np.isfinite(r["loss"]) for r in rows)
  timed = metrics_lib.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert all(0 <= r[f"time/{side}_idle_fraction"] <= 1 for r in timed
             if "loss" in r for side in ("sampler", "trainer"))
  # π_old (recomputed) differs from the stale sampler's log-probs
  assert rows[0]["rollout_kl/k3"] < 1e-6 < rows[2]["rollout_kl/k3"]
  init = init_params(get_preset("tiny"), jax.random.key(0))
  moved = np.abs(np.asarray(summary["state"].params["embed"])
                 - np.asarray(init["embed"])).max()
  assert moved > 1e-4


@pytest.mark.slow
def test_k1_with_lora_syncs_only_the_adapters(tmp_path):
  c = async_checks.stale(async_checks.config(steps=3))
  c.model.lora.rank = 4
  summary = train.run(c, str(tmp_path))
  rows = async_checks.run_metrics(tmp_path)
  adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(summary["state"].params))
  assert rows[0]["sync/bytes"] == adapter_bytes   # version 1, after step 1
  assert adapter_bytes < sum(x.nbytes for x in jax.tree.leaves(summary["base"]))
  assert [r["staleness/max"] for r in rows] == [0, 1, 1]
  assert all(np.isfinite(r["loss"]) for r in rows)


def _failing_sampler(monkeypatch, fail_at: int, how):
  """train.sample_step that runs `how` on its `fail_at`-th call."""
  real, calls = train.sample_step, []

  def sample_step(*args, **kwargs):
    calls.append(1)
    if len(calls) == fail_at:
      how()
    return real(*args, **kwargs)

  monkeypatch.setattr(train, "sample_step", sample_step)


def _raise():
  raise ValueError("verifier pool died")


@pytest.mark.slow
def test_a_sampler_that_raises_stops_the_run_with_the_last_update_saved(
    tmp_path, monkeypatch):
  _failing_sampler(monkeypatch, 3, _raise)   # step 3's rows (k = 1)
  c = async_checks.stale(async_checks.config(steps=4))
  with pytest.raises(async_rollouts.SamplerError,
                     match=r"the sampler failed on step 3 \(ValueError: "
                           r"verifier pool died\)"):
    train.run(c, str(tmp_path))
  # updates 1 and 2 completed (step 3 waits for the failed rows)
  assert checkpoint.finalized_steps(checkpoint.checkpoint_dir(
      str(tmp_path))) == [2]
  # and the same command resumes from there, sampling step 3 afresh
  summary = train.run(c, str(tmp_path))
  assert int(summary["state"].step) == 4 * 2   # two mini-batches a step
  rows = async_checks.run_metrics(tmp_path)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert [r["rollout/version"] for r in rows] == [0, 0, 2, 2]


def test_a_hung_sampler_stops_the_run(tmp_path, monkeypatch):
  """A sampler with no rows for rollout.timeout_s (here its first batch
  never returns) stops the run naming the step; nothing is saved, as no
  update completed."""
  release = threading.Event()

  def hang():
    release.wait(60)
    _raise()   # once released, the thread ends

  _failing_sampler(monkeypatch, 1, hang)
  c = async_checks.stale(async_checks.config(steps=2))
  c.rollout.timeout_s = 2.0
  try:
    with pytest.raises(async_rollouts.SamplerError,
                       match=r"the sampler is hung: no rows for step 1 within "
                             r"rollout.timeout_s = 2 s"):
      train.run(c, str(tmp_path))
  finally:
    release.set()
  assert checkpoint.finalized_steps(checkpoint.checkpoint_dir(
      str(tmp_path))) == []


def _check_run(tmp_path, name, devices, *fields):
  out = tmp_path / f"{name}.npz"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "tests", "async_checks.py"),
       str(devices), str(tmp_path / name), str(out), *fields],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  saved = dict(np.load(out))
  assert int(saved.pop("devices")) == devices
  return json.loads(str(saved.pop("metrics"))), saved


@pytest.mark.slow
def test_k0_split_over_4_plus_4_devices_equals_the_synchronous_loop(tmp_path):
  """8 fake CPU devices, the last 4 sampling: bit-identical to the
  synchronous loop on 4 devices (each side runs the same 4-device programs).
  Against the synchronous loop on all 8 the bits differ (other matmul and
  all-reduce shapes), by float32 rounding only."""
  sync_rows, sync_params = _check_run(tmp_path, "sync4", 4)
  rows, params = _check_run(tmp_path, "split", 8, "rollout.sampler_devices=4")
  assert async_checks.without_async_keys(rows) == sync_rows
  for name, want in sync_params.items():
    np.testing.assert_array_equal(params[name], want, err_msg=name)
  stale_rows, stale_params = _check_run(tmp_path, "split_k1", 8,
                                        "rollout.sampler_devices=4", "stale=1")
  assert [r["staleness/max"] for r in stale_rows] == [0, 1, 1]
  assert all(np.isfinite(r["loss"]) for r in stale_rows)
  assert any(not np.array_equal(stale_params[k], v)
             for k, v in sync_params.items())
