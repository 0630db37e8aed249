"""Tests for grpo_jax.checkpoint: round trips, retention, pre-emption, exact
resume after SIGTERM and SIGKILL, half-written and damaged checkpoints, shape
and config mismatches, unwritable workdirs, cross-mesh restore and export."""
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import errors

REPO = Path(__file__).resolve().parents[1]


class TrainState(typing.NamedTuple):
  """The trainer's state layout: step, params, optax state, PRNG key data."""
  step: jax.Array
  params: dict
  opt_state: typing.Any
  key: jax.Array


def make_state(seed: int = 0, shape=(64, 48)) -> TrainState:
  """Distinct random values everywhere (host numbers: no compiles), so a
  mix-up of params, mu and nu would show."""
  rng = np.random.default_rng(seed)

  def like(p):
    return jnp.asarray(rng.standard_normal(p.shape, np.float32)).astype(p.dtype)

  params = {"w": jnp.asarray(rng.standard_normal(shape, np.float32)),
            "layers": {"b": jnp.asarray(rng.standard_normal(shape[1:], np.float32),
                                        jnp.bfloat16)}}
  adam, rest = optax.adam(1e-2).init(params)
  adam = adam._replace(count=jnp.int32(3), mu=jax.tree.map(like, params),
                       nu=jax.tree.map(like, params))
  return TrainState(jnp.int32(7), params, (adam, *rest),
                    jnp.asarray(rng.integers(0, 2**32, 2, dtype=np.uint32)))


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def new_checkpointer(workdir, **kwargs) -> ckpt_lib.Checkpointer:
  kwargs.setdefault("save_every", 1)
  return ckpt_lib.Checkpointer(ckpt_lib.checkpoint_dir(workdir), **kwargs)


def fingerprint(directory: Path) -> dict[str, str]:
  """sha256 of every file under `directory`: proof that nothing changed."""
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def python(code: str, *, devices: int = 1, **popen) -> subprocess.Popen:
  """A fresh interpreter (XLA_FLAGS must be set before jax starts)."""
  env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}",
             JAX_PLATFORMS="cpu")
  if devices > 1:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices}")
  return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                          text=True, **popen)


def run_python(code: str, *, devices: int = 1, timeout: float = 120) -> str:
  proc = python(code, devices=devices, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT)
  out, _ = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, out[-3000:]
  return out


# ----------------------------------------------------------------------------
# Round trip, retention, pre-emption flag.
# ----------------------------------------------------------------------------

def test_round_trip_restores_state_and_host_state_exactly(tmp_path):
  state = make_state()
  host = {"data": {"epoch": 1, "position": np.int64(96)}, "carry": [[1, 2], [3]],
          "balancer": {"3": 0.25}, "metrics_line": 12}
  with new_checkpointer(tmp_path) as ckpt:
    assert ckpt.save(7, state, host)
  with new_checkpointer(tmp_path) as ckpt:   # a new process would do this
    assert ckpt.latest_step() == 7
    restored, restored_host = ckpt.restore(jax.tree.map(jnp.zeros_like, state))
  assert isinstance(restored, TrainState)
  assert_trees_equal(restored, state)
  assert restored_host == {**host, "data": {"epoch": 1, "position": 96}}


def test_async_save_does_not_read_arrays_after_save_returns(tmp_path):
  # The trainer donates the state to the next update right after save().
  state = make_state()
  expected = jax.tree.map(np.asarray, state)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
  with new_checkpointer(tmp_path, async_save=True) as ckpt:
    ckpt.save(1, state, {})
    for leaf in jax.tree.leaves(state):
      leaf.delete()
    ckpt.wait()
    restored, _ = ckpt.restore(target)
  assert_trees_equal(restored, expected)


def test_saves_every_n_steps_and_keeps_the_last_n(tmp_path):
  state = make_state(shape=(4, 3))
  with new_checkpointer(tmp_path, save_every=2, keep=2) as ckpt:
    assert [s for s in range(7) if ckpt.should_save(s)] == [2, 4, 6]
    written = [s for s in range(1, 9) if ckpt.save(s, state, {"s": s})]
    assert written == [2, 4, 6, 8]
    ckpt.wait()
    assert ckpt.all_steps() == [6, 8]
    assert not ckpt.should_save(8) and not ckpt.save(8, state, {}, force=True)
    assert ckpt.save(9, state, {"s": 9}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [8, 9]
    _, host = ckpt.restore(state, step=8)
  assert host == {"s": 8}


def test_save_every_zero_saves_only_when_forced(tmp_path):
  with new_checkpointer(tmp_path, save_every=0) as ckpt:
    assert not any(ckpt.should_save(s) for s in range(1, 50))
    assert not ckpt.save(10, {"w": jnp.ones(2)}, {})
    assert ckpt.save(10, {"w": jnp.ones(2)}, {}, force=True)
  assert ckpt_lib.finalized_steps(ckpt_lib.checkpoint_dir(tmp_path)) == [10]


def test_sigterm_requests_a_save_at_the_next_step_boundary(tmp_path):
  previous = signal.getsignal(signal.SIGTERM)
  with new_checkpointer(tmp_path, save_every=100) as ckpt:
    assert not ckpt.should_save(7) and not ckpt.preempted
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)   # Python runs the handler at the next bytecode boundary
    assert not ckpt.preempted          # only latched at a step boundary
    assert ckpt.should_save(7) and ckpt.preempted
  assert signal.getsignal(signal.SIGTERM) == previous


# ----------------------------------------------------------------------------
# Exact resume: SIGTERM (clean exit), then SIGKILL at a random step.
# ----------------------------------------------------------------------------

def toy_run(workdir, total_steps: int, sleep: float = 0.0, on_step=lambda step: None):
  """A miniature trainer: PRNG noise, adam, a host-side data position,
  donated state, the resume order and a save at every boundary."""
  opt = optax.adam(0.05)
  params = {"w": jnp.zeros((8,)), "b": jnp.zeros(())}
  state = TrainState(jnp.int32(0), params, opt.init(params),
                     jax.random.key_data(jax.random.key(0)))
  host = {"data_position": 0}
  ckpt = new_checkpointer(workdir, save_every=3, keep=2,
                          config={"seed": 0, "optimizer": {"lr": 0.05}})
  kind, where = ckpt_lib.resolve_init(workdir, None, "scratch")
  if kind == "resume":
    state, host = ckpt.restore(state, where)

  def loss(p, x):
    return jnp.mean((p["w"] * x + p["b"] - jnp.cos(x)) ** 2)

  @jax.jit
  def update(state, x):
    key, sub = jax.random.split(jax.random.wrap_key_data(state.key))
    grads = jax.grad(loss)(state.params, x + 0.1 * jax.random.normal(sub, x.shape))
    updates, opt_state = opt.update(grads, state.opt_state)
    return TrainState(state.step + 1, optax.apply_updates(state.params, updates),
                      opt_state, jax.random.key_data(key))

  update = jax.jit(update, donate_argnums=0)
  while int(state.step) < total_steps:
    x = np.sin(np.arange(8) + host["data_position"]).astype(np.float32)
    host = {"data_position": host["data_position"] + 1}
    state = update(state, x)
    step = int(state.step)
    ckpt.save(step, state, host, force=step == total_steps)
    print(f"step {step}", flush=True)
    on_step(step)
    if ckpt.preempted:
      break
    time.sleep(sleep)
  ckpt.close()
  return state, host


def _sigterm_at(stop_at: int):
  def on_step(step):
    if step == stop_at:
      os.kill(os.getpid(), signal.SIGTERM)
  return on_step


def _sigkill_child_at(workdir, stop_at: int) -> tuple[int, list[int]]:
  """Runs toy_run in a child and SIGKILLs it once it printed `step stop_at`."""
  proc = python(f"import test_checkpoint as t; t.toy_run({str(workdir)!r}, 24, 0.02)",
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
  watchdog = threading.Timer(120, proc.kill)
  watchdog.start()
  steps = []
  for line in proc.stdout:
    steps.append(int(line.split()[1]))
    if steps[-1] == stop_at:
      proc.kill()
  watchdog.cancel()
  return proc.wait(), steps


def test_resume_after_sigterm_and_sigkill_is_bitwise_exact(tmp_path):
  reference, reference_host = toy_run(tmp_path / "reference", 24)
  workdir = tmp_path / "interrupted"
  # SIGTERM after step 4: saved at the next step boundary, then a normal return.
  state, _ = toy_run(workdir, 24, on_step=_sigterm_at(4))
  assert int(state.step) == 5
  assert ckpt_lib.finalized_steps(ckpt_lib.checkpoint_dir(workdir)) == [3, 5]
  # SIGKILL at a random later step, possibly in the middle of a save.
  kill_at = random.Random().randint(7, 20)
  rc, steps = _sigkill_child_at(workdir, kill_at)
  assert rc == -signal.SIGKILL and steps[0] == 6, (rc, kill_at, steps)
  resumed, resumed_host = toy_run(workdir, 24)
  assert resumed_host == reference_host
  assert_trees_equal(resumed, reference), f"killed at step {kill_at}"


# ----------------------------------------------------------------------------
# Half-written, damaged and mismatched checkpoints.
# ----------------------------------------------------------------------------

_KILLED_MID_SAVE = r"""
import sys, time, jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from grpo_jax import checkpoint as c
ckpt = c.Checkpointer(c.checkpoint_dir(sys.argv[1]), save_every=1)
ckpt.save(1, {"w": jnp.ones((256, 256))}, {"step": 1}); ckpt.wait()
async def hang(self, *args, **kwargs):   # every file written, rename pending
  print("finalizing", flush=True); time.sleep(600)
atomicity.AtomicRenameTemporaryPath.finalize = hang
ckpt.save(2, {"w": jnp.full((256, 256), 2.0)}, {"step": 2})
time.sleep(600)
"""


def test_checkpoint_killed_mid_save_is_never_picked_up(tmp_path):
  proc = python(_KILLED_MID_SAVE.replace("sys.argv[1]", repr(str(tmp_path))),
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
  try:
    assert proc.stdout.readline().strip() == "finalizing"
  finally:
    proc.kill()
    proc.wait()
  directory = ckpt_lib.checkpoint_dir(tmp_path)
  leftovers = [p.name for p in Path(directory).iterdir() if ".orbax-checkpoint-tmp" in p.name]
  assert leftovers and leftovers[0].startswith("2.")
  assert ckpt_lib.resolve_init(tmp_path, None, "tiny") == ("resume", 1)
  with new_checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 1
    state, host = ckpt.restore({"w": jnp.zeros((256, 256))})
  assert float(state["w"][0, 0]) == 1.0 and host == {"step": 1}


def _two_steps(workdir) -> tuple[TrainState, Path]:
  state = make_state()
  with new_checkpointer(workdir) as ckpt:
    ckpt.save(1, state, {"s": 1})
    ckpt.save(2, state, {"s": 2})
  return state, Path(ckpt_lib.checkpoint_dir(workdir))


def _flip_a_byte(path: Path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


def _truncate(path: Path):
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate])
def test_damaged_checkpoint_fails_clearly_and_is_left_alone(tmp_path, damage):
  state, directory = _two_steps(tmp_path)
  largest = max((p for p in (directory / "2" / "state").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)   # the array data
  damage(largest)
  before = fingerprint(directory)
  with new_checkpointer(tmp_path) as ckpt:
    with pytest.raises(errors.CorruptCheckpointError) as error:
      ckpt.restore(state)
    message = str(error.value)
    assert f"step 2 at {directory / '2'}" in message
    assert "previous checkpoint (step 1)" in message
    restored, host = ckpt.restore(state, step=1)   # the suggested fallback works
  assert fingerprint(directory) == before
  assert_trees_equal(restored, state) and host == {"s": 1}


def test_flipped_data_byte_is_caught_by_the_checksum_naming_the_array(tmp_path):
  # Orbax reads a flipped byte inside a data chunk back silently.
  params = {"a": jnp.zeros((4,)), "big": jnp.arange(64 * 64, dtype=jnp.float32)}
  with new_checkpointer(tmp_path) as ckpt:
    ckpt.save(1, params, {})
  state_dir = Path(ckpt_lib.checkpoint_dir(tmp_path)) / "1" / "state"
  _flip_a_byte(max((p for p in state_dir.rglob("*") if p.is_file()),
                   key=lambda p: p.stat().st_size))
  with new_checkpointer(tmp_path) as ckpt:
    with pytest.raises(errors.CorruptCheckpointError, match="array big does not match"):
      ckpt.restore(params)


def test_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path):
  with new_checkpointer(tmp_path) as ckpt:
    ckpt.save(1, make_state(shape=(64, 48)), {})
    with pytest.raises(errors.IncompatibleCheckpointError) as error:
      ckpt.restore(make_state(shape=(64, 32)))
  message = str(error.value)
  assert "params/w: checkpoint (64, 48), current state (64, 32)" in message
  assert "params/layers/b: checkpoint (48,), current state (32,)" in message


def test_missing_parameter_is_named(tmp_path):
  state = make_state()
  with new_checkpointer(tmp_path) as ckpt:
    ckpt.save(1, {"params": state.params}, {})
    bigger = {"params": {**state.params, "lm_head": jnp.zeros((3, 3))}}
    with pytest.raises(errors.IncompatibleCheckpointError,
                       match="params/lm_head: missing from the checkpoint"):
      ckpt.restore(bigger)


def test_unsafe_config_change_names_the_fields(tmp_path):
  from grpo_jax.config import base_config
  from grpo_jax.models import get_preset
  config, tiny = base_config(), get_preset("tiny")
  with new_checkpointer(tmp_path, config=config, model_config=tiny) as ckpt:
    ckpt.save(1, {"w": jnp.ones(3)}, {})
  before = fingerprint(Path(ckpt_lib.checkpoint_dir(tmp_path)))
  # Safe changes (run length, a loss knob, moved weights) resume.
  safe = base_config()
  safe.train.steps, safe.rl.eps_high, safe.model.source = 99, 0.2, "/new/place"
  new_checkpointer(tmp_path, config=safe, model_config=tiny).close()
  unsafe = base_config()
  unsafe.optim.learning_rate, unsafe.rl.num_generations = 1e-5, 16
  with pytest.raises(errors.UnsafeResumeError) as error:
    new_checkpointer(tmp_path, config=unsafe, model_config=tiny.replace(dim=128))
  message = str(error.value)
  for field in ("optim.learning_rate: 1e-06 in the checkpoint, 1e-05 now",
                "rl.num_generations: 8 in the checkpoint, 16 now",
                "model_config.dim: 64 in the checkpoint, 128 now"):
    assert field in message
  assert "eps_high" not in message and "train.steps" not in message
  assert fingerprint(Path(ckpt_lib.checkpoint_dir(tmp_path))) == before


def test_unsafe_fields_name_fields_of_the_real_config():
  from grpo_jax.config import base_config, flat_fields
  fields = flat_fields(base_config().to_dict())
  for prefix in ckpt_lib.UNSAFE_FIELDS:
    assert any(k == prefix or k.startswith(prefix + ".") for k in fields), prefix


def test_unwritable_workdir_fails_before_anything_is_written(tmp_path):
  # Tests run as root, which ignores permission bits: a path below a regular
  # file cannot be created by anyone.
  blocker = tmp_path / "not_a_directory"
  blocker.write_text("keep me")
  workdir = blocker / "run"
  with pytest.raises(errors.UnwritableDirectoryError, match=f"cannot write to {workdir}"):
    new_checkpointer(workdir)
  assert blocker.read_text() == "keep me"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_directory"]


# ----------------------------------------------------------------------------
# The resume order, init_from and export.
# ----------------------------------------------------------------------------

def test_resolve_init_follows_the_resume_order(tmp_path):
  other, own = tmp_path / "other_run", tmp_path / "this_run"
  state, _ = _two_steps(other)
  assert ckpt_lib.resolve_init(own, None, "tiny") == ("pretrained", "tiny")
  kind, where = ckpt_lib.resolve_init(own, other, "tiny")
  assert (kind, Path(where)) == ("init_from", Path(ckpt_lib.checkpoint_dir(other)) / "2")
  params = ckpt_lib.load_params(where, jax.tree.map(jnp.zeros_like, state.params))
  assert_trees_equal(params, state.params)
  with new_checkpointer(own) as ckpt:
    ckpt.save(3, state, {})
  assert ckpt_lib.resolve_init(own, other, "tiny") == ("resume", 3)
  with pytest.raises(errors.CheckpointError, match="no complete checkpoint"):
    ckpt_lib.resolve_init(tmp_path / "fresh", tmp_path / "missing", "tiny")
  with pytest.raises(ValueError, match="nothing to start from"):
    ckpt_lib.resolve_init(tmp_path / "fresh", None, None)


def test_export_writes_a_hugging_face_directory_that_loads_back(tmp_path):
  from grpo_jax import models
  config = models.get_preset("tiny")
  rng = np.random.default_rng(0)   # host random numbers: no compiles
  params = jax.tree.map(lambda shape: jnp.asarray(rng.standard_normal(shape, np.float32)),
                        models.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
  state = TrainState(jnp.int32(5), params, optax.adam(1e-3).init(params),
                     jax.random.key_data(jax.random.key(1)))
  with new_checkpointer(tmp_path / "run", model_config=config) as ckpt:
    ckpt.save(5, state, {})
  out = tmp_path / "hf"
  proc = subprocess.run(
      [sys.executable, "experiments/export.py", f"--workdir={tmp_path / 'run'}",
       f"--out={out}"], cwd=REPO, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip() == (f"exported step 5 of {ckpt_lib.checkpoint_dir(tmp_path / 'run')}"
                                 f" to {out}")
  loaded_config, loaded = models.load_pretrained(str(out), dtype=None)
  assert loaded_config == config
  assert_trees_equal(loaded, params)


# ----------------------------------------------------------------------------
# Cross-mesh restore: 8 devices -> 1 device -> 8 devices on another mesh.
# ----------------------------------------------------------------------------

_SAVE_ON_8 = r"""
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from grpo_jax import checkpoint as c
assert jax.device_count() == 8
mesh = Mesh(np.array(jax.devices()), ("data",))
w = jax.device_put(np.arange(64 * 16, dtype=np.float32).reshape(64, 16),
                   NamedSharding(mesh, P("data", None)))
b = jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(mesh, P()))
assert len(w.sharding.device_set) == 8
with c.Checkpointer(c.checkpoint_dir(WORKDIR), save_every=1) as ckpt:
  ckpt.save(1, {"params": {"w": w, "b": b}, "step": np.int32(1)}, {"mesh": "8"})
"""

_RESTORE_ON_8 = r"""
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from grpo_jax import checkpoint as c
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
spec = {"params": {"w": P("model", "data"), "b": P("model")}, "step": P()}
target = {"params": {"w": jax.ShapeDtypeStruct((64, 16), np.float32),
                     "b": jax.ShapeDtypeStruct((16,), np.float32)},
          "step": jax.ShapeDtypeStruct((), np.int32)}
target = jax.tree.map(lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype,
                      sharding=NamedSharding(mesh, s)), target, spec)
with c.Checkpointer(c.checkpoint_dir(WORKDIR), save_every=1) as ckpt:
  state, host = ckpt.restore(target)
w = state["params"]["w"]
assert w.sharding == target["params"]["w"].sharding and len(w.sharding.device_set) == 8
assert w.addressable_shards[0].data.shape == (16, 8)
np.testing.assert_array_equal(np.asarray(w), 2 * np.arange(64 * 16).reshape(64, 16))
np.testing.assert_array_equal(np.asarray(state["params"]["b"]), 2 * np.arange(16))
assert host == {"mesh": "1"} and int(state["step"]) == 2
print("restored on 8")
"""


def test_restore_onto_a_different_mesh_and_back(tmp_path):
  on8, on1 = tmp_path / "saved_on_8", tmp_path / "saved_on_1"
  run_python(_SAVE_ON_8.replace("WORKDIR", repr(str(on8))), devices=8)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {"params": {"w": jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=device),
                       "b": jax.ShapeDtypeStruct((16,), jnp.float32, sharding=device)},
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=device)}
  with new_checkpointer(on8) as ckpt:
    state, host = ckpt.restore(target)
  assert host == {"mesh": "8"} and state["params"]["w"].sharding == device
  np.testing.assert_array_equal(np.asarray(state["params"]["w"]),
                                np.arange(64 * 16).reshape(64, 16))
  doubled = {"params": jax.tree.map(lambda x: 2 * x, state["params"]),
             "step": jnp.int32(2)}
  with new_checkpointer(on1) as ckpt:
    ckpt.save(2, doubled, {"mesh": "1"})
  assert "restored on 8" in run_python(_RESTORE_ON_8.replace("WORKDIR", repr(str(on1))),
                                       devices=8)


def test_a_gemma_model_config_resumes_as_itself(tmp_path):
  """Tuple fields (Gemma's layer_types) are stored as JSON lists: the same
  model config is no change on resume, and it exports back equal."""
  from grpo_jax.models import get_preset
  gemma = get_preset("tiny-gemma")
  with new_checkpointer(tmp_path, model_config=gemma) as ckpt:
    ckpt.save(1, {"w": jnp.ones(3)}, {})
  new_checkpointer(tmp_path, model_config=gemma).close()
  assert ckpt_lib.load_model_config(tmp_path) == gemma
