"""Orbax I/O: the checkpoint manager, reading and verifying one step, and
reading another run's checkpoint (init_from, evaluation, export)."""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath

from grpo_jax.checkpoint.integrity import (
  abstract_target,
  check_shapes,
  model_config_from_json,
  tree_checksums,
)
from grpo_jax.checkpoint.paths import PathLike, finalized_steps, find_step
from grpo_jax.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from grpo_jax.models import save_pretrained

FORMAT = 1

def manager(directory: epath.Path, *, keep: Optional[int] = None,
             async_save: bool = True, read_only: bool = False,
             partial: bool = False) -> ocp.CheckpointManager:
  """A manager of the three items; `partial` restores subtrees of `state`."""
  state = ocp.PyTreeCheckpointHandler() if partial else ocp.StandardCheckpointHandler()
  # A reader saves nothing: save_interval_steps=0 says so (orbax warns
  # that it sets it otherwise, once per manager).
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, enable_async_checkpointing=async_save,
      read_only=read_only, create=not read_only,
      **({"save_interval_steps": 0} if read_only else {}))
  return ocp.CheckpointManager(
      directory, options=options,
      item_handlers={"state": state, "host": ocp.JsonCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})


def damaged(directory: epath.Path, step: int, cause: Any) -> CorruptCheckpointError:
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
READ_ERRORS = (Exception,)


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  except READ_ERRORS as e:
    raise damaged(manager.directory, step, e) from e
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise damaged(manager.directory, step, "meta item missing or of an unknown format")
  return meta


def saved_tree(manager: ocp.CheckpointManager, step: int) -> Any:
  """The saved state's tree of array metadata (shapes, dtypes)."""
  try:
    meta = manager.item_metadata(step)["state"]
    return meta.tree if hasattr(meta, "tree") else dict(meta)
  except READ_ERRORS as e:
    raise damaged(manager.directory, step, e) from e


def verify(directory: epath.Path, step: int, restored: Any, expected: Mapping,
            prefix: str = ""):
  """Raises CorruptCheckpointError naming the first array whose checksum differs."""
  for name, value in tree_checksums(restored).items():
    want = expected.get(prefix + name)
    if want is not None and want != value:
      raise damaged(directory, step, f"array {prefix + name} does not match the "
                     f"checksum written with it ({value} != {want})")



# ----------------------------------------------------------------------------
# Reading another run's checkpoint: init_from and export.
# ----------------------------------------------------------------------------

def _open(source: PathLike, step: Optional[int]) -> tuple[ocp.CheckpointManager, int]:
  directory, step = find_step(source, step)
  return manager(directory, read_only=True, partial=True), step


def load_params(source: PathLike, target: Any = None, *, step: Optional[int] = None,
                params_key: str = "params") -> Any:
  """Only the `params_key` subtree of a checkpoint's state (for init_from and export).

  `source` is a workdir, checkpoints dir or step dir (default step: the
  latest there). `target` gives shapes and shardings (ShapeDtypeStructs or
  arrays); None puts the saved shapes on the default device.
  """
  manager, step = _open(source, step)
  try:
    saved = saved_tree(manager, step)
    if params_key not in saved:
      raise IncompatibleCheckpointError(
          f"{manager.directory / str(step)} state has no {params_key!r} subtree; "
          f"it has {sorted(saved)}")
    if target is None:
      device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                            saved[params_key], is_leaf=lambda x: hasattr(x, "shape"))
    abstract = {params_key: abstract_target(target)}
    check_shapes(abstract, {params_key: saved[params_key]},
                 f"checkpoint step {step} at {manager.directory / str(step)}")
    meta = read_meta(manager, step)
    try:
      state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
          partial_restore=True))).state
    except READ_ERRORS as e:
      raise damaged(manager.directory, step, e) from e
    verify(manager.directory, step, state, meta["checksums"])
    return state[params_key]
  finally:
    manager.close()


def load_model_config(source: PathLike, step: Optional[int] = None):
  """The ModelConfig a checkpoint was saved with."""
  manager, step = _open(source, step)
  try:
    stored = read_meta(manager, step).get("model_config")
  finally:
    manager.close()
  if stored is None:
    raise CheckpointError(f"checkpoint step {step} in {manager.directory} stores no "
                          "ModelConfig (saved without model_config=), so it cannot "
                          "be exported")
  return model_config_from_json(stored)


def load_config(source: PathLike, step: Optional[int] = None) -> Optional[dict]:
  """The run config a checkpoint was saved with (JSON), or None."""
  manager, step = _open(source, step)
  try:
    return read_meta(manager, step).get("config")
  finally:
    manager.close()


def load_host_state(source: PathLike, step: Optional[int] = None) -> dict:
  """The host state (JSON) a checkpoint was saved with, e.g. a LoRA run's
  "lora_base" (what identifies the frozen base)."""
  manager, step = _open(source, step)
  try:
    return manager.restore(step, args=ocp.args.Composite(
        host=ocp.args.JsonRestore())).host or {}
  except READ_ERRORS as e:
    raise damaged(manager.directory, step, e) from e
  finally:
    manager.close()


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
