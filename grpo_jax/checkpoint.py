"""Orbax checkpoints: what a checkpoint holds, when it is written, the resume order.

One checkpoint is one step directory `<workdir>/checkpoints/<step>/` with three items:

  state/  the train state pytree (params, optimizer state, step, PRNG key data),
          written by every host from its shards, restorable onto any mesh;
  host/   JSON: host-side state the trainer hands in (data iterator position,
          difficulty balancer, dynamic-sampling carry-over, metrics pointer);
  meta/   JSON: the run config, the ModelConfig (so any checkpoint exports to a
          Hugging Face directory) and one checksum per array.

Orbax writes a step under `<step>.orbax-checkpoint-tmp*` and renames it once
every item is complete (on GCS: a commit_success.txt marker), so a run killed
mid-save leaves a tmp directory that `latest_step` never returns.

The checksums exist because a flipped byte inside a tensorstore data chunk
restores silently (only b-tree nodes carry a CRC): each element's bits are
hashed with its position and summed in uint32, exact integer arithmetic that
gives the same number on any mesh.

    ckpt = Checkpointer(checkpoint_dir(workdir), save_every=c.train.checkpoint_every,
                        keep=c.train.keep_checkpoints, config=c, model_config=model_config)
    kind, where = resolve_init(workdir, c.init_from, c.model.source)
    if kind == "resume":
      state, host = ckpt.restore(abstract_state, where)
    for step in range(start + 1, c.train.steps + 1):
      state = update(state, ...)
      ckpt.save(step, state, host_state, force=step == c.train.steps)
      if ckpt.preempted:                   # SIGTERM: saved above, exit cleanly
        break
    ckpt.close()
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from typing import Any, Iterable, Mapping, Optional

from absl import logging
from etils import epath
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from grpo_jax.models import save_pretrained
from grpo_jax.models.config import ModelConfig, RopeScaling

PathLike = str | os.PathLike
CHECKPOINT_SUBDIR = "checkpoints"
_FORMAT = 1
# Config fields whose change makes a resumed run a different experiment (a
# dotted prefix covers every field under it). The optimizer and the param
# dtype define the saved state; B and G shape the dynamic-sampling carry-over
# and the data position; seed and data source drive the data order after
# resume. The model's architecture is compared through its ModelConfig, so a
# moved weights directory (model.source) still resumes.
UNSAFE_FIELDS = ("optim", "model.param_dtype", "rl.num_generations",
                 "rl.prompts_per_step", "seed", "data.source")


class CheckpointError(RuntimeError):
  """A checkpoint cannot be written or used; the message says what to do."""


class CorruptCheckpointError(CheckpointError):
  """A finalised checkpoint whose files are damaged or truncated."""


class IncompatibleCheckpointError(CheckpointError):
  """A checkpoint whose arrays do not match the state being restored."""


class UnsafeResumeError(CheckpointError):
  """The config changed since the checkpoint in fields that make resuming unsafe."""


class UnwritableDirectoryError(CheckpointError):
  """A workdir or checkpoint directory this process cannot write."""


# ----------------------------------------------------------------------------
# Paths.
# ----------------------------------------------------------------------------

def _path(path: PathLike) -> epath.Path:
  """Orbax wants absolute paths; cloud URLs (gs://...) are already absolute."""
  text = os.fspath(path)
  return epath.Path(text if "://" in text else os.path.abspath(text))


def checkpoint_dir(workdir: PathLike) -> epath.Path:
  """Where a run keeps its checkpoints: `<workdir>/checkpoints`."""
  return _path(workdir) / CHECKPOINT_SUBDIR


def check_writable(directory: PathLike) -> epath.Path:
  """Creates `directory` if needed and proves this process can write there.

  Called first thing, so a bad --workdir fails before anything compiles.
  """
  path = _path(directory)
  probe = path / f".write_probe.{os.getpid()}.{jax.process_index()}"
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    raise UnwritableDirectoryError(
        f"cannot write to {path}: {e.strerror or e}. Choose a --workdir this "
        "user can write, or fix its permissions; nothing was written.") from e
  return path


def finalized_steps(directory: PathLike) -> list[int]:
  """The complete checkpoints in a checkpoint directory, oldest first."""
  path = _path(directory)
  return sorted(ocp.step.checkpoint_steps(path)) if path.is_dir() else []


def locate(source: PathLike) -> tuple[epath.Path, Optional[int]]:
  """(checkpoint directory, step or None) from a workdir, its checkpoints
  directory or one step directory; raises if no complete checkpoint is there."""
  path = _path(source)
  if (path / CHECKPOINT_SUBDIR).is_dir():
    path = path / CHECKPOINT_SUBDIR
  if path.name.isdigit() and int(path.name) in finalized_steps(path.parent):
    return path.parent, int(path.name)
  if not finalized_steps(path):
    raise CheckpointError(f"no complete checkpoint at {source} (looked for "
                          f"step directories in {path})")
  return path, None


def latest_checkpoint(workdir: PathLike) -> Optional[str]:
  """The newest complete step directory of a run, or None (for run records)."""
  steps = finalized_steps(checkpoint_dir(workdir))
  return str(checkpoint_dir(workdir) / str(steps[-1])) if steps else None


# ----------------------------------------------------------------------------
# The resume order.
# ----------------------------------------------------------------------------

def resolve_init(workdir: PathLike, init_from: Optional[PathLike] = None,
                 pretrained_source: Optional[str] = None
                 ) -> tuple[str, Any]:
  """Where a run's initial state comes from. The resume order:

  1. this run's own latest complete checkpoint in `<workdir>/checkpoints`
     -> ("resume", step): a pre-empted or crashed run continues exactly where
     it stopped, and its init fields are ignored (they were used already);
  2. else `config.init_from`, another run's checkpoint (workdir, checkpoints
     dir or step dir) -> ("init_from", step directory path): fresh optimizer,
     step 0, that checkpoint's params (`load_params`);
  3. else the pretrained weights -> ("pretrained", source) for
     `grpo_jax.models.load_pretrained`.

  Half-written checkpoints (orbax tmp directories) are never chosen.
  """
  steps = finalized_steps(checkpoint_dir(workdir))
  if steps:
    return "resume", steps[-1]
  if init_from:
    directory, step = locate(init_from)
    step = finalized_steps(directory)[-1] if step is None else step
    return "init_from", str(directory / str(step))
  if pretrained_source:
    return "pretrained", pretrained_source
  raise ValueError(f"{workdir} has no checkpoint and neither init_from nor "
                   "pretrained weights are set: nothing to start from")


# ----------------------------------------------------------------------------
# Checksums, shapes, JSON.
# ----------------------------------------------------------------------------

def _leaf_name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _as_uint32(x: jax.Array) -> jax.Array:
  """The bit pattern of every element as uint32 (64-bit ones folded)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = np.dtype(x.dtype).itemsize
  if size == 8:
    hi_lo = jax.lax.bitcast_convert_type(x, jnp.uint32)       # (..., 2)
    return hi_lo[..., 0] ^ (hi_lo[..., 1] * np.uint32(0x9E3779B1))
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _mix(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser: a bijection of uint32 that spreads bits."""
  h ^= h >> 16
  h *= np.uint32(0x85EBCA6B)
  h ^= h >> 13
  h *= np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


@jax.jit
def _leaf_checksum(x: jax.Array) -> jax.Array:
  """sum_i mix(bits_i ^ mix(i)) mod 2**32 over the row-major index i.

  Integer addition is exact and associative, so every mesh gets the same
  sum; `mix` is a bijection, so any single changed element changes it, and
  mixing in the index catches moved chunks too.
  """
  index = jnp.zeros(x.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(x.ndim)):
    index += jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * np.uint32(
        stride % 2**32)
    stride *= x.shape[axis]
  return jnp.sum(_mix(_as_uint32(x) ^ _mix(index)), dtype=jnp.uint32)


def tree_checksums(tree: Any) -> dict[str, int]:
  """{leaf name: checksum} of a pytree of arrays, identical on any mesh.

  One small jit per leaf shape (cached across trees), dispatched together.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  sums = jax.device_get([_leaf_checksum(jnp.asarray(leaf)) for _, leaf in flat])
  return {_leaf_name(path): int(value) for (path, _), value in zip(flat, sums)}


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: hasattr(x, "shape"))
  return {_leaf_name(path): tuple(leaf.shape) for path, leaf in flat}


def check_shapes(want: Any, saved: Any, where: str):
  """Raises IncompatibleCheckpointError naming every parameter whose shape
  (or presence) differs between the state to restore and the checkpoint."""
  want, saved = _flat_shapes(want), _flat_shapes(saved)
  lines = [f"  {k}: checkpoint {saved[k]}, current state {want[k]}"
           for k in sorted(want.keys() & saved.keys()) if want[k] != saved[k]]
  lines += [f"  {k}: missing from the checkpoint" for k in sorted(want.keys() - saved.keys())]
  lines += [f"  {k}: only in the checkpoint" for k in sorted(saved.keys() - want.keys())]
  if lines:
    more = f"\n  ... and {len(lines) - 12} more" if len(lines) > 12 else ""
    raise IncompatibleCheckpointError(
        f"{where} does not match the state being restored (a different model "
        "or optimizer?):\n" + "\n".join(lines[:12]) + more)


def _abstract(target: Any) -> Any:
  """ShapeDtypeStructs with shardings from arrays or ShapeDtypeStructs."""
  def one(path, x):
    if isinstance(x, jax.Array):
      x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if not isinstance(x, jax.ShapeDtypeStruct) or x.sharding is None:
      raise ValueError(f"restore target {_leaf_name(path)} must be a jax.Array or a "
                       "ShapeDtypeStruct with .sharding set (the current mesh)")
    return x
  return jax.tree_util.tree_map_with_path(one, target)


def _to_json(value: Any, what: str) -> Any:
  """A JSON round trip: what restore will hand back (tuples become lists,
  dict keys strings, numpy scalars Python numbers)."""
  def default(x):
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
      return np.asarray(x).tolist()
    raise TypeError(f"{what} holds a {type(x).__name__} ({x!r:.60}), which is "
                    "not JSON-able")
  return json.loads(json.dumps(value, default=default))


def config_to_json(config: Any) -> Optional[dict]:
  """A run config (ConfigDict or mapping) as plain JSON data."""
  if config is None:
    return None
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  return json.loads(json.dumps(config, default=repr, sort_keys=True))


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"a": {"b": 1}} -> {"a.b": 1}."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping) and value:
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def unsafe_changes(saved: Optional[Mapping], current: Optional[Mapping],
                   fields: Iterable[str] = UNSAFE_FIELDS
                   ) -> list[tuple[str, Any, Any]]:
  """(field, saved value, current value) for each listed field that differs."""
  missing = "<unset>"
  saved, current = flatten(saved or {}), flatten(current or {})
  out = []
  for key in sorted(saved.keys() | current.keys()):
    if any(key == f or key.startswith(f + ".") for f in fields):
      a, b = saved.get(key, missing), current.get(key, missing)
      if a != b:
        out.append((key, a, b))
  return out


def model_config_from_json(data: Mapping[str, Any]):
  """The ModelConfig stored by `dataclasses.asdict` (RopeScaling nested)."""
  data = dict(data)
  if data.get("rope_scaling") is not None:
    data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
  return ModelConfig(**data)


# ----------------------------------------------------------------------------
# Orbax plumbing.
# ----------------------------------------------------------------------------

def _manager(directory: epath.Path, *, keep: Optional[int] = None,
             async_save: bool = True, read_only: bool = False,
             partial: bool = False) -> ocp.CheckpointManager:
  """A manager of the three items; `partial` restores subtrees of `state`."""
  state = ocp.PyTreeCheckpointHandler() if partial else ocp.StandardCheckpointHandler()
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=async_save,
      read_only=read_only, create=not read_only)
  return ocp.CheckpointManager(
      directory, options=options,
      item_handlers={"state": state, "host": ocp.JsonCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})


def _damaged(directory: epath.Path, step: int, cause: Any) -> CorruptCheckpointError:
  """The error for a damaged step: where, why, and how to fall back by hand."""
  path = directory / str(step)
  earlier = [s for s in finalized_steps(directory) if s < step]
  if earlier:
    hint = (f"To resume from the previous checkpoint (step {earlier[-1]}), move "
            f"this one aside: mv {path} {path}.corrupt (or restore step={earlier[-1]}).")
  else:
    hint = (f"There is no earlier checkpoint; move {path} aside to start the run "
            "from its initial weights.")
  reason = str(cause).strip().splitlines()[0][:300] if str(cause).strip() else type(cause).__name__
  return CorruptCheckpointError(
      f"checkpoint step {step} at {path} is damaged: {reason}\n"
      f"Nothing was changed or deleted. {hint}")


# Orbax and tensorstore raise anything from KeyError to a bare Exception.
_READ_ERRORS = (Exception,)


def _read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  except _READ_ERRORS as e:
    raise _damaged(manager.directory, step, e) from e
  if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
    raise _damaged(manager.directory, step, "meta item missing or of an unknown format")
  return meta


def _saved_tree(manager: ocp.CheckpointManager, step: int) -> Any:
  """The saved state's tree of array metadata (shapes, dtypes)."""
  try:
    meta = manager.item_metadata(step)["state"]
    return meta.tree if hasattr(meta, "tree") else dict(meta)
  except _READ_ERRORS as e:
    raise _damaged(manager.directory, step, e) from e


def _verify(directory: epath.Path, step: int, restored: Any, expected: Mapping,
            prefix: str = ""):
  """Raises CorruptCheckpointError naming the first array whose checksum differs."""
  for name, value in tree_checksums(restored).items():
    want = expected.get(prefix + name)
    if want is not None and want != value:
      raise _damaged(directory, step, f"array {prefix + name} does not match the "
                     f"checksum written with it ({value} != {want})")


# ----------------------------------------------------------------------------
# The run's checkpointer.
# ----------------------------------------------------------------------------

class Checkpointer:
  """Saves and restores one run's checkpoints (see the module docstring).

  Args:
    directory: the run's checkpoint directory, `checkpoint_dir(workdir)`;
      created and write-checked here, before any compute.
    save_every: `should_save(step)` is true at multiples of this (step > 0);
      0 saves only when forced or pre-empted.
    keep: how many of the newest checkpoints to keep (None: all).
    async_save: write in the background; `save` returns once the arrays are
      copied to host memory, so the caller may donate them right away.
    config: the run config (ConfigDict or dict), stored with every checkpoint;
      if this directory already holds checkpoints, fields in `unsafe_fields`
      must equal the latest checkpoint's or UnsafeResumeError is raised now.
    model_config: the ModelConfig, stored so that any checkpoint exports to a
      Hugging Face directory; a change of it is unsafe as well.
    handle_sigterm: on a single host, SIGTERM requests a save at the next
      step boundary (`should_save` turns true, then `preempted`); a second
      SIGTERM falls through to the previous handler. On several hosts JAX's
      preemption sync point (orbax `reached_preemption`) plays that role.
  """

  def __init__(self, directory: PathLike, *, save_every: int,
               keep: Optional[int] = 3, async_save: bool = True,
               config: Any = None, model_config: Any = None,
               unsafe_fields: Iterable[str] = UNSAFE_FIELDS,
               handle_sigterm: bool = True):
    if save_every < 0 or (keep is not None and keep < 1):
      raise ValueError(f"save_every={save_every} must be >= 0 and keep={keep} >= 1")
    self.directory = check_writable(directory)
    self._save_every = save_every
    self._config = config_to_json(config)
    self._model_config = (None if model_config is None
                          else dataclasses.asdict(model_config))
    self._manager = _manager(self.directory, keep=keep, async_save=async_save)
    try:
      self.check_resume(unsafe_fields)
    except CheckpointError:
      self._manager.close()
      raise
    self._sigterm = False
    self._preempted = False
    self._previous_handler = self._install_sigterm() if handle_sigterm else None

  # -- queries ---------------------------------------------------------------

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    """The newest complete checkpoint's step, or None."""
    return self._manager.latest_step()

  def step_path(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def check_resume(self, unsafe_fields: Iterable[str] = UNSAFE_FIELDS):
    """Raises UnsafeResumeError if the latest checkpoint was written under a
    config (or ModelConfig) that differs in fields that make resuming unsafe."""
    step = self.latest_step()
    if step is None or (self._config is None and self._model_config is None):
      return
    meta = _read_meta(self._manager, step)
    changes = []
    if self._config is not None and meta.get("config") is not None:
      changes += unsafe_changes(meta["config"], self._config, unsafe_fields)
    if self._model_config is not None and meta.get("model_config") is not None:
      changes += unsafe_changes({"model_config": meta["model_config"]},
                                {"model_config": self._model_config}, ["model_config"])
    if changes:
      lines = "\n".join(f"  {k}: {a!r} in the checkpoint, {b!r} now" for k, a, b in changes)
      raise UnsafeResumeError(
          f"cannot resume from {self.step_path(step)}: the config changed in "
          f"fields that make resuming unsafe:\n{lines}\nResume with the "
          "checkpoint's values, or start a new run in a fresh --workdir "
          f"(init_from={self.step_path(step)} starts it from these weights).")

  # -- saving ----------------------------------------------------------------

  def should_save(self, step: int) -> bool:
    """True at multiples of save_every and at the first step boundary after a
    pre-emption notice; false for a step already saved."""
    if step in self._manager.all_steps():
      return False
    if self._sigterm or self._manager.reached_preemption(step):
      self._preempted = True
      return True
    return self._save_every > 0 and step > 0 and step % self._save_every == 0

  @property
  def preempted(self) -> bool:
    """True once `should_save` answered a pre-emption: save, then exit."""
    return self._preempted

  def save(self, step: int, state_tree: Any, host_state: Optional[dict] = None,
           *, force: bool = False) -> bool:
    """Writes a checkpoint if `should_save(step)` (or `force`); True if written.

    host_state must be JSON-able (numpy scalars are converted); restore
    returns its JSON round trip. On several hosts only process 0's copy is
    written, so it must be the same on every host.
    """
    if step in self._manager.all_steps() or not (force or self.should_save(step)):
      return False
    host = _to_json(host_state or {}, "host_state")
    meta = {"format": _FORMAT, "step": step, "saved_at": time.time(),
            "config": self._config, "model_config": self._model_config,
            "checksums": tree_checksums(state_tree)}
    self._manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state_tree), host=ocp.args.JsonSave(host),
        meta=ocp.args.JsonSave(meta)))
    if self._preempted:  # the process is about to exit: finish writing first
      self._manager.wait_until_finished()
    return True

  # -- restoring -------------------------------------------------------------

  def restore(self, target: Any, step: Optional[int] = None
              ) -> tuple[Any, dict]:
    """(state, host_state) of `step` (default: the latest) on the current mesh.

    `target` is the state's pytree of ShapeDtypeStructs with `.sharding` (or
    of arrays, whose shardings are used): the checkpoint is resharded onto
    it whatever mesh wrote it. Shapes are checked first (a mismatch names the
    parameter and both shapes), checksums after.
    """
    self._manager.wait_until_finished()  # a step being written is not there yet
    step = self.latest_step() if step is None else step
    if step is None or step not in self.all_steps():
      raise CheckpointError(f"no complete checkpoint {'' if step is None else step} "
                            f"in {self.directory}; steps there: {self.all_steps()}")
    abstract = _abstract(target)
    check_shapes(abstract, _saved_tree(self._manager, step),
                 f"checkpoint step {step} at {self.step_path(step)}")
    meta = _read_meta(self._manager, step)
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()))
    except _READ_ERRORS as e:
      raise _damaged(self.directory, step, e) from e
    _verify(self.directory, step, out.state, meta["checksums"])
    return out.state, out.host

  # -- lifetime --------------------------------------------------------------

  def wait(self):
    """Blocks until pending asynchronous saves are on disk."""
    self._manager.wait_until_finished()

  def close(self):
    """Finishes pending saves and gives SIGTERM back to its previous handler."""
    self._manager.wait_until_finished()
    self._manager.close()
    if self._previous_handler is not None:
      signal.signal(signal.SIGTERM, self._previous_handler)
      self._previous_handler = None

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc):
    self.close()

  def _install_sigterm(self):
    # Python signals only reach the main thread; several hosts must agree on
    # the step to save at, which JAX's preemption sync point does for them.
    if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
      return None
    return signal.signal(signal.SIGTERM, self._on_sigterm) or signal.SIG_DFL

  def _on_sigterm(self, signum, frame):
    if self._sigterm:  # asked twice: stop waiting for the step boundary
      signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
      self._previous_handler = None
      signal.raise_signal(signum)
      return
    self._sigterm = True
    logging.warning("SIGTERM: saving a checkpoint at the next step boundary, then exiting")


# ----------------------------------------------------------------------------
# Reading another run's checkpoint: init_from and export.
# ----------------------------------------------------------------------------

def find_step(source: PathLike, step: Optional[int] = None) -> tuple[epath.Path, int]:
  """(checkpoint directory, step) for a workdir, checkpoints dir or step dir;
  `step` None means the step dir's step, else the latest complete one."""
  directory, found = locate(source)
  steps = finalized_steps(directory)
  step = step if step is not None else (found if found is not None else steps[-1])
  if step not in steps:
    raise CheckpointError(f"no complete checkpoint step {step} in {directory}; "
                          f"steps there: {steps}")
  return directory, step


def _open(source: PathLike, step: Optional[int]) -> tuple[ocp.CheckpointManager, int]:
  directory, step = find_step(source, step)
  return _manager(directory, read_only=True, partial=True), step


def load_params(source: PathLike, target: Any = None, *, step: Optional[int] = None,
                params_key: str = "params") -> Any:
  """Only the `params_key` subtree of a checkpoint's state (for init_from and export).

  `source` is a workdir, checkpoints dir or step dir (default step: the
  latest there). `target` gives shapes and shardings (ShapeDtypeStructs or
  arrays); None puts the saved shapes on the default device.
  """
  manager, step = _open(source, step)
  try:
    saved = _saved_tree(manager, step)
    if params_key not in saved:
      raise IncompatibleCheckpointError(
          f"{manager.directory / str(step)} state has no {params_key!r} subtree; "
          f"it has {sorted(saved)}")
    if target is None:
      device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                            saved[params_key], is_leaf=lambda x: hasattr(x, "shape"))
    abstract = {params_key: _abstract(target)}
    check_shapes(abstract, {params_key: saved[params_key]},
                 f"checkpoint step {step} at {manager.directory / str(step)}")
    meta = _read_meta(manager, step)
    try:
      state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
          partial_restore=True))).state
    except _READ_ERRORS as e:
      raise _damaged(manager.directory, step, e) from e
    _verify(manager.directory, step, state, meta["checksums"])
    return state[params_key]
  finally:
    manager.close()


def load_model_config(source: PathLike, step: Optional[int] = None):
  """The ModelConfig a checkpoint was saved with."""
  manager, step = _open(source, step)
  try:
    stored = _read_meta(manager, step).get("model_config")
  finally:
    manager.close()
  if stored is None:
    raise CheckpointError(f"checkpoint step {step} in {manager.directory} stores no "
                          "ModelConfig (saved without model_config=), so it cannot "
                          "be exported")
  return model_config_from_json(stored)


def export_checkpoint(source: PathLike, step: Optional[int], out_dir: PathLike,
                      *, tokenizer=None, params_key: str = "params") -> epath.Path:
  """Writes a checkpoint's policy params as a Hugging Face directory.

  `source`: a workdir, its checkpoints dir or a step dir; `step` None is the
  latest. The directory loads with transformers and `load_pretrained`.
  """
  model_config = load_model_config(source, step)
  params = load_params(source, step=step, params_key=params_key)
  return epath.Path(save_pretrained(model_config, params, os.fspath(out_dir),
                                    tokenizer=tokenizer))
