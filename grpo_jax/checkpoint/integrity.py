"""What makes a checkpoint trustworthy: per-array checksums that any mesh
reproduces, shape checks against the state being restored, the JSON that
stores the config, and the config fields a resume must not change.

The checksums exist because a flipped byte inside a tensorstore data chunk
restores silently (only b-tree nodes carry a CRC): each element's bits are
hashed with its position and summed in uint32, exact integer arithmetic that
gives the same number on any mesh.
"""
from __future__ import annotations

import base64
import io
import json
from typing import Any, Iterable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.config import flat_fields
from grpo_jax.errors import IncompatibleCheckpointError
from grpo_jax.models.config import ModelConfig, RopeScaling

# What a resume refuses to change, by class (a dotted prefix covers every
# field under it); every other field may change on resume
# (docs/operations.md lists both). The model's architecture is compared
# through its ModelConfig, so a moved weights directory (model.source)
# still resumes.
RESUME_REFUSED = {
    # define the saved state
    "the saved state": ("optim", "model.param_dtype", "model.lora"),
    # how many optimizer updates a step is (the resume point, the schedule);
    # B and G also shape the dynamic-sampling carry-over and the data position
    "the updates per step": ("rl.prompts_per_step", "rl.num_generations",
                             "rl.num_updates", "rl.mini_batch_size"),
    # the data order and content after resume
    "the training data": ("seed", "data.source", "data.kwargs", "data.template",
                          "data.system_prompt"),
    # the policy versions of the rows a checkpoint holds in flight
    "the rows in flight": ("rollout.max_staleness", "rollout.sync_every"),
    # what eval_before is compared with at the end
    "the evaluation": ("data.eval_source", "data.eval_kwargs", "train.eval_examples",
                       "eval.n", "eval.ks", "eval.temperature", "eval.top_p"),
    # π_ref, the policy the run started from
    "the KL reference": ("init_from", "rl.kl_reference"),
}
UNSAFE_FIELDS = tuple(f for fields in RESUME_REFUSED.values() for f in fields)
# Moved data still resumes (a changed file shows as a changed example count).
SAFE_FIELDS = ("data.kwargs.path", "data.kwargs.data_dir",
               "data.eval_kwargs.path", "data.eval_kwargs.data_dir")
# Fields newer than some checkpoints: not compared when the checkpoint's
# config lacks them (those runs ran as their value now says, or differ in
# another compared field: init_from).
_ADDED_LATER = ("rl.kl_reference",)


def refused_class(field: str) -> str:
  """The `RESUME_REFUSED` class of a refused field ("" when none)."""
  for name, fields in RESUME_REFUSED.items():
    if any(field == f or field.startswith(f + ".") for f in fields):
      return name
  return ""


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


@jax.jit
def _leaf_finite(x: jax.Array) -> jax.Array:
  return jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.inexact) else True


def nonfinite_leaves(tree: Any) -> list[str]:
  """The names of the leaves of a pytree of arrays that hold a NaN or inf
  (on device: one small reduction per leaf, dispatched together)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  ok = jax.device_get([_leaf_finite(jnp.asarray(leaf)) for _, leaf in flat])
  return [_leaf_name(path) for (path, _), good in zip(flat, ok) if not good]


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


def abstract_target(target: Any) -> Any:
  """ShapeDtypeStructs with shardings from arrays or ShapeDtypeStructs."""
  def one(path, x):
    if isinstance(x, jax.Array):
      x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if not isinstance(x, jax.ShapeDtypeStruct) or x.sharding is None:
      raise ValueError(f"restore target {_leaf_name(path)} must be a jax.Array or a "
                       "ShapeDtypeStruct with .sharding set (the current mesh)")
    return x
  return jax.tree_util.tree_map_with_path(one, target)


def to_json(value: Any, what: str) -> Any:
  """A JSON round trip: what restore will hand back (tuples become lists,
  dict keys strings, numpy scalars Python numbers)."""
  def default(x):
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
      return np.asarray(x).tolist()
    raise TypeError(f"{what} holds a {type(x).__name__} ({x!r:.60}), which is "
                    "not JSON-able")
  return json.loads(json.dumps(value, default=default))


def array_text(x: np.ndarray) -> str:
  """An array as text for the JSON host state, bit-exact (dtype and shape
  kept): `text_array` gives it back."""
  buffer = io.BytesIO()
  np.save(buffer, np.asarray(x), allow_pickle=False)
  return base64.b64encode(buffer.getvalue()).decode("ascii")


def text_array(text: str) -> np.ndarray:
  return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def config_to_json(config: Any) -> Optional[dict]:
  """A run config (ConfigDict or mapping) as plain JSON data."""
  if config is None:
    return None
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  return json.loads(json.dumps(config, default=repr, sort_keys=True))


def unsafe_changes(saved: Optional[Mapping], current: Optional[Mapping],
                   fields: Iterable[str] = UNSAFE_FIELDS
                   ) -> list[tuple[str, Any, Any]]:
  """(field, saved value, current value) for each listed field that differs."""
  missing = "<unset>"
  saved, current = flat_fields(saved or {}), flat_fields(current or {})
  out = []
  for key in sorted(saved.keys() | current.keys()):
    if key in SAFE_FIELDS or (key in _ADDED_LATER and key not in saved):
      continue
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
